"""Behaviour cloning loss: a pure function of (model, batch).

MSE to the dataset action (continuous, normalised units) or cross-entropy (discrete), averaged
over the real steps of the batch (``mask``), the same objective as the Decision Transformer's
minus the return conditioning and the context.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn.functional as F
from rl_tformers.agents.bc.model import BCModel
from torch import Tensor


def bc_loss(model: BCModel, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
    """Loss on a batch of steps.

    Args:
        model: the policy network.
        batch: ``obs`` (B, obs_dim) normalised; ``actions`` (B, A) in [-1, 1] or (B,) long;
            optional ``mask`` (B,) bool (default: all real).

    Returns:
        (scalar loss, metrics dict with ``action_mse`` or ``action_ce`` and ``loss``).
    """
    pred = model(batch["obs"])
    target = batch["actions"]
    mask = batch.get("mask")
    if model.cfg.discrete:
        per = F.cross_entropy(pred, target.long(), reduction="none")  # (B,)
        name = "action_ce"
    else:
        per = (pred - target).pow(2).mean(-1)  # (B,)
        name = "action_mse"
    if mask is None:
        loss = per.mean()
    else:
        w = mask.to(per.dtype)
        loss = (per * w).sum() / w.sum().clamp_min(1.0)
    return loss, {name: loss.detach(), "loss": loss.detach()}
