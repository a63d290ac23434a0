"""kNN-LM for the Decision Transformer: a datastore of (feature, next action) and the interpolated decision.

Khandelwal et al. 2020 with next actions: the key is the model's feature at the state token that
predicts a_t (``DTOutput.features``, what the head reads), computed on the context the policy
would hold at step t; the value is a_t in model units. Acting, the policy interpolates its
prediction with the neighbours' (:class:`~rl_tformers.agents.common.knn_memory.KNNPolicyMemory`):
in probability space for discrete actions, ``(1 - lam) a_model + lam sum_i w_i a_i`` for
continuous ones: :class:`KNNLMPolicy` wraps a DT policy and interpolates its decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.common.knn_memory import (
    ActionDatastore,
    KNNPolicyMemory,
    interpolate_continuous,
    interpolate_discrete,
)
from rl_tformers.agents.decision_transformer.context import DTState, acting_context_mask
from rl_tformers.agents.decision_transformer.model import DecisionTransformer
from rl_tformers.agents.decision_transformer.policy import Decision, DTPolicy, DTPolicyWrapper
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.samplers import WindowSampler
from torch import Tensor


class KNNLMPolicy(DTPolicyWrapper):
    """A DT policy whose actions are interpolated with their nearest neighbours in a datastore.

    The wrapped policy decides (the plain DT, or early exit under an
    :class:`~rl_tformers.agents.decision_transformer.early_exit.EarlyExitPolicy`); the feature its
    head read queries ``knn`` and the prediction is interpolated with the neighbours' actions
    (:func:`~rl_tformers.agents.common.knn_memory.interpolate_discrete` on the logits, then the
    argmax, for discrete actions; :func:`~rl_tformers.agents.common.knn_memory.interpolate_continuous`
    on the action, clamped to [-1, 1], for continuous ones) with weight ``knn.lam``.
    :meth:`stats` adds ``knn_hit_frac``: the fraction of counted decisions with a neighbour.

    Args:
        policy: the wrapped DT policy.
        knn: the memory whose datastore was built for that policy's features
            (:func:`build_datastore` with its acting context and exit threshold).
    """

    def __init__(self, policy: DTPolicy | DTPolicyWrapper, knn: KNNPolicyMemory) -> None:
        super().__init__(policy)
        self.knn = knn
        self.reset_own_stats()

    def decide(self, state: DTState, rows: Tensor, slot: Tensor, counted: np.ndarray) -> Decision:
        """The wrapped policy's decision, interpolated with the neighbours of its feature
        (arguments as :meth:`DTPolicy.decide`); the counted rows' hits go to :meth:`stats`."""
        d = self.inner.decide(state, rows, slot, counted)
        nb = self.knn.neighbours(d.features)
        self.hits += int(nb.valid.any(-1).cpu()[torch.as_tensor(counted)].sum())
        if self.base.cfg.discrete:
            a = interpolate_discrete(d.logits, nb, self.knn.lam, self.knn.temperature).argmax(-1)
        else:
            a = interpolate_continuous(d.action, nb, self.knn.lam, self.knn.temperature).clamp(-1.0, 1.0)
        self.decisions += int(counted.sum())
        return d._replace(action=a)

    def own_stats(self) -> dict[str, Any]:
        """``knn_hit_frac`` once a decision was counted."""
        return {"knn_hit_frac": self.hits / self.decisions} if self.decisions else {}

    def reset_own_stats(self) -> None:
        """Zero the decisions and their hits."""
        self.decisions = 0
        self.hits = 0


