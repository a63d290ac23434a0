"""``rl-tformers bench gemm``: PyTorch's float32 GEMM libraries on this CPU, on the DT's shapes.

What ``cpu_matmul`` (:mod:`rl_tformers.runtime.cpu_matmul`) chooses between: for each
``x (M x K) · W^T (N x K)`` product of an ``nn.Linear`` the three products of one training
step, forward ``x W^T + b``, input gradient ``g W`` and weight gradient ``g^T x``, with MKL
(PyTorch's default: ``F.linear``, ``g @ W``, ``g.t() @ x``) and with oneDNN (what
:class:`~rl_tformers.runtime.cpu_matmul.OneDNNLinear` calls, including the contiguous copies of
``W^T``, ``g^T`` and ``x^T`` it needs: :func:`~rl_tformers.runtime.cpu_matmul.weight_grad`), timed round-robin in one process
(:func:`~rl_tformers.runtime.timing.interleaved_timing`) so load changes hit both alike;
the same products ``cpu_matmul: auto`` measures (:func:`~rl_tformers.runtime.cpu_matmul.product_fns`),
each library's GFLOP/s over all of them and the library ``auto`` picks from those rates by its
rule (:func:`~rl_tformers.runtime.cpu_matmul.choose_library`: oneDNN only when more than 5%
faster); plus the n x n x n matmul rate of each library (the peak ``bench train`` divides by).
Default shapes: the DT paper's model at batch 64 and K = 20 (M = 64 x 60 tokens = 3840; the
FFN's two layers and the attention projections), the shapes ``auto`` measures for
``dt/hopper_medium``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import typer

from rl_tformers.bench.options import check_out, emit_result, fail
from rl_tformers.bench.train import matmul_gflops
from rl_tformers.runtime.cpu_matmul import (
    AUTO_MARGIN,
    PRODUCTS,
    choose_library,
    library_gflops,
    onednn_linear_available,
    product_fns,
)
from rl_tformers.runtime.host import host_description
from rl_tformers.runtime.timing import interleaved_timing

#: (K, N) of the default products: first FFN layer, second FFN layer, q/k/v/output projections
DEFAULT_SHAPES = ((128, 512), (512, 128), (128, 128))


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"128x512,512x128"`` -> ``[(128, 512), (512, 128)]`` (K x N of each product).

    Raises:
        ValueError: naming ``--shapes`` for a malformed entry or a size < 1.
    """
    out = []
    for part in text.split(","):
        try:
            k, n = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes: {part.strip()!r} is not KxN (e.g. 128x512)") from None
        if k < 1 or n < 1:
            raise ValueError(f"--shapes: {part.strip()!r} needs sizes >= 1")
        out.append((k, n))
    return out


def run(m: int = 3840, shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES, repeats: int = 50,
        sizes: Sequence[int] = (512, 1024, 2048), log: Callable[[str], None] | None = None) -> dict:
    """Time every product of every shape with both libraries (module docstring).

    Args:
        m: rows M of ``x`` (tokens in a batch).
        shapes: (K, N) of each ``nn.Linear`` product.
        repeats: timed rounds (after 5 warm-up rounds) per shape.
        sizes: n of the n x n x n peak matmuls.
        log: progress lines.

    Returns:
        ``{"m", "threads", "repeats", "rows": [{"k", "n", "product", "mkl_ms", "onednn_ms",
        "onednn_over_mkl"}], "gflops": {"mkl", "onednn"}, "auto_choice", "peak_gflops": {"mkl":
        {n: GFLOP/s}, "onednn": {n: GFLOP/s}}, "machine"}``; times are median milliseconds per
        call (wall clock); ``gflops`` is each library's rate over all the products and
        ``auto_choice`` the library ``cpu_matmul: auto`` picks from those rates
        (:func:`~rl_tformers.runtime.cpu_matmul.choose_library`; ``auto`` itself measures
        fewer rounds, on the run's shapes); ``machine``: :func:`~rl_tformers.runtime.host.host_description`.

    Raises:
        RuntimeError: this PyTorch build has no oneDNN linear operator.
        ValueError: ``m``, ``repeats`` or a size < 1.
    """

    if not onednn_linear_available():
        raise RuntimeError("this PyTorch build has no oneDNN linear operator (torch.ops.mkldnn._linear_pointwise)")
    if m < 1 or repeats < 1 or any(s < 1 for s in sizes):
        raise ValueError(f"--m, --repeats and --sizes must be >= 1, got {m}, {repeats}, {list(sizes)}")
    rows, medians = [], {}
    for k, n in shapes:
        t = interleaved_timing(product_fns(m, k, n), repeats=repeats)
        for product in PRODUCTS:
            a, b = t[(product, "mkl")]["median_ms"], t[(product, "onednn")]["median_ms"]
            rows.append({"k": k, "n": n, "product": product, "mkl_ms": a, "onednn_ms": b, "onednn_over_mkl": b / a})
            medians.update({(m, k, n, product, "mkl"): a, (m, k, n, product, "onednn"): b})
        if log:
            log(f"{m} x {k} . {n} x {k}: done")
    gflops = library_gflops(medians)
    cpu = torch.device("cpu")
    peak = {lib: {s: matmul_gflops(cpu, torch.float32, s, reps=3, library="onednn" if lib == "onednn" else "torch")
                  for s in sizes} for lib in ("mkl", "onednn")}
    return {"m": m, "threads": torch.get_num_threads(), "repeats": repeats, "rows": rows,
            "gflops": gflops, "auto_choice": choose_library(gflops["mkl"], gflops["onednn"]),
            "peak_gflops": peak, "machine": host_description("cpu")}


