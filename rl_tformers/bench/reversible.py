"""Benchmark: activation memory of reversible vs ordinary residual stacks as depth grows.

For each depth N the same backbone (``block: reversible``) is run forward+backward with the
memory-saving backward (``recompute=true``), with ordinary autograd through the very same
computation (``recompute=false``) and, for reference, as a ``pre_norm`` stack. Reported per row:

- ``saved_MiB``: bytes of activations autograd keeps for the backward pass after the forward
  pass (tensors packed by ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded,
  each storage counted once). This is what grows with depth in an ordinary stack; the
  reversible stack keeps only its two output streams (Gomez et al. 2017; Kitaev et al. 2020).
- ``peak_MiB``: peak memory allocated during forward+backward above what was held before the
  call (gradient buffers pre-allocated), so it includes the one-layer recomputation of the
  reversible backward. CUDA: ``torch.cuda.max_memory_allocated``; CPU: the profiler's
  allocation events (:func:`cpu_peak_bytes`).
- ``time_ratio``: forward+backward time relative to ``pre_norm`` at the same depth (same
  process; the reversible backward recomputes every layer, about 1.3-2x expected).

Command: ``rl-tformers bench reversible [--depths 2,4,8,16] [--device cuda] [--json]`` (the bench
group picks up :func:`register`), ``python -m rl_tformers.bench.reversible`` or
``python scripts/bench_reversible.py`` with the same options.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import typer

from rl_tformers import Backbone
from rl_tformers.bench.memory import cpu_peak_bytes
from rl_tformers.bench.options import check_counts, check_device, fail, first_repeat

VARIANTS: dict[str, dict[str, Any]] = {
    "reversible": {"kind": "reversible", "recompute": True},
    "reversible_no_recompute": {"kind": "reversible", "recompute": False},
    "pre_norm": {"kind": "pre_norm"},
}


def saved_activation_bytes(fn: Callable[[], Any], exclude: Sequence[torch.Tensor] = ()) -> tuple[int, Any]:
    """Bytes autograd saves for backward while ``fn()`` runs (each storage once, ``exclude`` skipped).

    Returns (bytes, fn's result); keep the result alive to keep the graph alive.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and ptr != 0:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def measure(
    variant: str,
    depth: int,
    *,
    batch: int = 8,
    seq_len: int = 256,
    d_model: int = 128,
    n_heads: int = 4,
    device: str = "cpu",
    repeats: int = 3,
) -> dict[str, Any]:
    """One benchmark row for ``variant`` (a key of :data:`VARIANTS`) at ``depth`` layers."""
    dev = torch.device(device)
    torch.manual_seed(0)
    bb = Backbone(
        {
            "d_model": d_model, "n_layers": depth, "n_heads": n_heads, "dropout": 0.0, "attn_dropout": 0.0,
            "block": dict(VARIANTS[variant]), "position": {"kind": "rotary"},
        }
    ).to(dev).train()
    x = torch.randn(batch, seq_len, d_model, device=dev, requires_grad=True)
    params = list(bb.parameters())

    def step():
        return bb(x).hidden

    saved, out = saved_activation_bytes(step, exclude=params)
    out.square().mean().backward()
    del out
    bb.zero_grad(set_to_none=False)  # gradient buffers exist before the measured call
    if dev.type == "cpu":
        b = cpu_peak_bytes(lambda: bb(x).hidden.square().mean().backward())
        peak = None if b is None else b / 2**20
    else:
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        bb(x).hidden.square().mean().backward()
        torch.cuda.synchronize(dev)
        peak = (torch.cuda.max_memory_allocated(dev) - base) / 2**20
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        bb(x).hidden.square().mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return {
        "variant": variant,
        "depth": depth,
        "saved_MiB": saved / 2**20,
        "peak_MiB": peak,
        "seconds": min(times),
    }


