"""kNN-LM for GTrXL policies: a datastore of (feature, next action) and the interpolated decision.

Khandelwal et al. 2020 with next actions, as for the Decision Transformer
(:mod:`~rl_tformers.agents.decision_transformer.knn_lm`): the key of dataset step t is the feature
GTrXL's actor reads when the policy acts at step t, computed as it acts (one token per step over
the memory from the episode's start, with the early-exit threshold in use:
:func:`~rl_tformers.agents.gtrxl.replay.replay_features`); the value is a_t in model units (a
class index, or the action normalised to [-1, 1]). Acting, :class:`KNNLMPolicy` interpolates the
actor's prediction with the neighbours' actions (:class:`~rl_tformers.agents.common.knn_memory.KNNPolicyMemory`).
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
from rl_tformers.agents.decision_transformer.knn_lm import datastore_steps
from rl_tformers.agents.gtrxl.loss import SegmentBatch
from rl_tformers.agents.gtrxl.model import GTrXLModel
from rl_tformers.agents.gtrxl.replay import GTrXLPolicyWrapper, episode_batch, replay_features
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.samplers import SegmentSampler
from torch import Tensor
from torch.distributions import Categorical


class KNNLMPolicy(GTrXLPolicyWrapper):
    """A GTrXL policy whose actions are interpolated with their nearest neighbours in a datastore.

    The wrapped policy decides (the plain policy, or early exit under an
    :class:`~rl_tformers.agents.gtrxl.early_exit.EarlyExitPolicy`); the feature its actor read
    queries ``knn``, and the prediction is interpolated with weight ``knn.lam``: discrete actions
    in probability space (``log(lam p_kNN + (1 - lam) p_model)``,
    :func:`~rl_tformers.agents.common.knn_memory.interpolate_discrete`), then its argmax, or a
    draw from it when the policy samples; continuous actions as ``(1 - lam) a + lam sum_i w_i a_i``
    on the tanh mean (:func:`~rl_tformers.agents.common.knn_memory.interpolate_continuous`),
    clamped to [-1, 1]. :meth:`stats` adds ``knn_hit_frac``: the fraction of counted decisions with
    a neighbour.

    Args:
        policy: the wrapped GTrXL policy.
        knn: the memory whose datastore was built for that policy's features (:func:`build_datastore`).

    Raises:
        ValueError: a continuous-action policy that samples (the interpolation gives the mean of
            the mixture, not a draw: use the deterministic policy).
    """

    def __init__(self, policy: Any, knn: KNNPolicyMemory) -> None:
        if not policy.base.discrete and not policy.base.deterministic:
            raise ValueError("gtrxl: the kNN-LM memory gives continuous actions as the mean of the interpolated "
                             "mixture, not a draw; evaluate the deterministic policy (agent.deterministic=true)")
        super().__init__(policy)
        self.knn = knn
        self.reset_own_stats()

    def decide(self, x: Tensor, t: Tensor, memory: Any, start: Tensor, state: Any) -> Any:
        """The wrapped policy's decision, interpolated with the neighbours of its feature."""
        d = self.inner.decide(x, t, memory, start, state)
        counted = self.counted(x.shape[0])
        nb = self.knn.neighbours(d.features)
        self.hits += int(nb.valid.any(-1).cpu()[torch.as_tensor(counted)].sum())
        self.decisions += int(counted.sum())
        if self.base.discrete:
            logp = interpolate_discrete(d.out, nb, self.knn.lam, self.knn.temperature)
            a = logp.argmax(-1) if self.base.deterministic else Categorical(logits=logp).sample()
        else:
            a = interpolate_continuous(d.out, nb, self.knn.lam, self.knn.temperature).clamp(-1.0, 1.0)
        return d._replace(action=a.to(d.action.device))

    def own_stats(self) -> dict[str, Any]:
        """``knn_hit_frac`` once a decision was counted."""
        return {"knn_hit_frac": self.hits / self.decisions} if self.decisions else {}

    def reset_own_stats(self) -> None:
        """Zero the decisions and their hits."""
        self.decisions = 0
        self.hits = 0


@torch.no_grad()
def build_datastore(
    model: GTrXLModel, data: EpisodeDataset, sampler: SegmentSampler,
    to_segments: Callable[[Mapping[str, Tensor]], SegmentBatch], *, exit_threshold: float | None,
    max_entries: int, metric: str, seed: int = 0, batch_episodes: int = 256,
) -> ActionDatastore:
    """The kNN-LM datastore of ``data``: key = the feature the actor reads when the policy acts at
    step t (N, D), value = a_t in model units, group = the episode.

    Args:
        model: the GTrXL model (memory mode; left in the training mode it had).
        data, sampler: the training dataset and a segment sampler over it with the training
            units (observation statistics, reward scale).
        to_segments: :func:`episode_batch` arrays (as tensors on the model's device) -> a
            :class:`SegmentBatch` without burn-in.
        exit_threshold: with depth kind ``early_exit``, the threshold the policy acts with (None:
            the full model).
        max_entries, seed: at most this many steps, a seeded uniform subset
            (:func:`~rl_tformers.agents.decision_transformer.knn_lm.datastore_steps`).
        metric: the datastore's distance; batch_episodes: episodes replayed together.

    Raises:
        ValueError: the model runs a plain window (``agent.window``).
    """
    ep, t = datastore_steps(data, max_entries, seed)
    dev = next(model.parameters()).device
    early = model.encoder.early_exit and exit_threshold is not None
    wanted = np.unique(ep)
    keys, acts, groups = [], [], []
    for s in range(0, wanted.shape[0], batch_episodes):
        eps = wanted[s : s + batch_episodes]
        raw = episode_batch(sampler, eps)
        seg = to_segments({k: torch.as_tensor(v, device=dev) for k, v in raw.items()})
        h, _ = replay_features(model, seg, exit_threshold, early_exit=early)  # (E, L, D)
        sel = np.isin(ep, eps)
        row = torch.as_tensor(np.searchsorted(eps, ep[sel]), device=dev)
        step = torch.as_tensor(t[sel], device=dev)
        keys.append(h[row, step])
        acts.append(seg.actions[row, step])
        groups.append(torch.as_tensor(ep[sel]))
    # ep is in dataset order and the batches hold ascending episodes: the entries stay in dataset order
    return ActionDatastore(torch.cat(keys).cpu(), torch.cat(acts).cpu(), torch.cat(groups), metric=metric)
