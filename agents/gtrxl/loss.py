"""Offline objectives of the GTrXL agent: BC, return-conditioned BC and IQL, with burn-in.

Every loss is a pure function of (model, batch[, target]) and returns ``(loss, metrics)``.

Segments and burn-in (R2D2, Kapturowski et al. 2019, sec. 3): a batch row holds
``burn_in + T`` consecutive steps of the dataset stream. The first ``burn_in`` steps are run
through the encoder *with the current weights and without gradient* to rebuild the memory;
the last ``T`` steps are the gradient window, which attends to that memory (and to its own
earlier steps). A row may cross episode boundaries: ``episode_start`` masks everything before
a new episode, exactly as at acting time.

Objectives (``agent.objective``):

- ``bc``: behaviour cloning. Continuous: MSE between the tanh-mean action and the data action
  (both in [-1, 1]); discrete: cross-entropy.
- ``rcbc``: the same loss with the return-to-go as an input (return-conditioned BC; the model
  must be built with ``rtg_input``), as the Decision Transformer conditions on it.
- ``iql``: Implicit Q-Learning (Kostrikov et al. 2021, eqs. 5-7) on GTrXL features:
  L_V = E[L2^tau(Q_target(s, a) - V(s))] (expectile tau), L_Q = E[(r + gamma (1 - d) V(s') -
  Q_i(s, a))^2] for twin Q, and advantage-weighted regression for the actor,
  L_pi = -E[min(exp(beta (Q_target - V)), w_max) log pi(a | s)]. Q_target is the minimum of the
  Polyak-averaged target twin Q (target encoder included). s' is the next step's token of the
  same row; pairs whose next step is not in the row (end of the window, truncated episode
  end, padding) are masked unless the step is terminal (then the target is r).

Under DDP (``--nproc W``; :mod:`rl_tformers.runtime.distributed`) every mean over real steps or
usable pairs divides the shard's sum by the global count / W
(:func:`~rl_tformers.runtime.distributed.shard_mean_total`), so the ranks' averaged gradient is
that of the single-process mean over the global batch, however unevenly padding falls across
the shards (tested against one process). With one process nothing changes, bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from rl_tformers.agents.gtrxl.model import EncoderOutput, GTrXLEncoder, GTrXLModel, gate_logs
from torch import Tensor, nn

from rl_tformers.depth.early_exit import consistency_labels, exit_loss
from rl_tformers.runtime.distributed import shard_mean_total


@dataclass
class SegmentBatch:
    """A batch of B rows of L = burn_in + T consecutive dataset steps (normalised units).

    Attributes:
        obs: (B, L, O) float, normalised observations.
        actions: (B, L, A) float in [-1, 1] (continuous) or (B, L) long (discrete).
        rewards: (B, L) float, scaled rewards r_t.
        rtg: (B, L) float, scaled return-to-go from step t (inclusive).
        prev_action: (B, L, A) float or (B, L) long, a_{t-1}; zeros at an episode start.
        prev_reward: (B, L) float, scaled r_{t-1}; zero at an episode start.
        terminals: (B, L) bool, the episode terminated after step t (not a time-limit cut).
        episode_start: (B, L) bool, step t is the first of its episode.
        timesteps: (B, L) long, step index within the episode (the backbone positions).
        mask: (B, L) bool, False for padding beyond the ends of the dataset stream.
        burn_in: number of leading steps used only to rebuild the memory.
    """

    obs: Tensor
    actions: Tensor
    rewards: Tensor
    rtg: Tensor
    prev_action: Tensor
    prev_reward: Tensor
    terminals: Tensor
    episode_start: Tensor
    timesteps: Tensor
    mask: Tensor
    burn_in: int = 0

    def to(self, device: torch.device | str) -> SegmentBatch:
        """A copy with every tensor on ``device`` (``burn_in`` unchanged)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return SegmentBatch(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in kw.items()})

    def window(self) -> SegmentBatch:
        """The gradient window only (the last T steps), burn_in = 0."""
        k = self.burn_in
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return SegmentBatch(**{n: v[:, k:] if isinstance(v, Tensor) else v for n, v in kw.items()} | {"burn_in": 0})


