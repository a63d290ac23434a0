"""Learning curves: an evaluation metric against training updates, per run and over seeds.

A run that evaluates every ``eval.every`` updates logs ``eval/...`` scalars at those steps in its
``metrics.jsonl``; its learning curve is that metric's values in step order. A grid point's
curve is the mean and standard deviation (ddof 0) over its seeds at each step every seed
logged, so a point never mixes a seed's early steps with another seed's late ones.
``rl-tformers sweep`` writes ``curves.json`` and ``curves.png`` of its points next to its
results table; :func:`plot_curve_panels` draws several sweeps' curves as panels of one figure.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any


def run_curve(records: Iterable[Mapping[str, Any]], metric: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every finite ``metric`` value in ``records`` (``metrics.jsonl``
    records in order), by step; a step logged twice (a resumed run repeating an evaluation)
    keeps its last value."""
    by_step: dict[int, float] = {}
    for rec in records:
        value, step = rec.get(metric), rec.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and isinstance(step, int):
            by_step[step] = float(value)
    return sorted(by_step.items())


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> dict[str, list[float]]:
    """Mean and std (ddof 0) over ``curves`` at each step all of them logged.

    Returns:
        ``{"steps": [...], "mean": [...], "std": [...], "n": number of curves}``; empty lists
        when the curves share no step (or there are none).
    """
    if not curves:
        return {"steps": [], "mean": [], "std": [], "n": 0}
    common = set.intersection(*(set(s for s, _ in c) for c in curves))
    steps = sorted(common)
    tables = [dict(c) for c in curves]
    means, stds = [], []
    for s in steps:
        vals = [t[s] for t in tables]
        m = math.fsum(vals) / len(vals)
        means.append(m)
        stds.append(math.sqrt(math.fsum((v - m) ** 2 for v in vals) / len(vals)))
    return {"steps": steps, "mean": means, "std": stds, "n": len(curves)}


def point_curves(groups: Mapping[str, Sequence[Sequence[tuple[int, float]]]]) -> dict[str, dict[str, list[float]]]:
    """:func:`mean_curve` of each group (a grid point's seeds), skipping groups with no curve."""
    return {label: mean_curve([c for c in curves if c]) for label, curves in groups.items()
            if any(curves)}


def write_curves(curves: Mapping[str, Mapping[str, Any]], metric: str, path: str | os.PathLike) -> Path:
    """Write ``{"metric": metric, "points": curves}`` as JSON to ``path``."""
    path = Path(path)
    path.write_text(json.dumps({"metric": metric, "points": curves}, indent=1))
    return path


def read_curves(path: str | os.PathLike) -> tuple[str, dict[str, dict[str, list[float]]]]:
    """``(metric, points)`` of a ``curves.json`` (:func:`write_curves`).

    Raises:
        ValueError: the file is not such a JSON object (names the file).
    """
    try:
        data = json.loads(Path(path).read_text())
        return str(data["metric"]), dict(data["points"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a curves.json written by rl-tformers sweep ({exc})") from None


def plot_curve_panels(panels: Mapping[str, Mapping[str, Mapping[str, Any]]], metric: str,
                      path: str | os.PathLike, *, title: str | None = None) -> Path:
    """One panel per entry of ``panels`` (``{panel title: {label: curve}}``): each curve's mean
    against updates with a ±1 std band, a label in the same colour in every panel; legends below
    the axes. Returns the written path."""
    import matplotlib  # optional heavy dependency: only figures need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    thousands = FuncFormatter(lambda x, _: f"{x / 1000:g}k" if abs(x) >= 1000 else f"{x:g}")
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.8), squeeze=False, sharey=True)
    labels = list(dict.fromkeys(label for curves in panels.values() for label in curves))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = {label: cycle[i % len(cycle)] for i, label in enumerate(labels)}  # one colour per label in every panel
    for ax, (name, curves) in zip(axes[0], panels.items()):
        for label, c in curves.items():
            if not c.get("steps"):
                continue
            lo = [m - s for m, s in zip(c["mean"], c["std"])]
            hi = [m + s for m, s in zip(c["mean"], c["std"])]
            (line,) = ax.plot(c["steps"], c["mean"], marker="o", ms=3, label=f"{label} (n={c['n']})",
                              color=colours[label])
            ax.fill_between(c["steps"], lo, hi, color=line.get_color(), alpha=0.15)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("updates")
        ax.xaxis.set_major_formatter(thousands)  # 20k, not 20000 (ticks of 5 digits run together)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, ncol=2, frameon=False)
    axes[0][0].set_ylabel(metric)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
