"""The converged MuJoCo tables (docs/results.md) from the per-run JSON of scripts/results_mujoco.sh.

    python scripts/results_table.py docs/results/hopper-v1
    python scripts/results_table.py docs/results/walker2d-v1 --task walker2d

Reads ``<algo>-<task>-<dataset>.json`` (a sweep's ``results.json``: its completed runs' final
``eval/normalized_score``), else the runs' ``<algo>-<task>-<dataset>-s<seed>.eval.json``
(``rl-tformers eval --out``), and ``peers-<task>-<dataset>.json`` (the d3rlpy cross-check), and
prints one markdown row per dataset: mean ± std (ddof 0) over seeds, the seeds counted, and each
seed's score.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ALGOS = (("dt", "DT (top return)"), ("bc", "BC"), ("bc10", "%BC (top 10%)"))
DATASETS = ("medium", "medium-replay", "medium-expert")


def _sweep_scores(path: Path) -> tuple[list[float], list[float]]:
    """(final scores, wall seconds of training) of a sweep's completed runs, by seed."""
    data = json.loads(path.read_text())
    runs = sorted((r for r in data["runs"] if r.get("status") in ("ok", "skipped")
                   and isinstance(r.get("eval/normalized_score"), (int, float))), key=lambda r: r["seed"])
    return [float(r["eval/normalized_score"]) for r in runs], [float(r.get("seconds") or 0.0) for r in runs]


def _eval_scores(folder: Path, stem: str) -> list[float]:
    """The scores of ``<stem>-s<seed>.eval.json`` files (one target each), by seed."""
    out = []
    for f in sorted(folder.glob(f"{stem}-s*.eval.json")):
        (res,) = json.loads(f.read_text())["results"]
        out.append(float(res["normalized_score"]))
    return out


def _peer_scores(folder: Path, dataset: str) -> dict[str, list[float]]:
    """d3rlpy's scores per algorithm in ``peers-<dataset>.json`` (``dataset``: task and level,
    e.g. ``hopper-medium``; empty when absent)."""
    path = folder / f"peers-{dataset}.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    out: dict[str, list[float]] = {}
    for row in data.get("rows", []):
        out[str(row["algo"])] = [float(v) for v in row.get("per_seed_normalised", [])]
    return out


def cell(scores: list[float]) -> str:
    """``mean ± std (n=k: a, b, c)``, or ``-`` with no score."""
    if not scores:
        return "-"
    m = math.fsum(scores) / len(scores)
    s = math.sqrt(math.fsum((x - m) ** 2 for x in scores) / len(scores))
    return f"{m:.1f} ± {s:.1f} (n={len(scores)}: {', '.join(f'{x:.1f}' for x in scores)})"


def minutes(seconds: list[float]) -> str:
    """Mean training minutes per run of the runs that recorded their time, or ``-``."""
    known = [s for s in seconds if s > 0]
    return f"{math.fsum(known) / len(known) / 60:.0f}" if known else "-"


def table(folder: Path, task: str = "hopper") -> str:
    """The markdown table of every dataset of ``task`` with at least one score; the last column is
    each algorithm's mean training time per run in minutes (DT / BC / %BC, from the sweeps' records)."""
    head = ("| dataset | " + " | ".join(name for _, name in ALGOS)
            + " | d3rlpy IQL | d3rlpy CQL | minutes per run (" + " / ".join(n.split(" (")[0] for _, n in ALGOS) + ") |")
    lines = [head, "|" + "---|" * (len(ALGOS) + 4)]
    for level in DATASETS:
        dataset = f"{task}-{level}"
        cells, times = [], []
        for algo, _ in ALGOS:
            sweep = folder / f"{algo}-{dataset}.json"
            scores, seconds = _sweep_scores(sweep) if sweep.exists() else (_eval_scores(folder, f"{algo}-{dataset}"), [])
            cells.append(cell(scores))
            times.append(minutes(seconds))
        peers = _peer_scores(folder, dataset)
        cells += [cell(peers.get("iql", [])), cell(peers.get("cql", []))]
        if any(c != "-" for c in cells):
            lines.append(f"| {dataset} | " + " | ".join(cells) + " | " + " / ".join(times) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--task", default="hopper", choices=("hopper", "walker2d", "halfcheetah"))
    args = ap.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder}: not a folder", file=sys.stderr)
        return 2
    print(table(args.folder, args.task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