def encode_segment(encoder: GTrXLEncoder | nn.Module, batch: SegmentBatch, *, need_weights: bool = False,
                   output_hidden_states: bool = False) -> EncoderOutput:
    """Burn-in without gradient, then the gradient window (R2D2-style stored-state recovery).

    Args:
        encoder: a :class:`GTrXLEncoder` (or its Polyak target copy).
        batch: rows of ``burn_in + T`` steps.
        need_weights: request attention probabilities on the gradient window.
        output_hidden_states: also return every layer's output on the gradient window.

    Returns:
        :class:`EncoderOutput` of the gradient window: features (B, T, D) and the memory after it.
    """
    x = encoder.inputs(batch.obs, batch.rtg, batch.prev_action, batch.prev_reward)  # (B, L, input_dim)
    k = batch.burn_in
    if not getattr(encoder, "stateful", True):  # plain window (agent.window): no memory to rebuild
        return encoder(
            x[:, k:], batch.timesteps[:, k:], episode_start=batch.episode_start[:, k:], mask=batch.mask[:, k:],
            need_weights=need_weights, **({"output_hidden_states": True} if output_hidden_states else {}),
        )
    state = encoder.initial_state(x.shape[0], x.device)
    if k > 0:
        with torch.no_grad():
            warm = encoder(
                x[:, :k], batch.timesteps[:, :k], state=state,
                episode_start=batch.episode_start[:, :k], mask=batch.mask[:, :k],
            )
        state = warm.state.detach()
    return encoder(
        x[:, k:], batch.timesteps[:, k:], state=state,
        episode_start=batch.episode_start[:, k:], mask=batch.mask[:, k:], need_weights=need_weights,
        **({"output_hidden_states": True} if output_hidden_states else {}),
    )


def _masked_mean(x: Tensor, mask: Tensor, total: Tensor | None = None) -> Tensor:
    """Mean of ``x`` over the True entries of ``mask``: x, mask (B, T) -> scalar (0 when the mask is empty).

    ``total``: divide the masked sum by it instead of by ``mask.sum()``: the DDP divisor of
    :func:`~rl_tformers.runtime.distributed.shard_mean_total` (the global count / W), so that the
    ranks' averaged gradient is that of the mean over the global batch's masked entries.
    """
    m = mask.to(x.dtype)
    if total is not None:
        return (x * m).sum() / total
    return (x * m).sum() / m.sum().clamp_min(1.0)


def _global_total(mask: Tensor) -> Tensor | None:
    """:func:`~rl_tformers.runtime.distributed.shard_mean_total` of ``mask.sum()``: the global
    count / W inside a DDP training forward (one all-reduce), None otherwise (one process:
    every mean divides by its own count, exactly as before)."""

    return shard_mean_total(mask.sum())


