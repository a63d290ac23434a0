"""The PPO update of PPO-GTrXL: advantages, the clipped-surrogate loss and the minibatch epochs.

Given a rollout (:mod:`rl_tformers.agents.gtrxl.rollout`), :func:`compute_gae` gives the
advantages and returns (Schulman et al. 2016), :func:`minibatches` splits the S x N samples into
``n_epochs`` passes of ``n_minibatches`` random minibatches, and :func:`ppo_loss` is the loss of
one minibatch (Schulman et al. 2017, eq. 9), each sample recomputed as one query over the backbone
memory it acted with.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rl_tformers.agents.gtrxl.model import EncoderOutput, GTrXLEncoder, GTrXLModel, gate_logs
from torch import Tensor

from rl_tformers.memory.compressive import CompressiveMemory
from rl_tformers.memory.spalm import SpalmStore
from rl_tformers.runtime.distributed import is_active, shard_mean_total
from rl_tformers.types import BackboneState, LayerState

#: rollout keys of the SPALM long-term store each step acted with (memory kind ``spalm``), each
#: (S, N, K, ...): :class:`~rl_tformers.memory.spalm.SpalmStore`'s fields with this prefix
STORE_KEYS = ("ltm_keys", "ltm_inputs", "ltm_pos", "ltm_valid", "ltm_seg")
#: the rollout key of the uint8 pixel observations (N, C, H, W) per step, kept when the model's
#: observation encoder takes images: ``x`` then holds the other inputs only (a_{t-1}, r_{t-1}), and
#: each update encodes the pixels again with the weights it trains (:func:`ppo_loss`)
PIXEL_KEY = "obs"


def compute_gae(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16).

    Args:
        rewards: (S, N) reward of step t (truncation bootstraps already added).
        values: (S, N) V(s_t) at collection.
        dones: (S, N) bool, the episode ended after step t (s_{t+1} starts a new one).
        last_value: (N,) V(s_S) of the observation after the rollout.
        gamma, lam: discount and GAE lambda.

    Returns:
        advantages (S, N) and returns = advantages + values (S, N).
    """
    s = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(last_value)
    nonterm = (~dones).to(rewards.dtype)
    for t in reversed(range(s)):  # the recursion over rollout steps is inherent
        next_v = last_value if t == s - 1 else values[t + 1]
        delta = rewards[t] + gamma * next_v * nonterm[t] - values[t]
        last = delta + gamma * lam * nonterm[t] * last
        adv[t] = last
    return adv, adv + values


def store_rows(state: BackboneState) -> dict[str, Tensor]:
    """The SPALM long-term store a state holds (last layer's ``extra``) as :data:`STORE_KEYS`
    tensors, (N, K, ...) each; ``{}`` for a state without one (memory kind ``xl``)."""
    store = state.layers[-1].extra
    if not isinstance(store, SpalmStore):
        return {}
    return {"ltm_keys": store.keys, "ltm_inputs": store.inputs, "ltm_pos": store.pos, "ltm_valid": store.valid,
            "ltm_seg": store.seg}


def compressive_layout(enc: GTrXLEncoder) -> tuple[int, int] | None:
    """``(m_cm, full)`` of a compressive memory: its compressed slots, which come first, and the
    most slots it holds (``m_cm + m_m + c - 1``: its FIFO grows to that in a stream's first
    steps); None for the memory kinds whose width never changes (xl, spalm)."""
    mem = enc.backbone.memory
    if not isinstance(mem, CompressiveMemory):
        return None
    return mem.m_cm, mem.m_cm + mem.m_m + mem.rate - 1