def datastore_steps(data: EpisodeDataset, max_entries: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(episode, step) of the datastore's entries: every step of ``data``, or a seeded uniform
    subset of ``max_entries`` of them (in dataset order). Returns two (N,) int64 arrays."""
    lengths = np.asarray(data.lengths, dtype=np.int64)
    ep = np.repeat(np.arange(data.num_episodes), lengths)  # (N,) episode of every step
    t = np.concatenate([np.arange(n) for n in lengths])  # (N,) step inside its episode
    if max_entries < ep.shape[0]:
        keep = np.sort(np.random.default_rng(seed).choice(ep.shape[0], max_entries, replace=False))
        ep, t = ep[keep], t[keep]
    return ep, t


def acting_windows(data: EpisodeDataset, sampler: WindowSampler, ep: np.ndarray, t: np.ndarray, k: int,
                   align: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The windows the policy holds when it decides step ``t`` of episode ``ep`` (W,) each.

    ``align`` start: steps ``max(0, t-K+1) .. t`` from slot 0; end: left-padded, ending at slot
    K-1. Returns the sampler's window arrays (the training sampler's units: observation
    statistics, return-to-go / reward scale) and the (W,) slot of step t.
    """
    slots = np.arange(k)[None, :]  # (1, K)
    if align == "start":
        first = np.maximum(t - k + 1, 0)  # (W,) step at slot 0
        slot = t - first  # (W,) slot of step t
        local = first[:, None] + slots  # (W, K)
        m = slots <= slot[:, None]
    else:
        slot = np.full(t.shape, k - 1)
        local = t[:, None] - (k - 1) + slots  # (W, K), negative = padding on the left
        m = local >= 0
    local = np.where(m, local, 0)
    flat = np.asarray(data.starts)[ep][:, None] + local  # (W, K) dataset rows
    return sampler._gather(flat, m, local), slot


@torch.no_grad()
def build_datastore(
    model: DecisionTransformer, data: EpisodeDataset, sampler: WindowSampler,
    to_batch: Callable[[Mapping[str, Tensor]], dict[str, Tensor]], *, align: str, context_steps: int | None,
    exit_threshold: float | None, max_entries: int, metric: str, seed: int = 0, batch_windows: int = 256,
) -> ActionDatastore:
    """The kNN-LM datastore of ``data``: key = the feature the head reads when acting at step t,
    value = a_t in model units (normalised to [-1, 1] when continuous), group = the episode.

    Args:
        model: the DT (left in the training mode it had).
        data, sampler: the training dataset and its window sampler.
        to_batch: sampler arrays (as tensors on the model's device) -> model-unit batch.
        align: the sampler's window alignment (:func:`acting_windows`).
        context_steps: the acting context (``agent.eval_context_len``; None: K).
        exit_threshold: with depth kind ``early_exit``, the threshold the policy acts with (the key
            is then the exited layer's feature).
        max_entries, seed: at most this many steps (:func:`datastore_steps`).
        metric: the datastore's distance.
        batch_windows: windows per forward pass.
    """
    ep, t = datastore_steps(data, max_entries, seed)
    dev = next(model.parameters()).device
    k = model.cfg.context_len
    was = model.training
    model.eval()
    keys, acts = [], []
    for s in range(0, ep.shape[0], batch_windows):
        raw, slot = acting_windows(data, sampler, ep[s : s + batch_windows], t[s : s + batch_windows], k, align)
        batch = to_batch({n: torch.as_tensor(v, device=dev) for n, v in raw.items()})
        rows = torch.arange(len(slot), device=dev)
        sl = torch.as_tensor(slot, device=dev)
        # exactly the policy's forward pass at step t (DTPolicy.act): the context it reads
        # (agent.eval_context_len) and, with early exit, the threshold it acts with, so that a
        # key is the feature the head reads when acting (the exited layer's, when it exits)
        mask = acting_context_mask(batch["mask"], sl, context_steps)
        args = (batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], mask)
        if model.early_exit:
            decide = torch.zeros_like(mask)
            decide[rows, sl] = True
            out = model.forward_early_exit(*args, exit_steps=decide, exit_threshold=exit_threshold)
        else:
            out = model(*args)
        keys.append(out.features[:, -1] if model.cfg.mode == "last_action" else out.features[rows, sl])
        acts.append(batch["actions"][rows, sl])
    model.train(was)
    return ActionDatastore(torch.cat(keys), torch.cat(acts), torch.as_tensor(ep), metric=metric)

