"""Benchmark: forward+backward time and peak memory of attention kinds against dense SDPA.

For every requested kind and sequence length L, one attention layer (built through a one-layer
:class:`~rl_tformers.Backbone`, so construction checks apply) runs forward and backward on a
random (B, L, D) input. Reported per (kind, L):

- ``seconds``: median wall time of forward+backward over ``repeats`` runs after a warm-up;
- ``peak_mib``: peak memory added by one forward+backward (CUDA: ``max_memory_allocated``;
  CPU: the profiler's allocation events, :mod:`rl_tformers.bench.memory`);
- ``time_ratio`` / ``mem_ratio``: the same divided by dense ``sdpa`` measured in the same
  run, at the same length and in the same masking mode (kinds without a causal form run
  bidirectionally, against bidirectional ``sdpa``);
- ``status``: ``ok``, ``skipped: ...`` (dense-like kinds whose estimated peak, extrapolated
  quadratically from the previous length, would exceed the memory budget; kinds that already
  exceeded the time budget at a shorter length) or
  ``error: ...`` (the kind cannot run at that length, e.g. a fixed maximum length).

A crossover summary gives, per kind, the shortest measured length from which it is faster
(and lighter) than dense attention. ``--plot`` draws time and memory against L.

RL-scale cases (the Decision Transformer with a 500-step, 1,500-token context, dense vs the
efficient kernels, steps per second and normalised score: :mod:`rl_tformers.bench.attention_rl`)
are registered with :func:`register_rl_scale_case` and run with ``--rl-scale`` (options
``--rl-steps N``, ``--rl-option key=value``).

Command: ``rl-tformers bench attention --kinds sdpa,performer,lsh --lengths 256,1024,4096,16384
--json --out bench.json --plot bench.png --device cpu``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import typer

from rl_tformers import Backbone
from rl_tformers.bench.memory import peak_bytes
from rl_tformers.bench.options import check_counts, check_device, check_out, fail, first_repeat
from rl_tformers.registry import ATTENTION, all_entries
from rl_tformers.runtime.host import host_description
from rl_tformers.runtime.paths import blocking_file
from rl_tformers.types import AttnContext

DEFAULT_LENGTHS = (256, 1024, 4096, 16384)
BASELINE = "sdpa"

#: name -> function(**options) returning a list of result rows; filled by the owners of the cases.
RL_SCALE_CASES: dict[str, Callable[..., list[dict[str, Any]]]] = {}
#: case name -> its rows as a Markdown table (rows of that case only)
RL_SCALE_TABLES: dict[str, Callable[[list[dict[str, Any]]], str]] = {}


def register_rl_scale_case(name: str, fn: Callable[..., list[dict[str, Any]]],
                           table: Callable[[list[dict[str, Any]]], str] | None = None) -> None:
    """Register an RL-scale benchmark case run by ``rl-tformers bench attention --rl-scale``.

    ``fn(kinds: list[str], device: str) -> list[dict]`` returns rows such as
    ``{"case": name, "kind": ..., "steps_per_s": ..., "normalised_score": ...}``. Intended for the
    Decision Transformer long-context case (K = 500 steps, 1,500 tokens, dense vs efficient
    kernels). ``table(rows)`` renders the case's rows as Markdown for the command's output.
    Raises ValueError if ``name`` is taken.
    """
    if name in RL_SCALE_CASES:
        raise ValueError(f"RL-scale benchmark case {name!r} is already registered")
    RL_SCALE_CASES[name] = fn
    if table is not None:
        RL_SCALE_TABLES[name] = table


@dataclass
class Settings:
    """Benchmark settings (one attention layer, batch B, width D, H heads)."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    batch: int = 1
    d_model: int = 128
    n_heads: int = 4
    causal: bool = True
    device: str = "cpu"
    repeats: int = 3
    memory_budget_gb: float = 4.0
    time_budget_s: float = 120.0
    padded: bool = False
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot give a measurement, naming the CLI option.

        Raises:
            ValueError: no ``--lengths``, a length below 1 or given twice, ``--batch``,
                ``--d-model``, ``--n-heads`` or ``--repeats`` below 1, ``--d-model`` not
                divisible by ``--n-heads``, a budget that is not a positive number, or a
                ``--device`` that is not available (:func:`~rl_tformers.bench.options.check_device`).
        """

        if not self.lengths:
            raise ValueError("--lengths: give at least one sequence length (e.g. 256,1024)")
        small = [n for n in self.lengths if int(n) < 1]
        if small:
            raise ValueError(f"--lengths: every length must be >= 1, got {small[0]}")
        twice = first_repeat(self.lengths)
        if twice is not None:
            raise ValueError(f"--lengths: {twice} is given twice")
        check_counts(("--batch", self.batch), ("--d-model", self.d_model), ("--n-heads", self.n_heads),
                     ("--repeats", self.repeats))
        if self.d_model % self.n_heads:
            raise ValueError(f"--d-model {self.d_model} is not divisible by --n-heads {self.n_heads}")
        for option, value in (("--memory-budget-gb", self.memory_budget_gb), ("--time-budget-s", self.time_budget_s)):
            if not value > 0 or value == float("inf"):  # NaN fails too
                raise ValueError(f"{option} must be a positive number, got {value}")
        check_device(self.device)


@dataclass
class Result:
    """Rows of one benchmark run plus its summary."""

    settings: Settings
    rows: list[dict[str, Any]] = field(default_factory=list)
    crossover: dict[str, dict[str, Any]] = field(default_factory=dict)
    rl_scale: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: :func:`~rl_tformers.runtime.host.host_description` of the host, at the start
    machine: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "settings": dataclasses.asdict(self.settings),
            "machine": self.machine,
            "rows": self.rows,
            "crossover": self.crossover,
            "rl_scale": self.rl_scale,
            "notes": self.notes,
        }


def all_kinds() -> list[str]:
    """Every registered attention kind (the baseline first)."""

    all_entries()  # import every component module
    kinds = ATTENTION.kinds()
    return [BASELINE] + [k for k in kinds if k != BASELINE]


def kind_fields(kind: str, length: int) -> dict[str, Any]:
    """Config fields for ``kind`` at length L: the class's ``bench_config(L)`` if it has one,
    else its defaults; a ``max_len`` field is raised to L (fixed-length kernels)."""

    cls = ATTENTION.get(kind).config_cls
    hook = getattr(cls, "bench_config", None)
    fields = dict(hook(length)) if hook is not None else {}
    names = {f.name for f in dataclasses.fields(cls)}
    if "max_len" in names:
        default = next(f.default for f in dataclasses.fields(cls) if f.name == "max_len")
        fields["max_len"] = max(int(fields.get("max_len", default)), length)
    return fields


def mode_for(kind: str, causal: bool) -> bool | None:
    """The masking mode ``kind`` runs in (the requested one if it supports it), or None."""

    caps = ATTENTION.get(kind).capabilities
    if causal and caps.causal or not causal and caps.bidirectional:
        return causal
    if caps.causal or caps.bidirectional:
        return caps.causal
    return None


def dense_bytes_estimate(kind: str, length: int, s: Settings, prev: tuple[int, float] | None = None) -> int:
    """Estimated peak bytes of a kind that is not sub-quadratic at length L (0 for sub-quadratic
    kinds): the guard that skips dense-like kinds before they exhaust memory.

    With a measurement at a shorter length ``prev = (L0, peak bytes)`` the peak is extrapolated
    quadratically, peak * (L / L0)^2 (an upper bound: PyTorch's fused SDPA kernels grow only
    linearly without a mask, and with a mask by the (B, 1, L, L) bool mask). Without one:
    ``sdpa`` unmasked 0 (fused kernels, O(L)), ``sdpa`` masked the bool mask B L^2, others the
    (B, H, L, L) float32 scores and probabilities.
    """

    if ATTENTION.get(kind).config_cls(**kind_fields(kind, length)).config_capabilities().subquadratic:
        return 0  # what its benchmark configuration declares (blockwise: only with a fixed block length)
    if prev is not None and prev[1]:
        return int(prev[1] * (length / prev[0]) ** 2)
    if kind == BASELINE:
        return s.batch * length * length if s.padded else 0
    return 2 * s.batch * s.n_heads * length * length * 4


def _build(kind: str, length: int, causal: bool, s: Settings):

    torch.manual_seed(s.seed)
    bb = Backbone(
        {
            "d_model": s.d_model, "n_layers": 1, "n_heads": s.n_heads, "dropout": 0.0, "attn_dropout": 0.0,
            "causal": causal, "max_position": max(length, 8), "position": {"kind": "none"},
            "attention": {"kind": kind, **kind_fields(kind, length)},
        }
    )
    return bb.blocks[0].attn.to(s.device).train()


def measure(kind: str, length: int, causal: bool, s: Settings) -> dict[str, Any]:
    """One row: forward+backward seconds (median) and peak MiB of ``kind`` at length L."""

    dev = torch.device(s.device)
    attn = _build(kind, length, causal, s)
    g = torch.Generator().manual_seed(s.seed)
    x = torch.randn(s.batch, length, s.d_model, generator=g).to(dev).requires_grad_(True)
    pos = torch.arange(length, device=dev).expand(s.batch, length)
    valid = None
    if s.padded:  # left padding of the first 1/8 of every row (an end-aligned DT window at episode start)
        valid = torch.ones(s.batch, length, dtype=torch.bool, device=dev)
        valid[:, : length // 8] = False

    def step() -> None:
        ctx = AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=causal)
        attn(x, x, ctx).out.square().mean().backward()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    step()  # warm-up; also allocates the gradient buffers outside the measurement
    sync()
    times = []
    for _ in range(max(1, s.repeats)):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = peak_bytes(step, dev)
    return {
        "kind": kind,
        "length": length,
        "mode": "causal" if causal else "bidirectional",
        "status": "ok",
        "seconds": statistics.median(times),
        "peak_mib": None if peak is None else peak / 2**20,
    }


def run(kinds: Sequence[str] | None = None, settings: Settings | None = None, log: Callable[[str], None] | None = None) -> Result:
    """Measure ``kinds`` (default: every registered kind) at ``settings.lengths``.

    The baseline ``sdpa`` is always measured (in each mode that some kind needs). Never raises
    for a kind that cannot run: the row says why.
    """
    s = settings or Settings()
    kinds = list(kinds) if kinds else all_kinds()
    if BASELINE not in kinds:
        kinds = [BASELINE, *kinds]
    res = Result(settings=s, machine=host_description(s.device))
    budget = s.memory_budget_gb * 2**30
    modes = {k: mode_for(k, s.causal) for k in kinds}
    needed_modes = {m for m in modes.values() if m is not None}
    jobs: list[tuple[str, bool]] = [(BASELINE, m) for m in sorted(needed_modes, reverse=True)]
    jobs += [(k, modes[k]) for k in kinds if k != BASELINE and modes[k] is not None]
    for k in kinds:
        if modes[k] is None:
            res.notes.append(f"{k}: no usable masking mode")
    for kind, causal in jobs:
        slow_at, prev = None, None
        for length in s.lengths:
            base = {"kind": kind, "length": length, "mode": "causal" if causal else "bidirectional",
                    "seconds": None, "peak_mib": None}
            est = dense_bytes_estimate(kind, length, s, prev)
            if est > budget:
                row = {**base, "status": f"skipped: estimated peak ~{est / 2**30:.1f} GiB > budget {s.memory_budget_gb} GiB"}
            elif slow_at is not None:
                row = {**base, "status": f"skipped: over the time budget ({s.time_budget_s:.0f} s) at L={slow_at}"}
            else:
                try:
                    row = measure(kind, length, causal, s)
                except Exception as exc:  # a kind that cannot run here is reported, not fatal
                    row = {**base, "status": f"error: {type(exc).__name__}: {exc}"}
                if row.get("seconds") is not None and row["seconds"] > s.time_budget_s:
                    slow_at = length
                if row.get("peak_mib"):
                    prev = (length, row["peak_mib"] * 2**20)
            res.rows.append(row)
            if log is not None:
                log(_row_line(row))
    _add_ratios(res.rows)
    res.crossover = crossover(res.rows)
    return res


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    base = {(r["length"], r["mode"]): r for r in rows if r["kind"] == BASELINE and r["status"] == "ok"}
    for r in rows:
        b = base.get((r["length"], r["mode"]))
        ok = r["status"] == "ok" and b is not None
        r["time_ratio"] = r["seconds"] / b["seconds"] if ok else None
        r["mem_ratio"] = (
            r["peak_mib"] / b["peak_mib"] if ok and r["peak_mib"] is not None and b["peak_mib"] else None
        )


def crossover(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind: the shortest measured L from which it stays faster / lighter than dense.

    ``faster_from`` / ``lighter_from``: that L, or None if never within the measured lengths
    that have a dense baseline; ``only_it_runs_at``: lengths where the kind ran and dense
    was skipped.
    """
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        if kind == BASELINE:
            continue
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["length"])
        summary: dict[str, Any] = {}
        for key, name in (("time_ratio", "faster_from"), ("mem_ratio", "lighter_from")):
            rated = [r for r in mine if r[key] is not None]
            first = None
            for i, r in enumerate(rated):
                if all(x[key] < 1.0 for x in rated[i:]):
                    first = r["length"]
                    break
            summary[name] = first
        base_ok = {r["length"] for r in rows if r["kind"] == BASELINE and r["status"] == "ok"}
        summary["only_it_runs_at"] = [r["length"] for r in mine if r["status"] == "ok" and r["length"] not in base_ok]
        out[kind] = summary
    return out