def pad_memory(enc: GTrXLEncoder, state: BackboneState) -> BackboneState:
    """``state`` at the memory's full width (:func:`compressive_layout`): invalid slots (zeros, step 0,
    episode -1) inserted after the compressed ones, so every rollout step's memory stacks; a rollout
    step acts over it at that width (:func:`~rl_tformers.agents.gtrxl.rollout.encode_step`), so its
    recomputation gives what it acted with, up to float rounding, with any attention kind.
    Memory kinds of fixed width come back as they are.

    Shapes: per layer ``memory`` (B, P, D) -> (B, full, D); ``pos``, ``valid``, ``seg`` (B, P) ->
    (B, full); ``episode``, ``next_pos`` (B,) unchanged. Source: the ``[compressed; FIFO]`` layout
    of Rae et al. 2019 (:mod:`rl_tformers.memory.compressive`)."""
    layout = compressive_layout(enc)
    k = 0 if layout is None else layout[1] - state.pos.shape[1]
    if k == 0:
        return state
    split = layout[0]

    def ins(t: Tensor, fill: float | int | bool) -> Tensor:
        return torch.cat([t[:, :split], t.new_full((t.shape[0], k, *t.shape[2:]), fill), t[:, split:]], 1)

    return BackboneState(layers=[LayerState(memory=ins(ls.memory, 0), cache=ls.cache, extra=ls.extra)
                                 for ls in state.layers],
                         pos=ins(state.pos, 0), valid=ins(state.valid, False), seg=ins(state.seg, -1),
                         episode=state.episode, next_pos=state.next_pos, key_offset=state.key_offset)


def unpad_memory(enc: GTrXLEncoder, state: BackboneState, slots: int) -> BackboneState:
    """Inverse of :func:`pad_memory` for a memory that held ``slots`` slots: the inserted ones
    removed, bit for bit ((B, full, ...) -> (B, slots, ...)); a ``slots`` outside [m_cm, full]
    is the caller's to refuse (the checkpoint check does)."""
    layout = compressive_layout(enc)
    k = 0 if layout is None else layout[1] - slots
    if k == 0:
        return state
    split = layout[0]

    def cut(t: Tensor) -> Tensor:
        return torch.cat([t[:, :split], t[:, split + k:]], 1)

    return BackboneState(layers=[LayerState(memory=cut(ls.memory), cache=ls.cache, extra=ls.extra)
                                 for ls in state.layers],
                         pos=cut(state.pos), valid=cut(state.valid), seg=cut(state.seg),
                         episode=state.episode, next_pos=state.next_pos, key_offset=state.key_offset)


def state_from_rows(mem: Tensor, pos: Tensor, valid: Tensor, seg: Tensor, episode: Tensor, next_pos: Tensor,
                    store: Mapping[str, Tensor] | None = None) -> BackboneState:
    """Rebuild a :class:`BackboneState` from stored per-sample tensors.

    Args:
        mem: (B, L, M, D) per-layer memory; pos, valid, seg: (B, M); episode, next_pos: (B,).
        store: the SPALM store's :data:`STORE_KEYS` tensors ((B, K, D) keys and inputs, (B, K)
            bookkeeping), put in the last layer's ``extra``; None or empty: no store.
    """
    layers = [LayerState(memory=m) for m in mem.unbind(1)]
    if store:
        layers[-1].extra = SpalmStore(keys=store["ltm_keys"], inputs=store["ltm_inputs"], pos=store["ltm_pos"],
                                      valid=store["ltm_valid"], seg=store["ltm_seg"])
    return BackboneState(layers=layers, pos=pos, valid=valid, seg=seg, episode=episode, next_pos=next_pos)


