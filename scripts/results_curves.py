"""One figure of learning curves: a panel per dataset, a curve per algorithm.

    python scripts/results_curves.py docs/results/hopper-v1 --out docs/results/hopper-v1/curves.png

Reads every ``<algo>-<task>-<dataset>.curves.json`` in the folder (the ``curves.json`` of a
``rl-tformers sweep``, copied by ``scripts/results_mujoco.sh``), and the d3rlpy peers' runs in
``peers-<task>-<dataset>.json`` that carry a learning curve (``crosscheck --eval-every``),
normalised with the reference scores that file records (drawn beside sweeps' curves of
``eval/normalized_score`` only). A file that cannot be read is one ``error: ...`` line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from rl_tformers.runtime.curves import mean_curve, plot_curve_panels, read_curves

ALGOS = {"dt": "DT", "bc": "BC", "bc10": "%BC (top 10%)"}
NORMALISED = "eval/normalized_score"  # the sweeps' metric the peers' curves share an axis with
PEERS = {"iql": "d3rlpy IQL", "cql": "d3rlpy CQL", "dt": "d3rlpy DT", "bc": "d3rlpy BC"}


def peer_curves(path: Path) -> dict[str, dict]:
    """``{label: {steps, mean, std, n}}`` of the runs with a curve in a cross-check JSON, one per
    algorithm and target (DT's labels name the target): the normalised score (100 x (return -
    random) / (expert - random)) per evaluation, mean and std (ddof 0) over the seeds that have a
    curve (``n``), at the steps every one of them evaluated.

    Raises:
        ValueError: the file is not a cross-check JSON with reference scores ``random < expert``
            (names the file).
    """
    try:
        data = json.loads(path.read_text())
        lo, hi = (float(v) for v in data["reference_scores"])
        if not lo < hi:
            raise ValueError(f"reference_scores {data['reference_scores']}: random is not below expert")
        by_label: dict[str, list[dict[int, float]]] = {}
        for run in data["runs"]:
            runs: dict[str, dict[int, float]] = {}
            for c in run.get("curve") or []:
                for r in c["results"]:
                    label = PEERS.get(run["algo"], f"d3rlpy {run['algo']}")
                    if r["target"] is not None:
                        label += f" (target {r['target']:.0f})"
                    runs.setdefault(label, {})[int(c["step"])] = (
                        100.0 * (float(np.mean(r["returns"])) - lo) / (hi - lo))
            for label, points in runs.items():
                by_label.setdefault(label, []).append(points)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a cross-check JSON of python -m rl_tformers.bench.crosscheck "
                         f"({type(exc).__name__}: {exc})") from None
    return {label: mean_curve([sorted(r.items()) for r in runs]) for label, runs in by_label.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    panels: dict[str, dict] = {}
    metric = None
    try:
        for f in sorted(args.folder.glob("*.curves.json")):
            algo, _, dataset = f.name.removesuffix(".curves.json").partition("-")
            metric, points = read_curves(f)
            for curve in points.values():  # one grid point per sweep here (seeds only)
                panels.setdefault(dataset, {})[ALGOS.get(algo, algo)] = curve
        for f in sorted(args.folder.glob("peers-*.json")):
            dataset = f.name.removesuffix(".json").removeprefix("peers-")
            if dataset not in panels:
                continue
            curves = peer_curves(f)
            if curves and metric != NORMALISED:  # the peers' curves are normalised scores: not on another axis
                print(f"{f}: its curves are not drawn: the sweeps' curves are {metric}, not {NORMALISED}",
                      file=sys.stderr)
                continue
            panels[dataset].update(curves)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not panels:
        print(f"error: no *.curves.json in {args.folder}", file=sys.stderr)
        return 2
    print(plot_curve_panels(dict(sorted(panels.items())), metric or "", args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
