"""Benchmark: training time per update against the DT's context length K (``rl-tformers bench context``).

For each attention kind (dense ``sdpa``, ``local``, ``performer`` by default) and each context
length K (20, 50, 100, 200, 500 steps: 3K tokens of return, state and action), one
Decision Transformer (``dt/hopper_medium`` with the kind and K set, a small model by default) is
built through the trainer on a synthetic Hopper-shaped dataset and timed on whole updates
(:meth:`~rl_tformers.runtime.trainer.Trainer.update`: forward, loss, backward, clipping, AdamW):
``warmup`` updates, then ``steps`` timed rounds of one update per (kind, K) in turn (device
synchronised around each), of which the fastest is the figure (the least disturbed by other
processes on a shared host; the median is recorded too).
The kinds' own defaults apply (``local``: query blocks of 32 with a 32-key flange; ``performer``:
its default random features) and no attention-probability dropout for any kind (Performer forms
no probabilities; the residual and feed-forward dropout of the config stay), so dense attention's cost grows as (3K)^2 and the other two's as
3K once K is large enough for attention to dominate the update.

The growth is a least-squares fit of log(seconds per update) on log(K): the slope over every K
and over the largest three (where the per-token work of the embeddings, the MLPs and the optimiser
no longer hides the attention's). Slope 1 is linear growth, 2 quadratic.

Command: ``rl-tformers bench context --out bench_context.json --plot bench_context.png``.
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer

from rl_tformers.bench.data import write_synthetic_d4rl
from rl_tformers.bench.options import check_counts, check_device, check_out, first_repeat, run_checked
from rl_tformers.registry import ATTENTION
from rl_tformers.runtime.device import move_to
from rl_tformers.runtime.host import host_description
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import Trainer, _with_run_dir

KINDS = ("sdpa", "local", "performer")
LENGTHS = (20, 50, 100, 200, 500)


@dataclass
class Settings:
    """Benchmark settings (the CLI options of ``bench context``)."""

    kinds: tuple[str, ...] = KINDS
    lengths: tuple[int, ...] = LENGTHS
    batch_size: int = 8
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    steps: int = 5
    warmup: int = 2
    threads: int = 1
    device: str = "cpu"
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot give a measurement, naming the CLI option.

        Raises:
            ValueError: a count below 1 (``--batch-size``, ``--d-model``, ``--layers``,
                ``--heads``, ``--steps``, ``--threads``), ``--warmup`` below 0, a length below 1
                or above 1000 (the DT's ``max_ep_len``) or given twice, a kind not registered or given twice, no
                kind or length, ``--d-model`` not divisible by ``--heads``, a bad ``--device``.
        """
        check_counts(("--batch-size", self.batch_size), ("--d-model", self.d_model), ("--layers", self.n_layers),
                     ("--heads", self.n_heads), ("--steps", self.steps), ("--threads", self.threads))
        check_counts(("--warmup", self.warmup), lo=0)
        if not self.kinds or not self.lengths:
            raise ValueError("--kinds and --lengths need at least one value each")
        for option, values in (("--kinds", self.kinds), ("--lengths", self.lengths)):
            again = first_repeat(values)
            if again is not None:
                raise ValueError(f"{option}: {again} is given twice")
        unknown = [k for k in self.kinds if k not in ATTENTION]
        if unknown:
            raise ValueError(f"--kinds: unknown attention kind {unknown[0]!r}; registered: {', '.join(ATTENTION.kinds())}")
        bad = [k for k in self.lengths if not 1 <= k <= 1000]
        if bad:
            raise ValueError(f"--lengths {bad[0]}: a context length must be in [1, 1000] (the DT's max_ep_len)")
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --heads {self.n_heads}")
        check_device(self.device)


@dataclass
class Result:
    settings: Settings
    rows: list[dict[str, Any]] = field(default_factory=list)
    fits: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    plot: str | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"settings": dataclasses.asdict(self.settings), "machine": self.machine, "rows": self.rows,
                "fits": self.fits, "plot": self.plot, "notes": self.notes}


def loglog_slope(lengths: list[int], seconds: list[float]) -> float:
    """Least-squares slope of log(seconds) on log(length) (the exponent p of seconds ~ K^p).

    Raises:
        ValueError: fewer than two points, or a length or time that is not positive.
    """
    if len(lengths) < 2 or len(lengths) != len(seconds) or min(lengths) <= 0 or min(seconds) <= 0:
        raise ValueError(f"loglog_slope needs two or more positive (length, seconds) pairs, got "
                         f"{list(zip(lengths, seconds))}")
    return float(np.polyfit(np.log(lengths), np.log(seconds), 1)[0])