def normalize_advantages(adv: Tensor, eps: float = 1e-8) -> Tensor:
    """Advantage normalisation of a minibatch: (adv - mean) / (std + eps), (B,) -> (B,).

    ``std`` is the unbiased sample standard deviation (``Tensor.std``, as CleanRL's PPO). With
    one process (or outside a DDP training forward) the statistics are this minibatch's, exactly
    as ``(adv - adv.mean()) / (adv.std() + eps)``; a minibatch of one row is returned unchanged
    (a run's ``agent.norm_adv`` with such minibatches is refused: :func:`check_ppo_options`).
    Inside a DDP training forward (the trainer's
    :class:`~rl_tformers.runtime.distributed.AgentLoss`, where every rank holds a shard of the
    global minibatch) the mean and standard deviation are those of the global minibatch, every
    rank's rows (float64 sums over the ranks: :func:`~rl_tformers.runtime.distributed.shard_mean_total`
    for the count, then two all-reduces, every rank in step), so each rank normalises its rows
    exactly as one process normalises the whole minibatch.
    """
    # N / W inside a DDP training forward; None otherwise (no process group: no tensor made at all)
    total = shard_mean_total(adv.new_tensor(float(adv.numel()))) if is_active() else None
    if total is None:
        if adv.numel() <= 1:
            return adv
        return (adv - adv.mean()) / (adv.std() + eps)
    n = round(float(total) * dist.get_world_size())  # N: rows of the global minibatch
    moments = adv.detach().to(torch.float64).sum().reshape(1)
    dist.all_reduce(moments, op=dist.ReduceOp.SUM)
    mean = moments / max(n, 1)
    sq = (adv.detach().to(torch.float64) - mean).pow(2).sum().reshape(1)
    dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    if n <= 1:
        return adv
    std = (sq / (n - 1)).sqrt()
    return (adv - mean.to(adv.dtype)) / (std.to(adv.dtype) + eps)


def minibatch_inputs(enc: GTrXLEncoder, mb: Mapping[str, Tensor]) -> Tensor:
    """The step inputs (B, input_dim) of a minibatch: ``mb["x"]``, or, when the rollout kept the
    uint8 pixels (:data:`PIXEL_KEY`, (B, C, H, W)), their features (encoded now, with the weights
    being trained) before ``mb["x"]`` (B, E), the inputs besides them."""
    x = mb["x"]
    if PIXEL_KEY not in mb:
        return x
    feat = enc.encode_obs(mb[PIXEL_KEY])  # (B, F)
    return torch.cat([feat, x.to(feat.dtype)], dim=-1)  # (B, F + E)


def minibatch_features(enc: GTrXLEncoder, mb: Mapping[str, Tensor]) -> tuple[Tensor, EncoderOutput]:
    """Each sample of a minibatch recomputed as its rollout step acted: one query over the stored
    memory (:func:`state_from_rows`), or, in the plain-window mode, its stored window re-encoded
    (the step in its last slot). Returns the (B, D) features and the encoder's output."""
    if not enc.stateful:
        out = enc.encode_window(mb)
        return out.features[:, -1], out
    state = state_from_rows(mb["mem"], mb["mem_pos"], mb["mem_valid"], mb["mem_seg"], mb["episode"], mb["pos"],
                            {k: mb[k] for k in STORE_KEYS if k in mb})
    out = enc(minibatch_inputs(enc, mb)[:, None], mb["pos"][:, None], state=state)
    return out.features[:, 0], out


