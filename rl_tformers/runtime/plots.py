"""Return-conditioned rollout plots (matplotlib, Agg backend; no display needed).

:func:`plot_return_conditioning` draws the Decision Transformer paper's figure 4 (Chen et al.
2021): achieved return against target return over a sweep of targets, with the y = x line,
the training dataset's range of episode returns (a shaded band over the targets it holds), its
best and mean return, each episode as a dot and the mean +- std over episodes. A second panel
shows, per episode, the remaining return-to-go the agent was conditioned on (target minus reward
collected so far) and the cumulative reward, both against the environment step: a
return-following agent has the two curves meet at the end. Legends sit outside the axes, so they
never cover a trace.

:func:`default_sweep` picks targets from the random policy's return (or the dataset's worst) to
beyond the dataset's best, so the figure shows where the agent tracks its target and where it
saturates.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

from rl_tformers.runtime.paths import SEPARATORS, blocking_file, directory_ending

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from torch.utils.tensorboard import SummaryWriter

from rl_tformers.runtime.evaluation import TargetResult, repeated_target  # noqa: E402,F401 (re-exported)
from rl_tformers.runtime.tracking import event_files  # noqa: E402


def plot_return_conditioning(
    results: Sequence[TargetResult],
    *,
    dataset_max: float | None = None,
    dataset_mean: float | None = None,
    dataset_min: float | None = None,
    title: str = "",
    max_traces_per_target: int = 2,
):
    """Figure with (left) achieved vs target return and (right) RTG / cumulative-reward traces.

    Args:
        results: one :class:`TargetResult` per target (targets must not be ``None``); the traces
            panel needs ``rewards`` (``evaluate(..., record_rewards=True)``) and is left with a
            note when they are missing.
        dataset_max, dataset_mean, dataset_min: best, mean and worst episode return of the
            training data (raw units); with both ``dataset_min`` and ``dataset_max`` the targets
            inside the data's range are shaded.
        title: figure title.
        max_traces_per_target: episodes drawn per target in the traces panel.

    Returns:
        ``matplotlib.figure.Figure`` (close it with ``plt.close(fig)``), laid out by matplotlib's
        constrained layout with each legend below its axes.

    Raises:
        ValueError: no results, or a result without a target return.
    """
    if not results:
        raise ValueError("plot: no evaluation results to plot")
    if any(r.target_return is None for r in results):
        raise ValueError("plot: every result needs a target return (the agent must be return-conditioned)")
    res = sorted(results, key=lambda r: r.target_return)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 6.4), layout="constrained")
    _conditioning_panel(ax, res, dataset_max, dataset_mean, dataset_min)
    _traces_panel(ax2, res, max_traces_per_target)
    if title:
        fig.suptitle(title)
    return fig


def _below(ax, ncol: int = 2) -> None:
    """The axes' legend under its x label (constrained layout makes room for it)."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=ncol, frameon=False)


def _conditioning_panel(ax, res: Sequence[TargetResult], dataset_max: float | None, dataset_mean: float | None,
                        dataset_min: float | None) -> None:
    """Achieved vs target return: y = x, episodes, mean +- std, the dataset's range, best and mean."""
    targets = np.array([r.target_return for r in res], dtype=np.float64)
    means = np.array([r.return_mean for r in res])
    stds = np.array([r.return_std for r in res])
    lo = min(targets.min(), min(min(r.returns) for r in res), 0.0)
    hi = max(targets.max(), max(max(r.returns) for r in res))
    if dataset_max is not None:
        hi = max(hi, dataset_max)
    if dataset_min is not None:
        lo = min(lo, dataset_min)
    if dataset_min is not None and dataset_max is not None:
        ax.axvspan(dataset_min, dataset_max, color="0.85", alpha=0.6, linewidth=0,
                   label=f"targets within the dataset's returns ({_label(dataset_min)} .. {_label(dataset_max)})")
    ax.plot([lo, hi], [lo, hi], color="0.5", linestyle=":", label="y = x (oracle)")
    for r in res:
        ax.scatter(np.full(len(r.returns), r.target_return), r.returns, s=10, color="C0", alpha=0.35, linewidths=0)
    ax.plot(targets, means, color="C0", marker="o", label="achieved (mean)")
    ax.fill_between(targets, means - stds, means + stds, color="C0", alpha=0.2, label="+- std over episodes")
    if dataset_max is not None:
        ax.axhline(dataset_max, color="C3", linestyle="--", label=f"dataset best ({_label(dataset_max)})")
    if dataset_mean is not None:
        ax.axhline(dataset_mean, color="C2", linestyle="--", label=f"dataset mean ({_label(dataset_mean)})")
    ax.set_xlabel("target return")
    ax.set_ylabel("achieved return")
    ax.set_title("return conditioning")
    _below(ax)
    ax.grid(alpha=0.3)