def growth(slope: float) -> str:
    """Words for a log-log slope: linear (< 1.5), quadratic (>= 1.5)."""
    return "linear" if slope < 1.5 else "quadratic"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Cell:
    """One (kind, K) DT trainer with two batches on its device, ready to time (see the module docstring)."""

    def __init__(self, data: Path, kind: str, k: int, s: Settings) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="rlt-bench-context-"))
        cfg = compose("dt/hopper_medium", [
            f"dataset.path={data}", f"device={s.device}", f"seed={s.seed}", "train.steps=1000000",
            f"train.batch_size={s.batch_size}", f"agent.context_len={k}", f"backbone.d_model={s.d_model}",
            f"backbone.n_layers={s.n_layers}", f"backbone.n_heads={s.n_heads}", f"backbone.attention={{kind: {kind}}}",
            "backbone.attn_dropout=0", "eval.every=0", "eval.at_end=false", "train.progress=false"])
        self.trainer = Trainer(_with_run_dir(cfg, self.run_dir), self.run_dir)
        src = self.trainer.agent.batches(0)
        self.batches = [move_to(src[i], self.trainer.device) for i in range(2)]
        self.trainer.model.train()
        self.done = 0

    def update(self) -> float:
        """Seconds of one whole update (device synchronised before and after)."""
        dev = self.trainer.device
        _sync(dev)
        t0 = time.perf_counter()
        self.trainer.update(self.batches[self.done % 2])
        _sync(dev)
        self.done += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        shutil.rmtree(self.run_dir, ignore_errors=True)


def measure(data: Path, s: Settings, log: Callable[[str], None]) -> dict[tuple[str, int], list[float]]:
    """Seconds of the timed updates of every (kind, K): ``warmup`` updates each, then ``steps``
    rounds of one update per (kind, K) in turn, so a burst of load on a shared host falls on
    every cell alike."""
    cells = {(kind, k): Cell(data, kind, k, s) for kind in s.kinds for k in s.lengths}
    try:
        for cell in cells.values():
            for _ in range(s.warmup):
                cell.update()
        times: dict[tuple[str, int], list[float]] = {key: [] for key in cells}
        for r in range(s.steps):
            for key, cell in cells.items():
                times[key].append(cell.update())
            log(f"round {r + 1}/{s.steps} done")
        return times
    finally:
        for cell in cells.values():
            cell.close()


def run(s: Settings, log: Callable[[str], None] | None = None, plot: str | None = None) -> Result:
    """Time every (kind, K) pair and fit the growth of each kind (see the module docstring).

    Raises:
        ValueError: bad settings (:meth:`Settings.check`), before anything is measured.
    """
    s.check()
    log = log or (lambda m: None)
    torch.set_num_threads(s.threads)
    res = Result(settings=s, machine=host_description(torch.device(s.device)))
    folder = Path(tempfile.mkdtemp(prefix="rlt-bench-context-data-"))
    try:
        # 1000-step episodes (a few shorter) hold every K; the name gives Hopper-v5's bounds
        data = write_synthetic_d4rl(folder / "hopper-synthetic.hdf5", 20_000, seed=s.seed)
        for (kind, k), times in measure(data, s, log).items():
            sec = min(times)
            res.rows.append({"kind": kind, "context_len": k, "tokens": 3 * k, "seconds_per_update": sec,
                             "median_seconds": statistics.median(times), "seconds": times})
            log(f"{kind} K={k} ({3 * k} tokens): {sec * 1e3:.1f} ms per update (median "
                f"{statistics.median(times) * 1e3:.1f})")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    res.machine["loadavg_end"] = host_description()["loadavg_1_5_15"] if "loadavg_1_5_15" in res.machine else None
    for kind in s.kinds:
        rows = [r for r in res.rows if r["kind"] == kind]
        ks, sec = [r["context_len"] for r in rows], [r["seconds_per_update"] for r in rows]
        if len(ks) < 2:
            continue
        fit = {"kind": kind, "slope_all": loglog_slope(ks, sec)}
        if len(ks) >= 3:
            fit["slope_top3"] = loglog_slope(ks[-3:], sec[-3:])
            fit["top3_lengths"] = ks[-3:]
        fit["growth"] = growth(fit.get("slope_top3", fit["slope_all"]))
        fit["ratio_to_dense_at_max_k"] = None
        res.fits.append(fit)
    dense = {r["context_len"]: r["seconds_per_update"] for r in res.rows if r["kind"] == "sdpa"}
    kmax = max(s.lengths)
    for fit in res.fits:
        mine = next(r["seconds_per_update"] for r in res.rows if r["kind"] == fit["kind"] and r["context_len"] == kmax)
        fit["ratio_to_dense_at_max_k"] = mine / dense[kmax] if kmax in dense else None
    if plot:
        res.plot = write_plot(res, Path(plot))
    return res


