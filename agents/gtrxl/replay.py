"""GTrXL's acting computation replayed on dataset steps: the base of the policy wrappers, batches of
whole episodes, and the features the policy computes at every step of a batch.

Early-exit calibration (:mod:`~rl_tformers.agents.gtrxl.early_exit`) and the kNN-LM datastore
(:mod:`~rl_tformers.agents.gtrxl.knn_lm`) both need what :class:`~rl_tformers.agents.gtrxl.agent.GTrXLPolicy`
computes when it acts on recorded steps: one token per step over the memory, rows reset at their
episode starts, with the exit threshold in use (an exited step's state fills the memory of the
layers above it, so later steps depend on the threshold): :func:`replay_features`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.common.policy import PolicyWrapper
from rl_tformers.agents.gtrxl.loss import SegmentBatch
from rl_tformers.agents.gtrxl.model import GTrXLModel
from rl_tformers.envs.samplers import SegmentSampler
from torch import Tensor

from rl_tformers.depth.early_exit import with_final_norm


class GTrXLPolicyWrapper(PolicyWrapper):
    """A :class:`~rl_tformers.agents.gtrxl.agent.GTrXLPolicy` (or another wrapper) whose next action
    is produced differently.

    :meth:`act` runs the plain policy's ``step`` (resets, inputs, action mapping) with this
    wrapper's :meth:`decide`; every other member of the policy protocol (``initial_state``,
    ``count_rows``, ``check_targets``, ...) is the wrapped policy's
    (:class:`~rl_tformers.agents.common.policy.PolicyWrapper`). Subclasses implement
    :meth:`decide`, ``own_stats`` and ``reset_own_stats``.

    Args:
        policy: the wrapped policy (:attr:`inner`).
    """

    @torch.no_grad()
    def act(self, obs: np.ndarray, state: Any, episode_start: np.ndarray,
            last_reward: np.ndarray | None = None) -> tuple[np.ndarray, Any]:
        """As ``GTrXLPolicy.act``, each action produced by :meth:`decide`."""
        return self.base.step(obs, state, episode_start, last_reward, self.decide)

    @abstractmethod
    def decide(self, x: Tensor, t: Tensor, memory: Any, start: Tensor, state: Any) -> Any:
        """The decision of this step (arguments as ``GTrXLPolicy.decide``)."""

    def counted(self, n: int) -> np.ndarray:
        """(n,) bool: the rows whose decisions count (``count_rows``; all when not set)."""
        c = self.base.counted
        return np.ones(n, dtype=bool) if c is None else c


def exit_kwargs(model: GTrXLModel, threshold: float | None, deciding: Tensor) -> dict[str, Any]:
    """The depth keywords of an early-exit step: the threshold (``None``: the backbone's stored
    one), the actor as exit head (``softmax`` confidence) and ``deciding`` (B, T) bool: the
    tokens whose exit is decided (the others run every layer unless all deciding ones exited)."""
    bb = model.encoder.backbone
    kw: dict[str, Any] = {"exit_head": with_final_norm(bb, model.actor), "exit_mask": deciding}
    if threshold is not None:
        kw["exit_threshold"] = float(threshold)
    return kw


def episode_batch(sampler: SegmentSampler, episodes: np.ndarray) -> dict[str, np.ndarray]:
    """Whole episodes from their first step, in the sampler's layout and units.

    Row i holds episode ``episodes[i]`` from step 0, after one leading slot (the sampler's extra
    step for a_{t-1}, r_{t-1}; masked), padded to the longest episode of the batch.

    Returns:
        The sampler's arrays (``observations``, ``actions``, ``rewards``, ``returns_to_go``,
        ``timesteps``, ``mask``, ``episode_start``, ``terminations``, ``truncations``,
        ``loss_mask``, ``episode``), each (B, 1 + longest, ...).
    """
    d = sampler.dataset
    lengths = np.asarray(d.lengths)[episodes]
    slots = np.arange(1 + int(lengths.max()))[None, :]  # (1, L + 1)
    t = slots - 1  # (1, L + 1) step inside the episode
    mask = (t >= 0) & (t < lengths[:, None])  # (B, L + 1)
    flat = np.clip(np.asarray(d.starts)[episodes][:, None] + t, 0, d.num_steps - 1)  # (B, L + 1)
    steps = np.broadcast_to(np.clip(t, 0, None), mask.shape)
    out = sampler._gather(flat, mask, steps)
    out["episode_start"] = (steps == 0) & mask
    out["terminations"] = d.terminations[flat] & mask
    out["truncations"] = d.truncations[flat] & mask
    out["loss_mask"] = mask.copy()
    out["episode"] = np.where(mask, episodes[:, None], -1).astype(np.int64)
    return out


@torch.no_grad()
def replay_features(model: GTrXLModel, seg: SegmentBatch, threshold: float | None = None,
                    early_exit: bool = False) -> tuple[Tensor, Tensor]:
    """The features and actor outputs the policy computes at every step of ``seg``, acting one
    step at a time (memory mode) as :meth:`GTrXLPolicy.act` does.

    Each step resets the rows whose episode starts, then runs one token per row over the memory
    (with ``early_exit``: at ``threshold``, every real step deciding). Padding (``mask`` False)
    only ever ends a row (episode and dataset ends), so its features are computed and never read.

    Args:
        model: the GTrXL model (memory mode; left in the training mode it had).
        seg: B rows of L steps (``burn_in`` ignored: every step is replayed).
        threshold: the exit threshold (``None``: the backbone's stored one).
        early_exit: act with early exit (depth kind ``early_exit``).

    Returns:
        (features (B, L, D), actor outputs (B, L, A): logits or tanh means).

    Raises:
        ValueError: the model runs a plain window (``agent.window``), which this replay does not follow.
    """
    h, _ = replay(model, seg, threshold, early_exit)
    return h, model.actor(h)


@torch.no_grad()
def replay(model: GTrXLModel, seg: SegmentBatch, threshold: float | None = None,
           early_exit: bool = False) -> tuple[Tensor, Any]:
    """:func:`replay_features`' loop: the features (B, L, D) and the memory after the last step."""
    enc = model.encoder
    if not enc.stateful:
        raise ValueError("replaying acting step by step needs GTrXL's memory mode (agent.window=0)")
    was = model.training
    model.eval()
    x = enc.inputs(seg.obs, seg.rtg, seg.prev_action, seg.prev_reward)  # (B, L, input_dim)
    b, n = x.shape[:2]
    state = enc.initial_state(b, x.device)
    feats = []
    for i in range(n):
        real = seg.mask[:, i]  # (B,)
        state = enc.reset_state(state, seg.episode_start[:, i] & real)
        kw = exit_kwargs(model, threshold, real[:, None]) if early_exit else {}
        out = enc(x[:, i : i + 1], seg.timesteps[:, i : i + 1], state=state, **kw)
        state = out.state
        feats.append(out.features[:, 0])
    model.train(was)
    return torch.stack(feats, 1), state  # (B, L, D)

