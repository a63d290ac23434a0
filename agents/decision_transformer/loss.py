"""Decision Transformer loss: a pure function of (model, batch).

Chen et al. 2021, section 2.3: mean-squared error between predicted and dataset actions for
continuous actions, cross-entropy for discrete ones, averaged over *unpadded* steps only.
Online DT (Zheng et al. 2022, eq. 4-6): negative log-likelihood of a tanh-squashed Gaussian
minus temperature * entropy, with the temperature learnt to keep the entropy above a target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_tformers.agents.decision_transformer.model import (
    DecisionTransformer,
    discrete_ce,
    squashed_gaussian_log_prob,
    squashed_gaussian_sample,
)
from torch import Tensor

from rl_tformers.types import sum_aux


def masked_mean(x: Tensor, w: Tensor) -> Tensor:
    """Mean of ``x`` over entries where ``w`` is 1: x, w (B, P) -> scalar (0 when w is all 0)."""
    w = w.to(x.dtype)
    return (x * w).sum() / w.sum().clamp_min(1.0)


def dt_loss(model: DecisionTransformer, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Any]]:
    """Training loss of a :class:`DecisionTransformer` on one batch of windows.

    Args:
        model: the model (its ``cfg`` decides mode and head).
        batch: tensors already normalised by the agent:
            ``obs`` (B, K, obs_dim); ``actions`` (B, K, A) in [-1, 1] or (B, K) long;
            ``rtg`` (B, K) scaled returns-to-go; ``timesteps`` (B, K) long; ``mask`` (B, K) bool.
            ``causal`` mode: every real step is a target. ``last_action`` mode: only step K-1
            (windows aligned at their end, so the last step is real; a padded last step
            contributes nothing).

    Returns:
        (loss, metrics): scalar loss including the backbone's auxiliary losses, and floats to log
        (``action_mse``/``action_ce``/``nll``, ``entropy``, ``temperature``, aux terms).
    """
    cfg = model.cfg
    out = model(batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    mask = batch["mask"].bool()
    target = batch["actions"]
    if cfg.mode == "last_action":
        mask, target = mask[:, -1:], target[:, -1:]  # (B, 1), (B, 1, A) or (B, 1)
    metrics: dict[str, Any] = {}
    if cfg.discrete:
        loss = masked_mean(discrete_ce(out.logits, target), mask)
        metrics["action_ce"] = loss.detach()
        metrics["action_acc"] = masked_mean((out.action == target.long()).float(), mask).detach()
    elif cfg.head == "gaussian":
        nll = -masked_mean(squashed_gaussian_log_prob(out.mean, out.log_std, target), mask)
        sample = squashed_gaussian_sample(out.mean, out.log_std)
        entropy = -masked_mean(squashed_gaussian_log_prob(out.mean, out.log_std, sample), mask)  # MC estimate
        temperature = model.log_temperature.exp()
        # policy term uses a fixed temperature; the temperature term moves it toward the target entropy
        loss = nll - temperature.detach() * entropy + temperature * (entropy.detach() - model.target_entropy)
        metrics.update(nll=nll.detach(), entropy=entropy.detach(), temperature=temperature.detach())
        metrics["action_mse"] = masked_mean((out.action - target).pow(2).mean(-1), mask).detach()
    else:
        loss = masked_mean((out.action - target).pow(2).mean(-1), mask)  # (B, P) -> scalar
        metrics["action_mse"] = loss.detach()
    aux = sum_aux(out.aux)
    if isinstance(aux, Tensor):
        loss = loss + aux
        metrics.update({f"aux/{k}": v.detach() for k, v in out.aux.items()})
    metrics.update({f"backbone/{k}": v for k, v in out.metrics.items()})
    metrics["loss"] = loss.detach()
    return loss, metrics

