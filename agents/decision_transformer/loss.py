"""Decision Transformer loss: a pure function of (model, batch).

Chen et al. 2021, section 2.3: mean-squared error between predicted and dataset actions for
continuous actions, cross-entropy for discrete ones, averaged over *unpadded* steps only.
Online DT (Zheng et al. 2022, eq. 4-6): negative log-likelihood of a tanh-squashed Gaussian
minus temperature * entropy, with the temperature learnt to keep the entropy above a target.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from rl_tformers.agents.decision_transformer.model import (
    DecisionTransformer,
    discrete_ce,
    squashed_gaussian_log_prob,
    squashed_gaussian_sample,
)
from torch import Tensor

from rl_tformers.depth.early_exit import consistency_labels, exit_loss
from rl_tformers.runtime.distributed import shard_mean_total
from rl_tformers.types import sum_aux


def masked_mean(x: Tensor, w: Tensor, total: Tensor | None = None) -> Tensor:
    """Mean of ``x`` over entries where ``w`` is 1: x, w (B, P) -> scalar (0 when w is all 0).

    ``total``: divide the masked sum by it instead of by ``w.sum()`` (the DDP divisor of
    :func:`~rl_tformers.runtime.distributed.shard_mean_total`, so that the ranks' averaged
    gradient is that of the mean over the global batch's unpadded steps).
    """
    w = w.to(x.dtype)
    if total is not None:
        return (x * w).sum() / total
    return (x * w).sum() / w.sum().clamp_min(1.0)


def _gaussian_loss(model: DecisionTransformer, out: Any, target: Tensor, mask: Tensor, total: Tensor | None,
                   exits: Tensor | None, metrics: dict[str, Any]) -> Tensor:
    """Online DT's loss of the gaussian head: NLL of the actions (or the early-exit terms
    ``exits``) minus temperature x entropy (a one-sample estimate), plus the temperature loss
    toward ``model.target_entropy`` (Zheng et al. 2022); logs into ``metrics``."""
    nll = -masked_mean(squashed_gaussian_log_prob(out.mean, out.log_std, target), mask, total)
    metrics["nll_last"] = nll.detach()
    if exits is not None:
        nll = exits
    sample = squashed_gaussian_sample(out.mean, out.log_std)
    entropy = -masked_mean(squashed_gaussian_log_prob(out.mean, out.log_std, sample), mask, total)  # MC estimate
    temperature = model.log_temperature.exp()
    # policy term uses a fixed temperature; the temperature term moves it toward the target entropy
    loss = nll - temperature.detach() * entropy + temperature * (entropy.detach() - model.target_entropy)
    metrics.update(nll=nll.detach(), entropy=entropy.detach(), temperature=temperature.detach())
    metrics["action_mse"] = masked_mean((out.action - target).pow(2).mean(-1), mask, total).detach()
    return loss


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

    Under DDP (the trainer's :class:`~rl_tformers.runtime.distributed.AgentLoss`) the means over
    unpadded steps divide by the global count / W (:func:`~rl_tformers.runtime.distributed.shard_mean_total`),
    so W processes train like one process on the same global batch (the per-rank metrics then
    average to the global-batch values). The early-exit terms and the backbone's auxiliary
    losses are still per-shard means.
    """

    cfg = model.cfg
    early = model.early_exit
    out = model(batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"],
                output_hidden_states=early)
    mask = batch["mask"].bool()
    target = batch["actions"]
    if cfg.mode == "last_action":
        mask, target = mask[:, -1:], target[:, -1:]  # (B, 1), (B, 1, A) or (B, 1)
    metrics: dict[str, Any] = {}
    total = shard_mean_total(mask.sum())  # None with one process: each mean divides by its own count
    exits = _exit_terms(model, out, target, mask, metrics) if early else None
    if cfg.discrete:
        loss = masked_mean(discrete_ce(out.logits, target), mask, total)
        metrics["action_ce"] = loss.detach()
        metrics["action_acc"] = masked_mean((out.action == target.long()).float(), mask, total).detach()
        if exits is not None:
            loss = exits
    elif cfg.head == "gaussian":
        loss = _gaussian_loss(model, out, target, mask, total, exits, metrics)
    else:
        loss = masked_mean((out.action - target).pow(2).mean(-1), mask, total)  # (B, P) -> scalar
        metrics["action_mse"] = loss.detach()
        if exits is not None:
            loss = exits
    if early:
        loss = loss + metrics.pop("_exit_classifier_loss")
    aux = sum_aux(out.aux)
    if isinstance(aux, Tensor):
        loss = loss + aux
        metrics.update({f"aux/{k}": v.detach() for k, v in out.aux.items()})
    metrics.update({f"backbone/{k}": v for k, v in out.metrics.items()})
    metrics["loss"] = loss.detach()
    return loss, metrics