def markdown(res: dict) -> str:
    """One row per shape: ms of each product, MKL vs oneDNN; then the n x n peaks."""
    m = res["m"]
    lines = ["| x (M x K) · W^T (N x K) | forward | dL/dx = g W | dL/dW = g^T x |", "|---|---|---|---|"]
    by = {(r["k"], r["n"], r["product"]): r for r in res["rows"]}
    for k, n in dict.fromkeys((r["k"], r["n"]) for r in res["rows"]):
        cells = [f"{by[(k, n, p)]['mkl_ms']:.2f} vs {by[(k, n, p)]['onednn_ms']:.2f}"
                 for p in ("forward", "grad_input", "grad_weight")]
        lines.append(f"| {m} x {k} · {n} x {k} | " + " | ".join(cells) + " |")
    lines.append("")
    g = res["gflops"]
    lines.append(f"all products: MKL {g['mkl']:.1f} GFLOP/s, oneDNN {g['onednn']:.1f} GFLOP/s: cpu_matmul: auto "
                 f"picks {res['auto_choice']} (oneDNN only when more than {AUTO_MARGIN:.0%} faster)")
    lines.append("ms per call, MKL vs oneDNN (median); n x n x n peak, GFLOP/s: " + "; ".join(
        f"{lib} " + ", ".join(f"n={s}: {g:.0f}" for s, g in by_n.items()) for lib, by_n in res["peak_gflops"].items()))
    return "\n".join(lines)


def register(bench_app) -> None:
    """Hook into a Typer group: ``bench gemm``."""

    def gemm(
        m: int = typer.Option(3840, help="Rows M of x (tokens per batch: 64 x 60 for the DT)."),
        shapes: str = typer.Option("128x512,512x128,128x128", help="KxN of each nn.Linear product."),
        repeats: int = typer.Option(50, help="Timed rounds per shape."),
        sizes: str = typer.Option("512,1024,2048", help="n of the n x n x n peak matmuls."),
        threads: int = typer.Option(1, min=1, help="torch CPU threads."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
        out: str | None = typer.Option(None, help="Also write the JSON to this file."),
    ) -> None:
        """MKL vs oneDNN float32 GEMMs on the DT's linear layers (what cpu_matmul chooses)."""

        try:
            shape_list = parse_shapes(shapes)
            try:
                size_list = [int(v) for v in sizes.split(",")]
            except ValueError:
                raise ValueError(f"--sizes must be comma-separated integers, got {sizes!r}") from None
            if m < 1 or repeats < 1 or any(s < 1 for s in size_list):
                raise ValueError(f"--m, --repeats and --sizes must be >= 1, got {m}, {repeats}, {size_list}")
        except ValueError as exc:
            fail(str(exc))
        check_out(out)
        torch.set_num_threads(threads)
        try:
            res = run(m, shape_list, repeats, size_list, log=lambda msg: typer.echo(msg, err=True))
        except RuntimeError as exc:
            fail(str(exc))
        emit_result(res, markdown(res), out=out, as_json=as_json)

    bench_app.command("gemm")(gemm)
