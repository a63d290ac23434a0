"""AdamW with decay / no-decay parameter groups, and learning-rate schedules.

Weight decay applies to the weight matrices of linear/attention/convolution layers only;
biases, normalisation parameters (LayerNorm, RMSNorm, GroupNorm, BatchNorm), embedding tables
and every parameter with fewer than two dimensions are not decayed (as in minGPT and the
Decision Transformer reference code; decaying LayerNorm gains towards zero is harmful).

Schedules (``train.schedule``), as a factor on ``train.lr`` for the update with index ``s``
(0-based; update ``s`` is the ``s + 1``-th optimiser step), ``W = train.warmup_steps``,
``N = train.steps``, ``m = train.min_lr_ratio``:

- ``constant``: 1.
- ``linear_warmup``: ``(s + 1) / W`` for ``s < W``, then 1 (the Decision Transformer's schedule).
- ``warmup_cosine``: linear warmup, then ``m + (1 - m) * (1 + cos(pi * p)) / 2`` with
  ``p = (s - W) / (N - W)`` clipped to [0, 1] (Loshchilov & Hutter 2017, SGDR, without restarts).

The learning rate is a pure function of the step and the config, so a resumed run gets exactly
the learning rates of an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("constant", "linear_warmup", "warmup_cosine")

#: Module types whose parameters are never weight-decayed.
NO_DECAY_MODULES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.GroupNorm,
    nn.modules.batchnorm._BatchNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def default_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Args:
        model: the module to optimise. Shared parameters are listed once.
        weight_decay: decoupled weight decay of the ``decay`` group (AdamW's lambda).

    Returns:
        ``[{"name": "decay", "params": [...], "weight_decay": weight_decay},
        {"name": "no_decay", "params": [...], "weight_decay": 0.0}]`` (empty groups dropped).
    """
    no_decay_ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, NO_DECAY_MODULES):
            no_decay_ids.update(id(p) for p in module.parameters(recurse=False))
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or id(p) in no_decay_ids else decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


#: Device types with PyTorch's fused (single-kernel, multi-tensor) AdamW.
FUSED_DEVICES = ("cpu", "cuda")


def adamw_implementation(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """Keyword arguments choosing AdamW's implementation for ``params``.

    ``{"fused": True}`` when every parameter is a dense floating-point tensor on a device in
    :data:`FUSED_DEVICES` (one kernel updates every parameter of a group: no per-parameter
    kernel launches on GPU; on CPU the optimiser is ~1% of a DT update either way, see
    ``rl-tformers bench profile --adamw loop`` in docs/performance.md); otherwise ``{}``
    (PyTorch's default: ``foreach`` where supported). Same update rule either way.
    """
    params = list(params)
    ok = bool(params) and all(
        p.is_floating_point() and p.layout == torch.strided and p.device.type in FUSED_DEVICES for p in params
    )
    return {"fused": True} if ok else {}


def build_optimizer(
    groups: Iterable[Mapping[str, Any]],
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over ``groups`` (Loshchilov & Hutter 2019, decoupled weight decay).

    Each group is a dict with ``params`` and optionally ``weight_decay``, ``lr_scale``
    (multiplies ``lr``) and ``name``; missing ``weight_decay`` takes ``weight_decay``. The
    fused implementation is used where available (:func:`adamw_implementation`).

    Raises:
        ValueError: if there is no trainable parameter, or a parameter appears in two groups.
    """
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for i, g in enumerate(groups):
        params = [p for p in g["params"] if p.requires_grad]
        for p in params:
            if id(p) in seen:
                raise ValueError(f"param_groups: a parameter appears in more than one group (group {i})")
            seen.add(id(p))
        if not params:
            continue
        group = dict(g)
        group["params"] = params
        group.setdefault("weight_decay", weight_decay)
        group.setdefault("name", f"group{i}")
        group["lr"] = lr * float(group.pop("lr_scale", 1.0))
        out.append(group)
    if not out:
        raise ValueError("the model has no trainable parameters")
    impl = adamw_implementation(p for g in out for p in g["params"])
    return torch.optim.AdamW(out, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **impl)


class LRSchedule:
    """Learning-rate factor as a function of the update index (see the module docstring).

    Args:
        kind: one of :data:`SCHEDULES`.
        total_steps: N, the run length in optimiser updates.
        warmup_steps: W >= 0.
        min_lr_ratio: m in [0, 1], the final factor of ``warmup_cosine``.

    Raises:
        ValueError: for an unknown kind or out-of-range numbers.
    """

    def __init__(self, kind: str, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> None:
        if kind not in SCHEDULES:
            raise ValueError(f"train.schedule={kind!r}; use one of {', '.join(SCHEDULES)}")
        if warmup_steps < 0:
            raise ValueError(f"train.warmup_steps must be >= 0, got {warmup_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.kind = kind
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, step: int) -> float:
        if self.kind != "constant" and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "warmup_cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, max(0.0, (step - self.warmup_steps) / span))
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0


def restretch_message(kind: str, lr: float, warmup_steps: int, min_lr_ratio: float, old_total: int,
                      new_total: int, step: int) -> str | None:
    """The warning for a resume at update ``step`` that changes ``train.steps`` from ``old_total``
    to ``new_total`` under a schedule that depends on it (``warmup_cosine`` past its warmup):
    the schedule is re-stretched over the new length, so the learning rate of the next update
    is not the one the old schedule would have continued with. ``None`` when nothing jumps.

    Args:
        kind, warmup_steps, min_lr_ratio: the run's schedule (:class:`LRSchedule`).
        lr: ``train.lr`` (the factor's base).
        old_total, new_total: ``train.steps`` of the checkpoint's config and of the resume.
        step: updates done (the checkpoint's step): the next update has index ``step``.
    """
    if kind != "warmup_cosine" or old_total == new_total or step <= warmup_steps or step <= 0:
        return None
    before = lr * LRSchedule(kind, old_total, warmup_steps, min_lr_ratio)(step - 1)
    after = lr * LRSchedule(kind, new_total, warmup_steps, min_lr_ratio)(step)
    if math.isclose(before, after, rel_tol=0.01):
        return None
    return (f"train.steps {old_total} -> {new_total} re-stretches the warmup_cosine schedule over {new_total} updates: "
            f"the learning rate goes from {before:.3g} (update {step - 1}, the last one trained) to {after:.3g} "
            f"(update {step}), the value a {new_total}-update run has there, and decays to train.lr x "
            f"train.min_lr_ratio by update {new_total}")


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> LambdaLR:
    """A ``LambdaLR`` applying ``schedule`` to every group (each group keeps its own base lr)."""
    return LambdaLR(optimizer, [schedule] * len(optimizer.param_groups))


def scheduler_state(scheduler: LambdaLR) -> dict[str, Any]:
    """The part of the scheduler state that a checkpoint needs: the update counters."""
    return {"last_epoch": int(scheduler.last_epoch), "_step_count": int(scheduler._step_count)}


def restore_scheduler(scheduler: LambdaLR, state: Mapping[str, Any]) -> None:
    """Restore the counters and set every group's lr from the schedule at that step.

    The schedule itself comes from the current config, so extending ``train.steps`` on resume
    stretches a cosine schedule instead of keeping the old end point.
    """
    scheduler.last_epoch = int(state["last_epoch"])
    scheduler._step_count = int(state["_step_count"])
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