def _token_loss(model: DecisionTransformer, pred, target: Tensor) -> Tensor:
    """Per-step loss of one prediction (:class:`DTOutput`): (B, P) CE, -log pi or MSE."""
    cfg = model.cfg
    if cfg.discrete:
        return discrete_ce(pred.logits, target)
    if cfg.head == "gaussian":
        return -squashed_gaussian_log_prob(pred.mean, pred.log_std, target)
    return (pred.action - target).pow(2).mean(-1)


def _exit_terms(model: DecisionTransformer, out, target: Tensor, mask: Tensor, metrics: dict[str, Any]) -> Tensor:
    """Early-exit training (depth kind ``early_exit``): the head on every exit, the exit classifier.

    Elbayad et al. 2020 (sec. 2.2, 3.3) and CALM (Schuster et al. 2022, sec. 4): the shared
    action head is applied after every layer, ``head(final_norm(h^n))``, and the per-step
    losses (N, B, P) are combined by ``agent.early_exit.scheme``
    (:func:`~rl_tformers.depth.early_exit.exit_loss`; ``sampled``: one uniformly random
    exit per step). The exit classifier's own loss (trained on detached states against its
    oracle: agreement with the last layer for ``classifier``, the likelihood oracle for
    Elbayad's classifiers) is put in ``metrics["_exit_classifier_loss"]`` for the caller to add.

    Returns:
        0-d tensor: the combined action loss (replaces the last-layer loss).
    """

    cfg = model.cfg
    bb = model.backbone
    preds = [model.predict(bb.final_norm(h)) for h in out.hidden_states]  # N x DTOutput, (B, P, ...)
    token_losses = torch.stack([_token_loss(model, p, target) for p in preds])  # (N, B, P)
    loss = exit_loss(token_losses, mask, scheme=cfg.exit_scheme)
    outputs = [p.logits if cfg.discrete else p.action for p in preds]
    consistent = consistency_labels([o.detach() for o in outputs], cfg.discrete, cfg.exit_tol)  # (N, B, P)
    correct = None
    if bb.depth.cfg.oracle == "correctness":
        if cfg.discrete:
            correct = torch.stack([o.argmax(-1) == target.long() for o in outputs])
        else:
            correct = torch.stack([(o - target).abs().amax(-1) <= cfg.exit_tol for o in outputs])
    clf = bb.depth.exit_classifier_loss(
        out.hidden_states, token_loss=token_losses.detach(), mask=mask, consistent=consistent, correct=correct,
    )
    metrics["_exit_classifier_loss"] = clf
    metrics["exit/classifier_loss"] = clf.detach()
    w = mask.float()
    for n in range(token_losses.shape[0]):
        metrics[f"exit/loss_layer{n + 1}"] = ((token_losses[n] * w).sum() / w.sum().clamp_min(1)).detach()
        metrics[f"exit/agree_layer{n + 1}"] = ((consistent[n].float() * w).sum() / w.sum().clamp_min(1)).detach()
    return loss