def run_rl_scale(kinds: Sequence[str], device: str, **options: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of every registered RL-scale case, and notes (one per case that failed or none).

    ``options`` (e.g. ``steps=200``) go to each case function that takes them (by name, or all
    of them to a case with ``**options``). The built-in case, the Decision Transformer with a
    500-step context, registers itself when :mod:`rl_tformers.bench.attention_rl` is imported
    (the ``bench`` command group imports every bench module).
    """

    if not RL_SCALE_CASES:
        return [], [
            "no RL-scale case registered: the Decision Transformer long-context case (K = 500 steps, "
            "1,500 tokens) registers itself with rl_tformers.bench.attention.register_rl_scale_case"
        ]
    rows, notes = [], []
    for name, fn in RL_SCALE_CASES.items():
        params = inspect.signature(fn).parameters
        takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        opts = {k: v for k, v in options.items() if takes_all or k in params}
        try:
            rows += fn(kinds=list(kinds), device=device, **opts)
        except Exception as exc:
            notes.append(f"RL-scale case {name}: {type(exc).__name__}: {exc}")
    return rows, notes


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row_line(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['kind']:<20} L={r['length']:<6} {r['mode']:<13} {r['status']}"
    return (
        f"{r['kind']:<20} L={r['length']:<6} {r['mode']:<13} {_fmt(r['seconds'], '.4f')} s  "
        f"{_fmt(r['peak_mib'], '.1f')} MiB"
    )


def markdown_table(res: Result) -> str:
    """The results as a Markdown table: one row per kind, time/memory ratios per length."""
    lengths = list(res.settings.lengths)
    head = "| kind | mode | " + " | ".join(f"L={n} time / mem" for n in lengths) + " | faster from | lighter from |"
    sep = "|" + "---|" * (len(lengths) + 4)
    lines = [head, sep]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for r in res.rows:
        by_kind.setdefault(f"{r['kind']}\t{r['mode']}", []).append(r)
    for key, rs in by_kind.items():
        kind, mode = key.split("\t")
        cells = []
        for n in lengths:
            r = next((x for x in rs if x["length"] == n), None)
            if r is None:
                cells.append("")
            elif r["status"] != "ok":
                cells.append("skipped" if r["status"].startswith("skipped") else "error")
            elif kind == BASELINE:
                cells.append(f"{r['seconds']:.3g} s / {_fmt(r['peak_mib'], '.0f')} MiB")
            else:
                cells.append(f"{_fmt(r['time_ratio'], '.2f')} / {_fmt(r['mem_ratio'], '.2f')}")
        c = res.crossover.get(kind, {})
        fx = "" if kind == BASELINE else str(c.get("faster_from") or "-")
        lx = "" if kind == BASELINE else str(c.get("lighter_from") or "-")
        lines.append(f"| {kind} | {mode} | " + " | ".join(cells) + f" | {fx} | {lx} |")
    return "\n".join(lines)


def plot(res: Result, path: str) -> None:
    """Time and peak memory against L (log-log), one line per kind; written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    keys = dict.fromkeys((r["kind"], r["mode"]) for r in res.rows)
    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>ph*"
    for i, (kind, mode) in enumerate(keys):
        rs = sorted((r for r in res.rows if r["kind"] == kind and r["mode"] == mode and r["status"] == "ok"),
                    key=lambda r: r["length"])
        if not rs:
            continue
        label = kind if mode == ("causal" if res.settings.causal else "bidirectional") else f"{kind} ({mode})"
        style = (
            {"linewidth": 2.5, "color": "black", "marker": "o"}
            if kind == BASELINE
            else {"linewidth": 1.2, "color": colors[i % len(colors)], "marker": markers[i % len(markers)]}
        )
        axes[0].plot([r["length"] for r in rs], [r["seconds"] for r in rs], label=label, **style)
        mem = [(r["length"], r["peak_mib"]) for r in rs if r["peak_mib"] is not None]
        if mem:
            axes[1].plot(*zip(*mem), label=label, **style)
    for ax, title, unit in ((axes[0], "forward+backward time", "seconds"), (axes[1], "peak memory", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    s = res.settings
    pad = ", padded" if s.padded else ""
    fig.suptitle(f"attention kinds vs dense SDPA ({s.device}, B={s.batch}, D={s.d_model}, H={s.n_heads}{pad})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



def _parse_value(text: str) -> Any:
    """A command-line value: int, then float, else the string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_list(text: str | None, cast=str) -> list:
    return [cast(t.strip()) for t in (text or "").split(",") if t.strip()]


def _check_kinds(kinds: str) -> list[str] | None:
    """``--kinds``: the kinds named (None for 'all'); exits with an error line on an unknown,
    repeated or empty list."""
    if kinds.strip() == "all":
        return None
    ks = parse_list(kinds)
    all_kinds()
    unknown = [k for k in ks if k not in ATTENTION]
    if unknown:
        raise typer.BadParameter(f"unknown attention kinds {unknown}; registered: {', '.join(ATTENTION.kinds())}")
    if not ks:
        fail("--kinds is empty; give comma-separated attention kinds, or 'all'")
    if (twice := first_repeat(ks)) is not None:
        fail(f"--kinds: {twice!r} is given twice")
    return ks


def _check_lengths(lengths: str) -> tuple[int, ...]:
    """``--lengths``: positive integers; exits with an error line otherwise."""
    try:
        ls = tuple(parse_list(lengths, int))
    except ValueError:
        fail(f"--lengths {lengths!r}: expected comma-separated integers, e.g. 256,1024")
    if not ls or min(ls) < 1:
        raise typer.BadParameter("lengths must be positive integers", param_hint="--lengths")
    return ls


def _rl_options(rl_scale: bool, rl_steps: int | None, rl_option: list[str]) -> dict[str, Any]:
    """The RL-scale cases' options (``--rl-option key=value``), checked by the cases that can.

    Raises:
        ValueError: naming the option at fault.
    """
    if not rl_scale and (rl_steps is not None or rl_option):
        raise ValueError(f"{'--rl-steps' if rl_steps is not None else '--rl-option'} is used by the RL-scale "
                         "cases only; add --rl-scale")
    if rl_steps is not None and rl_steps < 1:
        raise ValueError(f"--rl-steps must be >= 1, got {rl_steps}")
    opts: dict[str, Any] = {}
    for item in rl_option:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rl-option: expected key=value, got {item!r}")
        opts[key.strip()] = _parse_value(value.strip())
    if rl_scale:  # cases that can check their options do so now, not after the whole benchmark
        for case in RL_SCALE_CASES.values():
            hook = getattr(case, "check_options", None)
            if hook is not None:
                hook({**opts, **({} if rl_steps is None else {"steps": rl_steps})})
    return opts


def _check_plot_path(plot_path: str | None) -> None:
    """``--plot``: a file name whose folders are not files.

    Raises:
        ValueError: naming ``--plot``.
    """
    if plot_path and Path(plot_path).is_dir():
        raise ValueError(f"--plot {plot_path} is a directory; give a file name, e.g. "
                         f"{Path(plot_path) / 'attention.png'}")
    above = blocking_file(plot_path) if plot_path else None
    if above is not None:
        raise ValueError(f"--plot {plot_path}: {above} is a file, not a directory")


def _report(res: Any, as_json: bool, out: str | None, plot_path: str | None) -> None:
    """Write ``--out`` and ``--plot``, then print the JSON or the tables and notes."""
    data = res.as_dict()
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as fh:
            json.dump(data, fh, indent=2)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(res, plot_path)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(markdown_table(res))
    for case, rl_table in RL_SCALE_TABLES.items():
        rows = [r for r in res.rl_scale or [] if r.get("case") == case]
        if rows:
            typer.echo("\n" + rl_table(rows))
    for note in res.notes:
        typer.echo(f"note: {note}")


def attention_cmd(
    kinds: str = typer.Option("all", help="Comma-separated attention kinds, or 'all' (every registered kind)."),
    lengths: str = typer.Option(",".join(map(str, DEFAULT_LENGTHS)), help="Comma-separated sequence lengths."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON instead of a table."),
    out: str = typer.Option(None, "--out", help="Also write the JSON results to this file."),
    plot_path: str = typer.Option(None, "--plot", help="Write a time/memory vs length plot (PNG)."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    batch: int = typer.Option(1, help="Batch size B."),
    d_model: int = typer.Option(128, help="Model width D."),
    n_heads: int = typer.Option(4, help="Heads H."),
    bidirectional: bool = typer.Option(False, "--bidirectional", help="Measure without a causal mask."),
    repeats: int = typer.Option(3, help="Timed runs per point (median)."),
    memory_budget_gb: float = typer.Option(4.0, help="Skip dense-like kinds whose L x L scores exceed this."),
    time_budget_s: float = typer.Option(120.0, help="Stop a kind's longer lengths once one run exceeds this."),
    padded: bool = typer.Option(False, "--padded", help="Left-pad 1/8 of every row (a key-padding mask)."),
    threads: int = typer.Option(1, help="torch.set_num_threads on CPU (1: stable timings on a shared machine)."),
    rl_scale: bool = typer.Option(False, "--rl-scale", help="Also run the registered RL-scale cases."),
    rl_steps: int = typer.Option(None, "--rl-steps", help="Training updates per kind of the RL-scale cases."),
    rl_option: list[str] = typer.Option(
        [], "--rl-option", help="key=value option of the RL-scale cases (repeatable), e.g. batch_size=8."),
) -> None:
    """Forward+backward time and peak memory of attention kinds as ratios to dense SDPA."""
    ks = _check_kinds(kinds)
    settings = Settings(
        lengths=_check_lengths(lengths), batch=batch, d_model=d_model, n_heads=n_heads, causal=not bidirectional,
        device=device, repeats=repeats, memory_budget_gb=memory_budget_gb, time_budget_s=time_budget_s, padded=padded,
    )
    try:
        settings.check()
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        opts = _rl_options(rl_scale, rl_steps, rl_option)
        _check_plot_path(plot_path)
    except ValueError as exc:
        fail(str(exc))
    check_out(out)
    if device == "cpu":
        torch.set_num_threads(threads)
    res = run(ks, settings, log=None if as_json else (lambda line: typer.echo(line, err=True)))
    if rl_scale:
        if rl_steps is not None:
            opts["steps"] = rl_steps
        rows, notes = run_rl_scale(ks or all_kinds(), device, **opts)
        res.rl_scale, res.notes = rows, res.notes + notes
    _report(res, as_json, out, plot_path)


def register(bench_app) -> None:
    """Add the ``attention`` command (:func:`attention_cmd`) to the ``bench`` Typer group."""
    bench_app.command("attention")(attention_cmd)