def run(depths: Sequence[int] = (2, 4, 8, 16), **kw: Any) -> list[dict[str, Any]]:
    """Rows for every variant and depth, with ``time_ratio`` against pre_norm at the same depth."""
    rows = [measure(v, n, **kw) for n in depths for v in VARIANTS]
    base = {r["depth"]: r["seconds"] for r in rows if r["variant"] == "pre_norm"}
    for r in rows:
        r["time_ratio"] = r["seconds"] / base[r["depth"]]
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'variant':<26}{'depth':>6}{'saved_MiB':>12}{'peak_MiB':>11}{'time_ratio':>12}"]
    for r in rows:
        peak = "-" if r["peak_MiB"] is None else f"{r['peak_MiB']:.1f}"
        lines.append(f"{r['variant']:<26}{r['depth']:>6}{r['saved_MiB']:>12.2f}{peak:>11}{r['time_ratio']:>12.2f}")
    return "\n".join(lines)


def check_options(depths: str, batch: int, seq_len: int, d_model: int, n_heads: int, device: str) -> list[int]:
    """The depths of ``--depths``, after refusing options that cannot give a measurement.

    Raises:
        ValueError: naming the option: ``--depths`` empty, not integers, below 1 or repeated;
            ``--batch``, ``--seq-len``, ``--d-model`` or ``--n-heads`` below 1; ``--d-model``
            not divisible by ``--n-heads``; an unavailable ``--device``.
    """

    items = [d.strip() for d in str(depths).split(",") if d.strip()]
    try:
        ds = [int(d) for d in items]
    except ValueError:
        raise ValueError(f"--depths {depths!r}: expected comma-separated integers, e.g. 2,4,8") from None
    if not ds:
        raise ValueError("--depths: give at least one number of layers (e.g. 2,4,8)")
    if min(ds) < 1:
        raise ValueError(f"--depths: every depth must be >= 1, got {min(ds)}")
    if (twice := first_repeat(ds)) is not None:
        raise ValueError(f"--depths: {twice} is given twice")
    check_counts(("--batch", batch), ("--seq-len", seq_len), ("--d-model", d_model), ("--n-heads", n_heads))
    if d_model % n_heads:
        raise ValueError(f"--d-model {d_model} is not divisible by --n-heads {n_heads}")
    check_device(device)
    return ds


def command(
    depths: str = "2,4,8,16",
    batch: int = 8,
    seq_len: int = 256,
    d_model: int = 128,
    n_heads: int = 4,
    device: str = "cpu",
    as_json: bool = False,
) -> None:
    """Activation memory vs depth: reversible (recompute) vs the same stack with ordinary autograd vs pre_norm.

    Raises:
        ValueError: bad options (:func:`check_options`), before anything is measured.
    """
    ds = check_options(depths, batch, seq_len, d_model, n_heads, device)
    rows = run(ds, batch=batch, seq_len=seq_len, d_model=d_model, n_heads=n_heads, device=device)
    print(json.dumps(rows, indent=2) if as_json else format_rows(rows))


def register(bench_app) -> None:
    """Hook into a Typer group: ``bench_app.command("reversible")(command)`` with typed options."""

    def reversible(
        depths: str = typer.Option("2,4,8,16", help="Comma-separated numbers of layers."),
        batch: int = typer.Option(8),
        seq_len: int = typer.Option(256),
        d_model: int = typer.Option(128),
        n_heads: int = typer.Option(4),
        device: str = typer.Option("cpu", help="cpu or cuda (peak memory from the profiler on CPU, the allocator on CUDA)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON rows."),
    ) -> None:
        """Activation memory vs depth of reversible layers (Reformer) against ordinary residual stacks."""

        try:
            check_options(depths, batch, seq_len, d_model, n_heads, device)
        except ValueError as exc:
            fail(str(exc))
        command(depths, batch, seq_len, d_model, n_heads, device, as_json)

    bench_app.command("reversible")(reversible)


def main(argv: Sequence[str] | None = None) -> None:

    p = argparse.ArgumentParser(description=command.__doc__)
    p.add_argument("--depths", default="2,4,8,16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    command(a.depths, a.batch, a.seq_len, a.d_model, a.n_heads, a.device, a.json)


if __name__ == "__main__":
    main()
