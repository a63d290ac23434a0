"""One figure of learning curves: a panel per dataset, a curve per algorithm.

    python scripts/results_curves.py docs/results/hopper-v1 --out docs/results/hopper-v1/curves.png

Reads every ``<algo>-<task>-<dataset>.curves.json`` in the folder (the ``curves.json`` of a
``rl-tformers sweep``, copied by ``scripts/results_hopper.sh``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rl_tformers.runtime.curves import plot_curve_panels, read_curves

ALGOS = {"dt": "DT", "bc": "BC", "bc10": "%BC (top 10%)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    panels: dict[str, dict] = {}
    metric = None
    for f in sorted(args.folder.glob("*.curves.json")):
        algo, _, dataset = f.name.removesuffix(".curves.json").partition("-")
        metric, points = read_curves(f)
        for curve in points.values():  # one grid point per sweep here (seeds only)
            panels.setdefault(dataset, {})[ALGOS.get(algo, algo)] = curve
    if not panels:
        print(f"error: no *.curves.json in {args.folder}", file=sys.stderr)
        return 2
    print(plot_curve_panels(dict(sorted(panels.items())), metric or "", args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