#: Most targets named one by one in the traces panel's legend; more get a colour bar.
MAX_TARGETS_IN_LEGEND = 8


def _traces_panel(ax2, res: Sequence[TargetResult], max_traces_per_target: int) -> None:
    """Remaining RTG (dashed) and cumulative reward (solid) by step, one colour per target."""
    if any(r.rewards for r in res):
        cmap = plt.get_cmap("viridis")
        named = len(res) <= MAX_TARGETS_IN_LEGEND
        for k, r in enumerate(res):
            color = cmap(k / max(1, len(res) - 1))
            for ep in (r.rewards or [])[:max_traces_per_target]:
                cum = np.concatenate([[0.0], np.cumsum(ep)])  # (L+1,) reward collected before step t
                steps = np.arange(len(cum))
                ax2.plot(steps, r.target_return - cum, color=color, linestyle="--", linewidth=1)
                ax2.plot(steps, cum, color=color, linewidth=1)
            if named:
                ax2.plot([], [], color=color, label=f"target {_label(r.target_return)}")
        if not named:  # a colour bar of the targets' ranks, ticked with a few of the targets
            from matplotlib.cm import ScalarMappable
            from matplotlib.colors import Normalize

            bar = ax2.figure.colorbar(ScalarMappable(Normalize(0, len(res) - 1), cmap), ax=ax2, label="target return")
            ticks = np.unique(np.linspace(0, len(res) - 1, 5).round().astype(int))
            bar.set_ticks(ticks, labels=[_label(res[i].target_return) for i in ticks])
        ax2.plot([], [], color="k", linestyle="--", label="remaining RTG")
        ax2.plot([], [], color="k", label="cumulative reward")
        _below(ax2, ncol=3)
    else:
        ax2.text(0.5, 0.5, "no per-step rewards recorded", ha="center", va="center", transform=ax2.transAxes)
    ax2.set_xlabel("environment step")
    ax2.set_ylabel("return (raw units)")
    ax2.set_title("remaining return-to-go and cumulative reward by step")
    ax2.grid(alpha=0.3)


def _label(x: float) -> str:
    """A return for a legend: whole units from 10 to 1e7 (``3559``), 3 significant digits
    otherwise (``0.25``, ``2e-06``, ``1.5e+13``: not ``0`` or a 14-digit number)."""
    return f"{x:.0f}" if 10 <= abs(x) < 1e7 else f"{x:.3g}"


def supported_formats() -> list[str]:
    """File extensions matplotlib can write (``png``, ``pdf``, ``svg``, ...), sorted."""
    from matplotlib.figure import Figure

    return sorted(Figure().canvas.get_supported_filetypes())


def figure_path(out: str | os.PathLike) -> Path:
    """The file :func:`save_figure` writes for ``out``, checked before any work is done.

    The extension picks the format (any of :func:`supported_formats`, case-insensitive); a name
    without one gets ``.png`` appended (``plot`` -> ``plot.png``), and the returned path is that
    real file, so callers print what was written. ``~`` is expanded (as the parent check does).

    Raises:
        ValueError: ``out`` is empty or names a directory (it exists as one, or its text ends
            with a path separator or in ``.`` / ``..``, such as ``figs/`` or ``dir.png/``: a path
            object would drop the slash and write a file ``dir.png``), ``out.png`` is an existing
            directory, a parent is an existing file, the extension is not one matplotlib
            writes (the message lists them), or a name is longer than the file system takes.
    """
    text = os.fspath(out)
    if not text.strip():  # Path("") is "." (the current directory)
        raise ValueError(f"{text!r} is empty; give a file name, e.g. return_conditioning.png")
    tail = directory_ending(text)
    if tail is not None:
        raise ValueError(f"{text} names a directory (it ends with {tail!r}); give a file name, e.g. "
                         f"{Path(text.rstrip(SEPARATORS) or text).expanduser() / 'return_conditioning.png'}")
    out = Path(text).expanduser()
    try:
        if out.is_dir():
            raise ValueError(f"{out} is a directory; give a file name, e.g. {out / 'return_conditioning.png'}")
        fmt = out.suffix[1:]
        if not fmt:
            out = out.with_name(out.name + ".png")
            if out.is_dir():
                raise ValueError(f"{out} (.png added: the name has no extension) is a directory; give a file name")
        elif fmt.lower() not in supported_formats():
            raise ValueError(f"{out}: matplotlib cannot write {out.suffix!r} files; use one of the extensions "
                             f"{', '.join('.' + f for f in supported_formats())} (none: .png is added)")
        parent = blocking_file(out)
    except OSError as exc:  # a name longer than the file system takes, ...: not a traceback
        raise ValueError(f"{out}: cannot be written here ({exc.strerror or exc})") from None
    if parent is not None:
        raise ValueError(f"{out}: {parent} is a file, not a directory")
    return out


