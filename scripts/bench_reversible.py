#!/usr/bin/env python
"""Thin entry point: activation memory vs depth of reversible layers (see rl_tformers.bench.reversible).

    python scripts/bench_reversible.py --depths 2,4,8,16 [--device cuda] [--json]
"""

from rl_tformers.bench.reversible import main

if __name__ == "__main__":
    main()