def write_plot(res: Result, path: Path) -> str:
    """Seconds per update against K on log-log axes, one line per kind, with the fitted slopes."""
    import matplotlib  # optional heavy dependency: only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for fit in res.fits:
        rows = [r for r in res.rows if r["kind"] == fit["kind"]]
        slope = fit.get("slope_top3", fit["slope_all"])
        ax.plot([r["context_len"] for r in rows], [r["seconds_per_update"] * 1e3 for r in rows], marker="o",
                label=f"{fit['kind']} (slope {slope:.2f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length K (steps; 3K tokens)")
    ax.set_ylabel("ms per update")
    s = res.settings
    ax.set_title(f"DT update vs K: d={s.d_model}, {s.n_layers} layers, batch {s.batch_size}, {s.device}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def markdown(res: Result) -> str:
    kinds = list(dict.fromkeys(r["kind"] for r in res.rows))
    lengths = list(dict.fromkeys(r["context_len"] for r in res.rows))
    cell = {(r["kind"], r["context_len"]): r["seconds_per_update"] for r in res.rows}
    lines = ["| K (tokens) | " + " | ".join(f"{k} ms/update" for k in kinds) + " |",
             "|---|" + "---|" * len(kinds)]
    lines += [f"| {k} ({3 * k}) | " + " | ".join(f"{cell[(kind, k)] * 1e3:.1f}" for kind in kinds) + " |"
              for k in lengths]
    if res.fits:
        lines += ["", "| kind | log-log slope, all K | slope, largest 3 K | growth | time / dense at the largest K |",
                  "|---|---|---|---|---|"]
        for f in res.fits:
            top = f.get("slope_top3")
            ratio = f["ratio_to_dense_at_max_k"]
            lines.append(f"| {f['kind']} | {f['slope_all']:.2f} | {'-' if top is None else f'{top:.2f}'} | "
                         f"{f['growth']} | {'-' if ratio is None else f'{ratio:.2f}x'} |")
    if res.plot:
        lines += ["", f"plot: {res.plot}"]
    return "\n".join(lines)


def _csv(text: str, cast: Callable[[str], Any], option: str) -> tuple[Any, ...]:
    try:
        return tuple(cast(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{option} {text!r}: give a comma-separated list") from None


def register(bench_app) -> None:
    """Add the ``context`` command to the ``bench`` Typer group."""

    def context(
        kinds: str = typer.Option(",".join(KINDS), help="Attention kinds, comma-separated (sdpa = dense)."),
        lengths: str = typer.Option(",".join(map(str, LENGTHS)), help="Context lengths K in steps, comma-separated."),
        batch_size: int = typer.Option(8, help="Batch size B."),
        d_model: int = typer.Option(64, help="Model width."),
        layers: int = typer.Option(2, help="Transformer layers."),
        heads: int = typer.Option(4, help="Attention heads."),
        steps: int = typer.Option(5, help="Timed rounds of one update per (kind, K) (the fastest is shown)."),
        warmup: int = typer.Option(2, help="Untimed updates of each (kind, K) first."),
        threads: int = typer.Option(1, help="torch intra-op threads."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        plot: str = typer.Option(None, "--plot", help="Write a log-log plot (PNG) here."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
        out: str = typer.Option(None, "--out", help="Also write the JSON results to this file."),
    ) -> None:
        """DT time per update against the context length K: dense vs local vs performer, with log-log slopes."""
        check_out(plot, "--plot", "bench_context.png")
        run_checked(lambda: Settings(kinds=_csv(kinds, str, "--kinds"), lengths=_csv(lengths, int, "--lengths"),
                                     batch_size=batch_size, d_model=d_model, n_layers=layers, n_heads=heads,
                                     steps=steps, warmup=warmup, threads=threads, device=device),
                    lambda s, log: run(s, log, plot), markdown, out=out, as_json=as_json)

    bench_app.command("context")(context)


