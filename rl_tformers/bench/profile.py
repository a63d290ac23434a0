"""Profile of one Decision Transformer training update (``rl-tformers bench profile``).

Builds the same :class:`~rl_tformers.runtime.trainer.Trainer` as ``rl-tformers bench train``
(``dt/hopper_medium`` + overrides), times ``--steps`` updates on pre-sampled batches without
the profiler, then records ``--profile-steps`` more with ``torch.profiler`` and reports the
time per update by category of operator (self CPU time, or self CUDA time on GPU):

- ``matmul``: ``mm``, ``addmm``, ``bmm``, oneDNN's linear (``cpu_matmul: onednn``), fused attention kernels;
- ``dropout RNG``: ``bernoulli_`` (the random masks; applying them is ``elementwise``);
- ``addmm bias copy``: the bias broadcast that ``addmm`` copies into its output before the GEMM;
- ``elementwise``: activations and their backward, adds, multiplies, where, masks...;
- ``norm``: LayerNorm forward and backward; ``softmax``; ``reduction`` (sums, norms);
- ``optimizer``: AdamW kernels; ``other``: everything else (copies, views, Python overhead).

``--adamw`` picks AdamW's implementation (``fused``: the trainer's default where available;
``foreach``; ``loop``: one parameter at a time, PyTorch's CPU default) to measure what the fused
optimiser is worth.

Command: ``rl-tformers bench profile --adamw loop`` (the shipped DT config; overrides as ``KEY=VALUE``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import typer
from torch.profiler import ProfilerActivity

from rl_tformers.bench.memory import quiet_profile
from rl_tformers.bench.train import OursRunner, Settings, machine_info

ADAMW = ("fused", "foreach", "loop")

CATEGORIES = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise",
                "aten::_scaled_dot_product_flash_attention_for_cpu",
                "aten::_flash_attention_forward", "aten::_flash_attention_backward", "aten::baddbmm")),
    ("dropout RNG", ("aten::bernoulli_",)),
    ("norm", ("aten::native_layer_norm", "aten::native_layer_norm_backward")),
    ("softmax", ("aten::_softmax", "aten::_softmax_backward_data")),
    ("optimizer", ("aten::_fused_adamw_", "aten::_foreach_", "aten::lerp_", "aten::addcmul_", "aten::addcdiv_",
                   "aten::sqrt", "aten::_foreach_sqrt")),
    ("reduction", ("aten::sum", "aten::linalg_vector_norm", "aten::mean", "aten::any", "aten::all", "aten::max",
                   "aten::min")),
    ("elementwise", ("aten::mul", "aten::add", "aten::div", "aten::where", "aten::threshold_backward",
                     "aten::clamp_min", "aten::relu", "aten::gelu", "aten::tanh", "aten::sub", "aten::masked_fill",
                     "aten::bitwise_", "aten::pow", "aten::exp", "aten::eq", "aten::ne", "aten::ge", "aten::lt",
                     "aten::fill_", "aten::zero_", "aten::embedding_dense_backward", "aten::index")),
)


def category(name: str, parent: str | None) -> str:
    """Category of an operator (see the module docstring); ``copy_`` under ``addmm`` is the bias copy."""
    if name == "aten::copy_" and parent == "aten::addmm":
        return "addmm bias copy"
    for cat, prefixes in CATEGORIES:
        if any(name == p or name.startswith(p) for p in prefixes):
            return cat
    return "other"


def set_adamw(runner: OursRunner, impl: str) -> None:
    """Rebuild the trainer's AdamW with the same groups and hyper-parameters in ``impl``."""
    if impl not in ADAMW:
        raise ValueError(f"--adamw {impl!r}; use one of {', '.join(ADAMW)}")
    tr = runner.trainer
    old = tr.optimizer
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in old.param_groups]
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}[impl]
    for g in groups:
        g["lr"] = g.pop("initial_lr", g["lr"])  # the peak lr; the new scheduler applies the schedule again
    tr.optimizer = torch.optim.AdamW(groups, **flags)
    tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, tr.scheduler.lr_lambdas)


def run(overrides: list[str], steps: int = 20, profile_steps: int = 5, adamw: str = "fused", threads: int = 1,
        device: str = "cpu", dataset: str | None = None) -> dict[str, Any]:
    """Time and profile DT updates (see the module docstring). Returns a JSON-ready dict."""


    if device == "cpu":
        torch.set_num_threads(max(1, threads))
    s = Settings(device=device, **({"dataset": dataset} if dataset else {}))
    runner = OursRunner("ours", s, overrides, Path(tempfile.mkdtemp(prefix="rlt-bench-profile-")))
    set_adamw(runner, adamw)
    runner.run("model", 3)  # warm-up
    rates = [steps / runner.run("model", steps) for _ in range(3)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with quiet_profile(activities=acts) as prof:
        runner.run("model", profile_steps)
    use_cuda = device.startswith("cuda")
    by_cat: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for e in prof.events():
        t = (e.self_device_time_total if use_cuda else e.self_cpu_time_total) / 1e3 / profile_steps  # ms/update
        if t <= 0:
            continue
        parent = e.cpu_parent.name if e.cpu_parent is not None else None
        by_cat[category(e.name, parent)] += t
        by_op[e.name] += t
    total = sum(by_cat.values())
    runner.close()
    return {
        "overrides": overrides, "adamw": adamw, "device": device, "machine": machine_info(runner.device),
        "updates_per_s": statistics.median(rates), "updates_per_s_all": rates,
        "profiled_ms_per_update": total,
        "categories": {k: {"ms": v, "share": v / total} for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_ops": {k: v for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]},
    }


def markdown(res: dict[str, Any]) -> str:
    lines = [f"{res['updates_per_s']:.2f} updates/s (AdamW {res['adamw']}, {' '.join(res['overrides']) or 'shipped config'}); "
             f"profiled {res['profiled_ms_per_update']:.0f} ms/update", "",
             "| category | ms/update | share |", "|---|---|---|"]
    lines += [f"| {k} | {v['ms']:.1f} | {100 * v['share']:.0f}% |" for k, v in res["categories"].items()]
    lines += ["", "| operator | ms/update |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in res["top_ops"].items()]
    return "\n".join(lines)


def register(bench_app) -> None:
    """Add the ``profile`` command to the ``bench`` Typer group."""

    def profile_(
        overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Overrides of dt/hopper_medium."),
        steps: int = typer.Option(20, help="Timed updates per run (3 runs, median)."),
        profile_steps: int = typer.Option(5, help="Profiled updates."),
        adamw: str = typer.Option("fused", help="AdamW implementation: fused, foreach or loop."),
        threads: int = typer.Option(1, help="torch intra-op threads (CPU)."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        dataset: str = typer.Option(None, help="Dataset (default: the Hopper medium dataset)."),
        out: str = typer.Option(None, "--out", help="Also write the JSON results to this file."),
    ) -> None:
        """Time per DT update by operator category (torch.profiler), with a choice of AdamW implementation."""
        if adamw not in ADAMW:
            raise typer.BadParameter(f"use one of {', '.join(ADAMW)}", param_hint="--adamw")
        res = run(list(overrides or []), steps, profile_steps, adamw, threads, device, dataset)
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(res, indent=2))
        typer.echo(markdown(res))

    bench_app.command("profile")(profile_)


__all__ = ["ADAMW", "category", "markdown", "run", "set_adamw"]