def bc_loss(model: GTrXLModel, batch: SegmentBatch, *, exit_scheme: str = "sampled",
            exit_tol: float = 0.1) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Behaviour cloning on the gradient window (``bc`` and ``rcbc``).

    Continuous: mean over real steps (``mask`` True) and action dims of (tanh mean - a)^2.
    Discrete: mean cross-entropy over real steps. With depth kind ``early_exit`` the actor is
    trained on every layer's output and the exit classifier on its oracle (:func:`exit_terms`).

    Args:
        model: a :class:`GTrXLModel`.
        batch: B rows of ``burn_in + T`` steps; the loss is on the last T (the gradient window).
        exit_scheme, exit_tol: ``agent.early_exit.scheme`` and ``.tol`` (early exit only).

    Returns:
        (scalar loss, metrics) with ``loss_bc``, mean gate values ``gate/layer{i}_{attn|ffn}`` and,
        for discrete actions, ``accuracy``; the metrics are detached 0-dim tensors (read on the host
        only when the trainer logs its window, not once per update).

    Under DDP (the trainer's :class:`~rl_tformers.runtime.distributed.AgentLoss`) the means over
    real steps divide by the global count / W (:func:`~rl_tformers.runtime.distributed.shard_mean_total`),
    so W processes train like one process on the same global batch (the per-rank metrics then
    average to the global-batch values). The backbone's auxiliary losses stay per-shard means.
    """
    early = model.encoder.early_exit
    out = encode_segment(model.encoder, batch, output_hidden_states=early)
    w = batch.window()
    pred = model.actor(out.features)  # (B, T, A): tanh mean or logits
    metrics: dict[str, Tensor | float] = {}
    total = _global_total(w.mask)  # None with one process
    if model.cfg.discrete:
        loss = _masked_mean(_token_loss(pred, w.actions, True), w.mask, total)
        metrics["accuracy"] = _masked_mean((pred.argmax(-1) == w.actions).float(), w.mask, total).detach()
    else:
        loss = _masked_mean(_token_loss(pred, w.actions, False), w.mask, total)
    aux = sum(out.aux.values()) if out.aux else 0.0
    metrics["loss_bc"] = loss.detach()
    if early:
        loss = exit_terms(model, out, w, metrics, scheme=exit_scheme, tol=exit_tol)
    metrics.update(gate_logs(out.metrics))
    metrics.update({f"aux/{k}": v.detach() for k, v in out.aux.items()})  # weighted, already in the loss
    metrics.update(memory_logs(out.metrics))
    return loss + aux, metrics


def _token_loss(pred: Tensor, actions: Tensor, discrete: bool) -> Tensor:
    """Per-step BC loss (B, T): cross-entropy of logits (B, T, A) at class indices (B, T), or the
    squared error of tanh means (B, T, A) averaged over A."""
    if discrete:
        return F.cross_entropy(pred.flatten(0, 1), actions.long().flatten(), reduction="none").view(actions.shape)
    return (pred - actions).pow(2).mean(-1)


def exit_terms(model: GTrXLModel, out: EncoderOutput, w: SegmentBatch, metrics: dict[str, Any], *,
               scheme: str, tol: float) -> Tensor:
    """Early-exit training of GTrXL (depth kind ``early_exit``): the actor on every layer, the exit classifier.

    As the Decision Transformer's (Elbayad et al. 2020, sec. 2.2, 3.3; CALM, Schuster et al.
    2022, sec. 4): the actor reads ``final_norm(h^n)`` after every layer n, the per-step losses
    (N, B, T) are combined by ``scheme`` (:func:`~rl_tformers.depth.early_exit.exit_loss`), and
    the exit classifier is trained on detached states against its oracle (agreement with the last
    layer: same argmax, or ``max |a^n - a^N| <= tol`` in normalised units). Logs
    ``exit/loss_layer{n}``, ``exit/agree_layer{n}`` and ``exit/classifier_loss`` into ``metrics``.

    Args:
        model: the GTrXL model; out: :func:`encode_segment` with ``output_hidden_states``;
        w: the gradient window (actions, mask (B, T)).

    Returns:
        0-d tensor: the combined action loss plus the classifier loss (replaces the BC loss).
    """
    bb = model.encoder.backbone
    discrete = model.cfg.discrete
    preds = [model.actor(bb.final_norm(h)) for h in out.hidden_states]  # N x (B, T, A)
    token_losses = torch.stack([_token_loss(p, w.actions, discrete) for p in preds])  # (N, B, T)
    loss = exit_loss(token_losses, w.mask, scheme=scheme)
    consistent = consistency_labels([p.detach() for p in preds], discrete, tol)  # (N, B, T)
    correct = None
    if bb.depth.cfg.oracle == "correctness":
        correct = torch.stack([(p.argmax(-1) == w.actions.long()) if discrete
                               else (p - w.actions).abs().amax(-1) <= tol for p in preds])
    clf = bb.depth.exit_classifier_loss(out.hidden_states, token_loss=token_losses.detach(), mask=w.mask,
                                        consistent=consistent, correct=correct)
    metrics["exit/classifier_loss"] = clf.detach()
    m = w.mask.float()
    for n in range(token_losses.shape[0]):
        metrics[f"exit/loss_layer{n + 1}"] = ((token_losses[n] * m).sum() / m.sum().clamp_min(1)).detach()
        metrics[f"exit/agree_layer{n + 1}"] = ((consistent[n].float() * m).sum() / m.sum().clamp_min(1)).detach()
    return loss + clf


def memory_logs(metrics: Mapping[str, Any]) -> dict[str, Tensor | float]:
    """Scalar backbone metrics of the memory and depth kinds (``memory/*``, ``knn/*``, ``act/*``,
    ``exit/*``, ``layer{i}/knn/gate``...) under ``backbone/``, detached 0-dim tensors as they come
    (no device synchronisation per update: the trainer averages them on the device) or floats;
    gate values are left to :func:`gate_logs`."""
    keys = ("memory/", "knn/", "act/", "exit/", "compressive/")
    out = {}
    for k, v in metrics.items():
        if any(t in k for t in keys) and (isinstance(v, (int, float)) or (isinstance(v, Tensor) and v.numel() == 1)):
            out[f"backbone/{k}"] = v.detach() if isinstance(v, Tensor) else float(v)
    return out


def expectile_loss(diff: Tensor, expectile: float) -> Tensor:
    """Asymmetric L2 of Kostrikov et al. 2021, eq. 5: |tau - 1(u < 0)| u^2, elementwise."""
    weight = torch.where(diff > 0, expectile, 1.0 - expectile)
    return weight * diff.pow(2)


@torch.no_grad()
def polyak_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """target <- (1 - tau) target + tau source, parameter by parameter (same structure); the
    buffers are copied (the attention's non-learned state: routing centroids, random features of
    Performer/RFA/LSH), so the target computes with the online critic's function, not with
    centroids that never move (its forward runs without gradients and never takes the EMA
    step) or features redrawn independently of the critic's."""
    with torch.no_grad():
        for pt, ps in zip(target.parameters(), source.parameters()):
            pt.lerp_(ps.detach(), tau)
        for bt, bs in zip(target.buffers(), source.buffers()):
            bt.copy_(bs)


def td_targets(w: SegmentBatch, v: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """One-step targets y_t = r_t + gamma (1 - d_t) V(s_{t+1}) for the pairs (t, t+1) of a window.

    Args:
        w: the gradient window (burn_in = 0), T steps.
        v: (B, T) V(s_t) (detached).
        gamma: discount.

    Returns:
        targets (B, T-1) and a bool mask (B, T-1) of usable pairs: step t is real and either
        terminal (target r_t) or followed by a real step of the same episode. A time-limit end,
        the last step of a window and padding give no target.
    """
    done = w.terminals[:, :-1]
    nxt_ok = w.mask[:, 1:] & ~w.episode_start[:, 1:]
    pair_ok = w.mask[:, :-1] & (done | nxt_ok)
    target = w.rewards[:, :-1] + gamma * ((~done) & nxt_ok).to(v.dtype) * v[:, 1:]
    return target, pair_ok


def _q_loss(model: GTrXLModel, hc: Tensor, w: Any, v: Tensor, gamma: float) -> Tensor:
    """IQL's Q loss: both Q heads (B, T) regressed on r_t + gamma V(s_{t+1}) over the usable
    (t, t + 1) pairs of window ``w`` (global means under DDP); ``v`` (B, T) detached values."""
    td_target, pair_ok = td_targets(w, v, gamma)  # (B, T-1) each
    q1, q2 = model.q(hc, w.actions)  # (B, T) each
    pair_total = _global_total(pair_ok)
    return 0.5 * (
        _masked_mean((q1[:, :-1] - td_target).pow(2), pair_ok, pair_total)
        + _masked_mean((q2[:, :-1] - td_target).pow(2), pair_ok, pair_total)
    )


def _actor_features(model: GTrXLModel, batch: SegmentBatch, critic: Any) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's (B, T, D) features and the auxiliary losses: the critic's encoder output
    ``critic`` when shared, else the actor encoder's (its losses under ``actor/``)."""
    if model.critic_encoder is None:
        return critic.features, critic.aux  # shared encoder
    actor_out = encode_segment(model.encoder, batch)
    return actor_out.features, {**critic.aux, **{f"actor/{k}": v for k, v in actor_out.aux.items()}}


@torch.no_grad()
def _target_q(target: nn.ModuleDict, batch: SegmentBatch, actions: Tensor) -> Tensor:
    """min(Q1, Q2) of the target network (IQL's clipped double Q, no gradient) at the window's
    ``actions``: (B, T)."""
    ht = encode_segment(target["encoder"], batch).features  # (B, T, D)
    tq1, tq2 = target["q"](ht, actions)
    return torch.minimum(tq1, tq2)  # (B, T)


def iql_loss(
    model: GTrXLModel,
    target: nn.ModuleDict,
    batch: SegmentBatch,
    *,
    gamma: float = 0.99,
    expectile: float = 0.7,
    beta: float = 3.0,
    max_weight: float = 100.0,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """IQL on GTrXL features (see the module docstring for the equations).

    Args:
        model: a :class:`GTrXLModel` built with ``critic="iql"``.
        target: :meth:`GTrXLModel.make_target` copy (``encoder``, ``q``), Polyak-updated by the caller.
        batch: rows of ``burn_in + T`` steps; rewards scaled as the agent stores them.
        gamma: discount.
        expectile: tau of the value expectile regression (0.5 = mean; IQL uses 0.7-0.9).
        beta: inverse temperature of the advantage weights.
        max_weight: clip of exp(beta * advantage) (100 in the paper's code).

    Returns:
        (L_V + L_Q + L_pi, metrics) with each term and mean V, Q, advantage.

    Under DDP the means over real steps (L_V, L_pi, the logged means) and over usable
    (t, t + 1) pairs (L_Q) divide by the global counts / W
    (:func:`~rl_tformers.runtime.distributed.shard_mean_total`, two all-reduces), so W processes
    train like one process on the same global batch. The backbone's auxiliary losses stay
    per-shard means.
    """
    w = batch.window()
    critic = encode_segment(model.critic_net, batch)
    hc = critic.features  # (B, T, D)
    q_target = _target_q(target, batch, w.actions)  # (B, T)
    v = model.state_value(hc)  # (B, T)
    adv = q_target - v
    total = _global_total(w.mask)  # None with one process
    v_loss = _masked_mean(expectile_loss(adv, expectile), w.mask, total)

    q_loss = _q_loss(model, hc, w, v.detach(), gamma)
    ha, aux = _actor_features(model, batch, critic)
    weight = torch.exp(beta * adv.detach()).clamp(max=max_weight)  # (B, T)
    logp = model.actor.log_prob(ha, w.actions)  # (B, T)
    pi_loss = _masked_mean(-weight * logp, w.mask, total)

    loss = v_loss + q_loss + pi_loss + (sum(aux.values()) if aux else 0.0)
    metrics = {
        "loss_value": v_loss.detach(),
        "loss_q": q_loss.detach(),
        "loss_actor": pi_loss.detach(),
        "iql/v_mean": _masked_mean(v.detach(), w.mask, total),
        "iql/q_mean": _masked_mean(q_target, w.mask, total).detach(),
        "iql/adv_mean": _masked_mean(adv.detach(), w.mask, total),
        "iql/weight_mean": _masked_mean(weight, w.mask, total).detach(),
        **gate_logs(critic.metrics),
    }
    return loss, metrics
