#!/usr/bin/env python
"""Thin entry point: image encoder step time, fp32 vs channels_last vs bf16 autocast (see rl_tformers.bench.encoders).

    python scripts/bench_encoders.py --frames 256 --repeats 10 [--device cuda] [--json]
"""

from rl_tformers.bench.encoders import main

if __name__ == "__main__":
    main()