def ppo_loss(
    model: GTrXLModel,
    mb: Mapping[str, Tensor],
    *,
    clip_coef: float,
    ent_coef: float,
    vf_coef: float,
    norm_adv: bool,
    critic_only: bool = False,
) -> tuple[Tensor, dict[str, Tensor | float]]:
    """Clipped-surrogate PPO loss on a minibatch of single steps, each with its stored memory (or window).

    Args:
        model: :class:`GTrXLModel` with ``critic="value"``.
        mb: ``x (B, input_dim)``, ``pos (B,)``, ``mem (B, L, M, D)``, ``mem_pos/mem_valid/mem_seg
            (B, M)``, ``episode (B,)``, ``actions (B, A) or (B,)``, ``logp (B,)``, ``adv (B,)``,
            ``returns (B,)``; with memory kind ``spalm`` also the long-term store each step acted
            with (:data:`STORE_KEYS`); with an image encoder the pixels (:func:`minibatch_inputs`).
            In the plain-window mode (``agent.window`` W) ``window_x (B, W, input_dim)``,
            ``window_pos, window_valid (B, W)`` instead of the memory: each sample is its window
            re-encoded, the step in slot W - 1.
        critic_only: train only the value head, on detached features (the critic warm-up of
            fine-tuning: encoder and actor keep their offline weights).

    Returns:
        (loss, logs): L = L_clip - ent_coef * H + vf_coef * 0.5 (V - R)^2 (Schulman et al. 2017,
        eq. 9); with ``critic_only``, vf_coef * 0.5 (V - R)^2. With ``norm_adv`` the advantages
        are normalised first (:func:`normalize_advantages`).

    Under DDP each rank holds an equal-sized shard of the global minibatch: every term is a mean
    over the shard (so DDP's gradient average is the mean over the global minibatch) and the
    advantages are normalised with the global minibatch's statistics, so W processes compute
    the gradient one process computes on the whole minibatch.
    """
    h, out = minibatch_features(model.encoder, mb)
    logp = model.actor.log_prob(h, mb["actions"])
    entropy = model.actor.entropy(h).mean()
    value = model.state_value(h.detach() if critic_only else h)
    log_ratio = logp - mb["logp"]
    ratio = log_ratio.exp()
    adv = mb["adv"]
    if norm_adv:
        adv = normalize_advantages(adv)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_coef, 1.0 + clip_coef)).mean()
    v_loss = 0.5 * (value - mb["returns"]).pow(2).mean()
    if critic_only:
        loss = vf_coef * v_loss
    else:
        loss = pg - ent_coef * entropy + vf_coef * v_loss + sum(out.aux.values(), torch.zeros((), device=h.device))
    with torch.no_grad():
        logs = {
            "loss_policy": pg.detach(),
            "loss_value": v_loss.detach(),
            "entropy": entropy.detach(),
            "approx_kl": ((ratio - 1) - log_ratio).mean().detach(),
            "clipfrac": ((ratio - 1.0).abs() > clip_coef).float().mean(),
        }
        logs.update(gate_logs(out.metrics))
    return loss, logs


def minibatches(ro: Mapping[str, Any], *, seed: int, rollout: int, n_epochs: int, n_minibatches: int,
                critic_only: bool, device: torch.device, skip: int = 0) -> Iterator[dict[str, Any]]:
    """``n_epochs`` passes over a rollout's S x N samples in ``n_minibatches`` random minibatches.

    Args:
        ro: the rollout: (S, N, ...) tensors and ``stats`` (floats for logging).
        seed, rollout: the permutation of epoch e is drawn from ``default_rng([seed, rollout, e])``
            (a pure function of the rollout's number), so ``skip`` (the first minibatches, already
            trained on before a resume) leaves the rest unchanged.
        n_epochs, n_minibatches: passes and minibatches per pass (``np.array_split`` sizes).
        critic_only: set on every minibatch (the critic warm-up of fine-tuning: :func:`ppo_loss`).
        device: where the row indices are made.
        skip: minibatches to leave out at the start.

    Yields:
        dict of (B, ...) tensors (the rollout's rows of the minibatch), ``stats`` and ``critic_only``.
    """
    flat = {k: v.flatten(0, 1) for k, v in ro.items() if isinstance(v, Tensor)}  # (S * N, ...)
    total = next(iter(flat.values())).shape[0]
    served = 0
    for epoch in range(n_epochs):
        perm = np.random.default_rng([seed, rollout, epoch]).permutation(total)
        for idx in np.array_split(perm, n_minibatches):
            served += 1
            if served <= skip:
                continue
            ix = torch.as_tensor(idx, device=device)
            mb = {k: v[ix] for k, v in flat.items()}
            mb["stats"] = ro["stats"]
            mb["critic_only"] = critic_only
            yield mb