def save_figure(fig, out: str | os.PathLike, dpi: int = 110) -> Path:
    """Write ``fig`` to :func:`figure_path` ``(out)`` (format by extension, ``.png`` added when
    there is none), create parent dirs, close the figure; returns the path written.

    Raises:
        ValueError: see :func:`figure_path` (the figure is closed all the same).
    """
    try:
        out = figure_path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi)
    finally:
        plt.close(fig)
    return out


def log_figure(log_dir: str | Path, tag: str, fig, step: int = 0) -> str:
    """Add ``fig`` as an image to the TensorBoard event files in ``log_dir`` (does not close it).

    A figure never replaces another: when an image of ``tag`` is already logged at ``step``
    (a second ``rl-tformers plot`` of the same checkpoint), the first free tag of ``tag_2``,
    ``tag_3``, ... is used instead. Returns the tag used.
    """
    taken = _image_tags(log_dir, step)
    used, k = tag, 1
    while used in taken:
        k += 1
        used = f"{tag}_{k}"
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        writer.add_figure(used, fig, global_step=step, close=False)
    finally:
        writer.close()
    return used


def _image_tags(log_dir: str | Path, step: int) -> set[str]:
    """Tags of the images logged at ``step`` in the event files of ``log_dir``."""
    # tensorboard's reader: imported here, only a plot that logs needs it
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    tags: set[str] = set()
    for path in event_files(log_dir):
        for event in EventFileLoader(str(path)).Load():
            if event.step == step:
                # (the loader hands images over as tensors of the "images" plugin)
                tags.update(v.tag for v in event.summary.value
                            if v.HasField("image") or v.metadata.plugin_data.plugin_name == "images")
    return tags


def default_sweep(dataset_max: float, dataset_min: float, n: int = 6, *,
                  random_return: float | None = None) -> list[float]:
    """``n`` evenly spaced targets from the lowest known return to 20% of that span beyond the
    dataset's best (the paper's figure also asks for more than the data holds).

    The lowest known return is the dataset's worst episode return, or the random policy's return
    ``random_return`` (a D4RL reference score, see :mod:`rl_tformers.envs.scores`) when that is
    lower: on a one-policy dataset (Hopper returns 1074 .. 1121, random -20.3) the targets run
    from -20 to 1349, not 1074 to 1130, so the plot shows where the agent follows its target and
    where it saturates instead of one blob on the diagonal.

    When every episode has the same return R and no lower random return is known, the span is
    taken as ``|R|`` (1 when R = 0) below R: the sweep runs from ``R - |R|`` to ``R + 0.2 |R|``
    (e.g. 0 .. 6 for R = 5), not n copies of R. Rounded to integers when the span is at least 20
    and the rounded targets stay distinct (with many targets over a short span, e.g. 1000
    targets over 10 .. 598, rounding would ask for the same target several times: they are kept
    unrounded). Raises ValueError if n < 2.
    """
    if n < 2:
        raise ValueError(f"a sweep needs at least 2 targets, got {n}")
    low = dataset_min if random_return is None else min(dataset_min, random_return)
    span = dataset_max - low
    if not span > 0:
        span = max(abs(dataset_max), 1.0)
        low = dataset_max - span
    xs = [float(x) for x in np.linspace(low, dataset_max + 0.2 * span, n)]
    rounded = [float(round(x)) for x in xs]
    return rounded if span >= 20 and repeated_target(rounded) is None else xs


def summary_lines(results: Sequence[TargetResult]) -> list[str]:
    """One human-readable line per target: target, mean +- std, normalised score (a policy that
    takes no target, ``target_return`` None: no target column)."""
    out: list[str] = []
    for r in results:
        t = "" if r.target_return is None else f"target {r.target_return:>8g}: "
        line = f"{t}return {r.return_mean:9.2f} +- {r.return_std:8.2f} over {len(r.returns)} episode{'' if len(r.returns) == 1 else 's'}"
        if r.normalized_score is not None:
            line += f", normalised score {r.normalized_score:6.1f}"
        out.append(line)
    return out

