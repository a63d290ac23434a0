"""GTrXL agent: offline training (BC, return-conditioned BC, IQL) and step-wise acting.

``rl-tformers train --config gtrxl/<name>`` builds :class:`GTrXLAgent` (``agent.kind=gtrxl``)
and the shared trainer drives it. Pieces, in reading order:

- :func:`segment_batch`: the data layer's :class:`~rl_tformers.envs.samplers.SegmentSampler`
  batch (runs of consecutive dataset steps with ``episode_start`` flags, crossing episode
  boundaries) turned into a :class:`~rl_tformers.agents.gtrxl.loss.SegmentBatch` in model units:
  actions in [-1, 1], a_{t-1} / r_{t-1} inputs. The sampler is asked for one extra leading
  step so that the previous action and reward of every step are exact; that step is dropped.
- :class:`GTrXLState` and :class:`GTrXLPolicy`: the recurrent inference API of
  :class:`~rl_tformers.agents.common.policy.Policy`. One call = one token per environment
  through the backbone with its memory (O(M) per step); rows whose episode starts are reset
  first, other rows are untouched.
  Return-conditioned policies refuse target returns the float32 token embedding cannot take
  (:meth:`GTrXLPolicy.target_limit`, mirroring the Decision Transformer's
  :meth:`~rl_tformers.agents.decision_transformer.policy.DTPolicy.target_limit`).
- :class:`GTrXLAgent`: the :class:`~rl_tformers.runtime.agent_registry.Trainable`: builds the model
  from the run config and the dataset, computes the objective's loss on each batch, keeps
  IQL's target network (Polyak update at the start of each ``loss`` call, i.e. after the
  previous optimiser step), evaluates in gymnasium vector environments, and checkpoints what a
  policy needs (normalisation statistics, scales, action bounds) as ``extra_state``.

Datasets (``dataset:`` section): ``path`` (a Minari id/folder or a D4RL-layout HDF5 file,
loaded by :func:`rl_tformers.envs.loaders.load_dataset`), or ``scripted`` (``{task: recall |
cartpole, episodes, epsilon, seed, delay}``) for the memory tasks of
:mod:`rl_tformers.envs.memory_tasks`, built in memory from a scripted behaviour policy.
The evaluation environment is the dataset's ``env_id``, masked like its ``pomdp`` record, or
``agent.env_id`` when given.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import rl_tformers.envs.memory_tasks  # noqa: F401  (registers the memory tasks with gymnasium)
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from rl_tformers.agents.common.encoders import check_observations, observation_layout
from rl_tformers.agents.common.offline import (
    DatasetInfo,
    data_differences,
    flattens_observations,
    load_offline_dataset,
)
from rl_tformers.agents.common.policy import check_return_targets, embedding_target_limit
from rl_tformers.agents.decision_transformer.model import from_env_action, to_env_action
from rl_tformers.agents.gtrxl.config import GTrXLAgentConfig
from rl_tformers.agents.gtrxl.inference import GTrXLInference
from rl_tformers.agents.gtrxl.loss import SegmentBatch, bc_loss, iql_loss, polyak_update
from rl_tformers.agents.gtrxl.model import (
    GTrXLConfig,
    GTrXLModel,
    check_causal,
    gtrxl_backbone,
    needs_find_unused,
    position_limit,
    window_recipe,
)
from rl_tformers.envs.dataset import DatasetError, EpisodeDataset
from rl_tformers.envs.memory_tasks import scripted_dataset
from rl_tformers.envs.samplers import SegmentSampler
from rl_tformers.envs.torch_data import StepBatchDataset
from rl_tformers.envs.trajectory import ObsStats, next_return_to_go
from torch import Tensor

from rl_tformers.runtime.agent_registry import AgentBuildError, register_agent
from rl_tformers.runtime.eval_profile import span
from rl_tformers.runtime.evaluation import eval_seed, evaluate, report_logs
from rl_tformers.runtime.loading import register_inference_loader
from rl_tformers.types import BackboneState

#: Registered defaults of ``agent.kind=gtrxl`` (its ``agent`` section: :class:`GTrXLAgentConfig`'s)
GTRXL_DEFAULTS: dict[str, Any] = {
    "agent": GTrXLAgentConfig().to_dict(),
    "backbone": gtrxl_backbone(d_model=128, n_layers=3, n_heads=4, mem_len=32),
    "train": {"lr": 3.0e-4, "weight_decay": 1.0e-4, "grad_clip": 1.0, "batch_size": 64, "warmup_steps": 100},
}


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------
def normalize_actions(a: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Environment Box action (..., A) -> [-1, 1] (clipped): the Decision Transformer's
    :func:`~rl_tformers.agents.decision_transformer.model.from_env_action` (a fixed dimension,
    ``low == high``, maps to 0; no overflow for huge bounds)."""
    return from_env_action(a, low, high)


def segment_batch(
    batch: Mapping[str, Tensor],
    *,
    burn_in: int,
    discrete: bool,
    action_low: Tensor | None = None,
    action_high: Tensor | None = None,
    reward_factor: float = 1.0, action_start: int = 0, image_obs: bool = False,
) -> SegmentBatch:
    """Sampler batch of ``1 + burn_in + T`` steps -> :class:`SegmentBatch` of ``burn_in + T``.

    The previous action of an episode's first step is zeros (continuous) or ``-1`` (discrete: no
    action, encoded as the zero vector by a model built with
    :attr:`~rl_tformers.agents.gtrxl.model.GTrXLConfig.prev_action_zero_at_start`); its previous
    reward is 0.

    Args:
        batch: from :class:`~rl_tformers.envs.samplers.SegmentSampler` built with
            ``burn_in + 1``: ``observations (B, L+1, *obs_shape)`` (normalised; flattened here to
            ``(B, L, O)``, as the policy flattens each observation), ``actions`` (Box:
            ``(B, L+1, *action_shape)``, flattened here to ``(B, L, A)``; Discrete: ``(B, L+1)``),
            ``rewards``/``returns_to_go`` (divided by the RTG scale), ``timesteps``, ``mask``,
            ``episode_start``, ``terminations``.
        burn_in: the agent's burn-in (the extra leading step is not counted).
        discrete: integer actions.
        action_low, action_high: (A,) Box bounds (continuous).
        reward_factor: multiplies the batch rewards (sampler units) into the agent's reward
            units (IQL targets and the r_{t-1} input).
        action_start: discrete actions: ``start`` of the ``Discrete`` space; the model sees
            class indices ``action - action_start`` in ``[0, n)``.
        image_obs: images ``(B, L+1, C, H, W)`` (uint8), kept as they come for the image encoder.
    """
    mask = batch["mask"].bool()
    start = batch["episode_start"].bool()
    act = batch["actions"]
    if discrete:
        act = (act.long() - action_start) * mask
    else:
        act = act.flatten(2)  # (B, L+1, A): a (2, 2) Box step -> 4 values (C order, like the bounds)
        act = normalize_actions(act.float(), action_low.to(act.device), action_high.to(act.device))
        act = act * mask.unsqueeze(-1)
    rew = batch["rewards"].float() * reward_factor * mask
    keep = (~start[:, 1:]).to(rew.dtype)  # (B, L): previous step belongs to the same episode
    # a_{t-1}: -1 at an episode start when discrete (no action: zeros with prev_action_zero_at_start)
    prev_a = (torch.where(keep.bool(), act[:, :-1], torch.full_like(act[:, :-1], -1)) if discrete
              else act[:, :-1] * keep.unsqueeze(-1))
    obs = batch["observations"][:, 1:]  # (B, L, C, H, W) pixels as they come, else (B, L, O) floats
    return SegmentBatch(
        obs=obs if image_obs else obs.flatten(2).float(),  # a (2, 3) Box step -> 6 features
        actions=act[:, 1:],
        rewards=rew[:, 1:],
        rtg=batch["returns_to_go"][:, 1:].float(),
        prev_action=prev_a,
        prev_reward=rew[:, :-1] * keep,
        terminals=batch["terminations"][:, 1:].bool(),
        episode_start=start[:, 1:],
        timesteps=batch["timesteps"][:, 1:].long(),
        mask=mask[:, 1:],
        burn_in=burn_in,
    )


def warn_position_time_limit(info, limit: int) -> None:
    """Log a warning when the evaluation environment's time limit exceeds the learned position table.

    GTrXL's positions are episode steps, so with ``backbone.position.kind=learned`` an evaluation
    episode that reaches step ``limit`` (= ``backbone.max_position``) stops the evaluation with an
    error; the dataset's episodes were checked already, this warns about the environment's
    longer ones before training instead of at the first evaluation. Nothing is logged when the
    environment has no time limit or cannot be made here.

    Args:
        info: the dataset's :class:`DatasetInfo` (its ``env_id`` and ``make_env``).
        limit: rows of the learned position table (``backbone.max_position``).
    """

    steps = info.time_limit()
    if steps is not None and steps > limit:
        logging.getLogger(__name__).warning(
            "the evaluation environment %s runs episodes of up to %d steps but backbone.max_position=%d (GTrXL's "
            "positions are episode steps, backbone.position.kind=learned): an evaluation episode that reaches "
            "step %d will stop the evaluation; set backbone.max_position >= %d or use a relative position kind "
            "(xl_relative)", info.env_id, steps, limit, limit, steps)


# ---------------------------------------------------------------------------------------------
# acting
# ---------------------------------------------------------------------------------------------
@dataclass
class GTrXLState:
    """Recurrent state of N environments (owned by the caller; never stored on the policy).

    Attributes:
        memory: the backbone's :class:`BackboneState` (per layer (N, M, D) plus bookkeeping).
        prev_action: (N, A) float in [-1, 1] or (N,) long: the last action taken (zeros, or -1
            for discrete actions, before an episode's first step).
        rtg: (N,) numpy float64, remaining return in raw reward units (return-conditioned agents;
            kept on the host in float64, which not every device supports).
        t: (N,) long, step index of the next observation within its episode.
        target: target return in raw units (``None`` for unconditioned agents).
        window_x, window_pos, window_valid: plain-window mode (``agent.window`` W > 0, then
            ``memory`` is ``None``): the last W inputs (N, W, input_dim), their episode steps
            (N, W) long and validity (N, W) bool, newest at slot W - 1.
    """

    memory: BackboneState | None
    prev_action: Tensor
    rtg: np.ndarray
    t: Tensor
    target: float | None
    window_x: Tensor | None = None
    window_pos: Tensor | None = None
    window_valid: Tensor | None = None


class GTrXLDecision(NamedTuple):
    """The decision of N environments at their new step (model units).

    Attributes:
        action: (N, A) float in [-1, 1] (continuous) or (N,) long class index (discrete).
        features: (N, D) the features the actor read.
        out: (N, A) the actor's output there: logits (discrete) or tanh mean (continuous).
        memory: the next backbone memory (None in the plain-window mode).
        window: the plain window's next tensors (empty with memory; :class:`GTrXLState`).
    """

    action: Tensor
    features: Tensor
    out: Tensor
    memory: Any
    window: dict[str, Tensor]


class GTrXLPolicy:
    """Step-wise GTrXL inference for N environments (the :class:`Policy` protocol).

    Target returns too large for a return-conditioned model (:meth:`target_limit`): the token is
    ``e = W [o ; R / rtg_scale ; a_{t-1} ; r_{t-1}] + b`` in float32 and goes straight into the
    first block's LayerNorm (and, unnormalised, along the residual stream to the final norm),
    which squares the deviations of its d features from their mean: a huge ``R`` overflows them
    to inf and every action is NaN. With ``M = sqrt(float32_max / d) / 4`` (then features of
    magnitude up to 2M still square-sum below float32_max, leaving room for what the blocks add
    to the stream), the limit is the largest ``|R|`` whose return column keeps every feature
    within M / 2: ``|R| <= rtg_scale * (M / 2 - max|b|) / max|w_R|``, ``w_R`` the column of ``W``
    that multiplies the return-to-go. The other M / 2 is left to the other inputs (normalised
    observation, previous action, scaled previous reward), i.e. the bound holds whenever
    ``sum_k |W_jk x_k|`` over them stays below M / 2 (about 5e17 for d = 16), which no
    normalised input approaches. As for the DT, the embedding saturates long before (LayerNorm is
    scale-invariant: all huge targets look alike), but that is the model's answer, not a
    numerical failure. :meth:`initial_state` refuses a target beyond the limit and
    :meth:`check_targets` checks a list up front (``rl-tformers eval/plot --targets``).

    Args:
        model: a trained :class:`GTrXLModel` (put in eval mode here).
        obs_mean, obs_std: (O,) observation normalisation.
        action_low, action_high: (A,) finite Box bounds, or ``None`` for discrete actions.
        rtg_scale: divisor of the return-to-go input (raw units / rtg_scale).
        reward_mult: multiplier of the r_{t-1} input (raw units * reward_mult).
        deterministic: act with the mode (True) or sample from the actor.
        device: where the model runs.
        obs_clip: clip normalised observations to [-obs_clip, obs_clip] (PPO's running
            normalisation does; ``None``: no clipping).
        action_start: discrete actions: ``start`` of the environment's ``Discrete`` space,
            added to the actor's class index to give the environment action.
        action_shape: continuous actions: the shape of one environment's Box action (e.g.
            ``(2, 2)``); :meth:`act` returns ``(N, *action_shape)``. ``None``: flat ``(N, A)``.
    """

    def __init__(
        self,
        model: GTrXLModel,
        *,
        obs_mean: np.ndarray,
        obs_std: np.ndarray,
        action_low: np.ndarray | None = None,
        action_high: np.ndarray | None = None,
        rtg_scale: float = 1.0,
        reward_mult: float = 1.0,
        deterministic: bool = True,
        device: torch.device | str | None = None,
        obs_clip: float | None = None,
        action_start: int = 0,
        action_shape: Sequence[int] | None = None,
    ) -> None:
        self.model = model.eval()
        self.obs_clip = obs_clip
        self.action_start = int(action_start)
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.obs_mean = torch.as_tensor(np.asarray(obs_mean, np.float32), device=self.device)
        self.obs_std = torch.as_tensor(np.asarray(obs_std, np.float32), device=self.device)
        self.discrete = model.cfg.discrete
        if not self.discrete and (action_low is None or action_high is None):
            raise ValueError("gtrxl: a continuous-action policy needs action_low and action_high")
        self.low = None if action_low is None else torch.as_tensor(np.asarray(action_low, np.float32), device=self.device)
        self.high = None if action_high is None else torch.as_tensor(np.asarray(action_high, np.float32), device=self.device)
        self.rtg_scale, self.reward_mult = float(rtg_scale), float(reward_mult)
        self.deterministic = deterministic
        self.counted: np.ndarray | None = None  # count_rows: rows whose decisions the wrappers count
        self.last_metrics: dict[str, Any] = {}  # the backbone's metrics of the latest step
        self.action_shape = None if action_shape is None else tuple(int(k) for k in action_shape)
        if self.action_shape is not None and not self.discrete and math.prod(self.action_shape) != model.cfg.act_dim:
            raise ValueError(f"gtrxl: action_shape={self.action_shape} does not hold the model's "
                             f"{model.cfg.act_dim} action values")

    def target_limit(self) -> float:
        """Largest ``|target return|`` (raw units) the float32 token embedding takes without overflow.

        See the class docstring: ``rtg_scale * (M / 2 - max|b|) / max|w_R|`` with
        ``M = sqrt(float32_max / d) / 4``, ``w_R`` (d,) the embedding's weight column of the
        return-to-go input and ``b`` (d,) its bias. ``inf`` for a model without a return input
        or with ``w_R`` all zeros.
        """
        enc = self.model.encoder
        if not self.model.cfg.rtg_input:
            return math.inf
        w = enc.embed.weight[:, self.model.cfg.obs_features]  # (d,): columns [enc(obs) (F) ; rtg ; a_{t-1} ; r_{t-1}]
        bias = enc.embed.bias
        c = 0.0 if bias is None else float(bias.detach().float().abs().max())
        return embedding_target_limit(w, c, self.rtg_scale, share=0.5)

    def check_targets(self, targets: Sequence[float | None], option: str = "target return") -> None:
        """Refuse targets whose scaled return-to-go would overflow the model (:meth:`target_limit`).

        Args:
            targets: raw target returns (``None``: the agent's default, not checked here).
            option: what to name in the message (``--targets``, ``agent.target_return``).

        Raises:
            ValueError: a target that is not a finite number, or one with
                ``|target| > target_limit()``; the message names ``option``, the target and the limit.
        """
        check_return_targets(
            targets, option, self.target_limit, self.rtg_scale,
            "the token embedding's weights may overflow float32 in the first layer norm",
        )

    def initial_state(self, n_envs: int, target_return: float | None = None) -> GTrXLState:
        """Empty memory for ``n_envs`` environments; ``target_return`` in raw reward units.

        Raises:
            ValueError: a return-conditioned model without a target return, or a target beyond
                :meth:`target_limit` (:meth:`check_targets`).
        """
        if self.model.cfg.rtg_input and target_return is None:
            raise ValueError("gtrxl: this model is return-conditioned (objective rcbc); pass a target return")
        if self.model.cfg.rtg_input:
            self.check_targets([target_return])
        enc = self.model.encoder
        a_shape = (n_envs,) if self.discrete else (n_envs, self.model.cfg.act_dim)
        dev = self.device
        return GTrXLState(
            memory=enc.initial_state(n_envs, dev) if enc.stateful else None,
            # no action yet: zeros, or -1 for discrete actions (GTrXLConfig.prev_action_zero_at_start)
            prev_action=(torch.full(a_shape, -1, dtype=torch.long, device=dev) if self.discrete
                         else torch.zeros(a_shape, dtype=torch.float32, device=dev)),
            rtg=np.full(n_envs, float(target_return or 0.0), dtype=np.float64),
            t=torch.zeros(n_envs, dtype=torch.long, device=dev),
            target=target_return,
            **({} if enc.stateful else enc.initial_window(n_envs, dev)),
        )

    @torch.no_grad()
    def act(
        self,
        obs: np.ndarray,
        state: GTrXLState,
        episode_start: np.ndarray,
        last_reward: np.ndarray | None = None,
    ) -> tuple[np.ndarray, GTrXLState]:
        """One step for N environments: reset the rows that start an episode, then one token each
        (:meth:`step` with :meth:`decide`); arguments and returns as :meth:`step`."""
        return self.step(obs, state, episode_start, last_reward, self.decide)

    @property
    def base(self) -> GTrXLPolicy:
        """The plain policy (itself; a wrapper's ``base`` is the policy it wraps at the bottom)."""
        return self

    def count_rows(self, rows: np.ndarray | None) -> None:
        """Rows (N,) bool whose decisions the wrappers' statistics count (environments still in
        an episode; ``None``: every row). The actions do not depend on it."""
        self.counted = None if rows is None else np.asarray(rows, dtype=bool).copy()

    def stats(self) -> dict[str, float | int]:
        """Counters of the plain policy: none (wrappers add theirs)."""
        return {}

    def reset_stats(self) -> None:
        """Nothing to zero in the plain policy."""

    def decide(self, x: Tensor, t: Tensor, memory: Any, start: Tensor, state: GTrXLState) -> GTrXLDecision:
        """The plain decision: the features of the new tokens ``x`` (N, 1, input_dim) at steps
        ``t`` (N,) (:meth:`features`), the actor's output and its mode or a draw."""
        h, new_memory, win = self.features(x, t, memory, start, state)
        return self.choose(h, new_memory, win)

    def choose(self, h: Tensor, memory: Any, win: dict[str, Tensor]) -> GTrXLDecision:
        """The actor's decision at features ``h`` (N, D): the mode (argmax, or the tanh mean) or a
        draw, clamped to [-1, 1] when continuous."""
        out = self.model.actor(h)  # (N, A): logits or tanh mean
        if self.deterministic:
            a = out.argmax(-1) if self.discrete else out
        else:
            a = self.model.actor.dist(h).sample()
        if not self.discrete:
            a = a.clamp(-1.0, 1.0)
        return GTrXLDecision(a, h, out, memory, win)

    @torch.no_grad()
    def step(
        self,
        obs: np.ndarray,
        state: GTrXLState,
        episode_start: np.ndarray,
        last_reward: np.ndarray | None,
        decide: Callable[[Tensor, Tensor, Any, Tensor, GTrXLState], GTrXLDecision],
    ) -> tuple[np.ndarray, GTrXLState]:
        """One step for N environments whose action comes from ``decide`` (the plain
        :meth:`decide`, or a wrapper's): reset the rows that start an episode, build the tokens.

        Args:
            obs: (N, O) raw observations.
            state: from :meth:`initial_state` or the previous call.
            episode_start: (N,) bool.
            last_reward: (N,) raw reward of the previous step (ignored where ``episode_start``).

        Returns:
            actions (N, A) float32 within the Box bounds (``(N, *action_shape)`` when given), or
            (N,) int64 in ``[action_start, action_start + n)``; and the next state (which keeps
            the class index).
        """
        with span("context"):
            x, t, memory, start, rtg = self._tokens(obs, state, episode_start, last_reward)
        with span("forward"):
            d = decide(x, t, memory, start, state)
        with span("decode"):
            env_a = self._to_env(d.action)
        return env_a, GTrXLState(memory=d.memory, prev_action=d.action, rtg=rtg, t=t + 1, target=state.target,
                                 **d.window)

    def _tokens(self, obs: np.ndarray, state: GTrXLState, episode_start: np.ndarray,
                last_reward: np.ndarray | None) -> tuple[Tensor, Tensor, Any, Tensor, np.ndarray]:
        """The new step's tokens of :meth:`step`: ``(x (N, 1, input_dim), t (N,), memory, start (N,)
        bool, rtg (N,) float64)``, the rows that start an episode reset (memory, step, previous
        action) and the return-to-go moved on."""
        dev = self.device
        n = state.t.shape[0]
        start_np = np.asarray(episode_start, dtype=bool).reshape(n)
        r_np = np.zeros(n) if last_reward is None else np.asarray(last_reward, np.float64).reshape(n)
        r_np = np.where(start_np, 0.0, r_np)
        # R_t = R_{t-1} - r_{t-1}: the data layer's evaluation-time inverse of returns_to_go
        rtg = np.where(start_np, float(state.target or 0.0), next_return_to_go(state.rtg, r_np))
        start = torch.as_tensor(start_np, device=dev)
        r = torch.as_tensor(r_np, dtype=torch.float32, device=dev)
        enc = self.model.encoder
        memory, t, prev_a = state.memory, state.t, state.prev_action
        if start_np.any():  # most steps start no episode: nothing to reset (the same values, fewer ops)
            memory = enc.reset_state(memory, start) if enc.stateful else None
            t = torch.where(start, torch.zeros_like(t), t)
            keep = (~start).view(-1, *([1] * (prev_a.dim() - 1)))
            # a starting row has no previous action: zeros, or -1 for discrete actions (the zero
            # vector for models built with GTrXLConfig.prev_action_zero_at_start, as in training)
            if self.discrete:
                prev_a = torch.where(keep, prev_a, torch.full_like(prev_a, -1))
            else:
                prev_a = prev_a * keep.to(prev_a.dtype)
        o = (torch.as_tensor(np.asarray(obs, np.float32), device=dev).reshape(n, -1) - self.obs_mean) / self.obs_std
        if self.obs_clip is not None:
            o = o.clamp(-self.obs_clip, self.obs_clip)
        x = enc.inputs(
            o[:, None],  # (N, 1, O)
            torch.as_tensor(rtg / self.rtg_scale, dtype=torch.float32, device=dev)[:, None],  # (N, 1)
            prev_a[:, None],  # (N, 1, A) or (N, 1)
            (r * self.reward_mult)[:, None],  # (N, 1)
        )
        return x, t, memory, start, rtg

    def features(self, x: Tensor, t: Tensor, memory: Any, start: Tensor, state: GTrXLState,
                 **depth_kwargs: Any) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """(N, D) features of the new step's tokens ``x`` (N, 1, input_dim) at steps ``t`` (N,):
        with the backbone memory, or (plain window) over the shifted window of the last W steps.
        ``depth_kwargs`` go to the depth module (early exit). Returns the features, the next
        memory and the new window tensors (empty with memory); the backbone's metrics of the call
        are kept in :attr:`last_metrics`."""
        enc = self.model.encoder
        if enc.stateful:
            out = enc(x, t[:, None], state=memory, **depth_kwargs)
            self.last_metrics = out.metrics
            return out.features[:, 0], out.state, {}
        # plain window: shift left, write the new step at slot W-1, re-encode the W steps
        win = enc.shift_window({k: getattr(state, k) for k in ("window_x", "window_pos", "window_valid")},
                               x, t, start)
        out = enc.encode_window(win, **depth_kwargs)
        self.last_metrics = out.metrics
        return out.features[:, -1], out.state, win

    def _to_env(self, a: Tensor) -> np.ndarray:
        """Class indices (N,) -> int64 environment actions, or actions (N, A) in [-1, 1] -> float32
        within the Box bounds (``(N, *action_shape)`` when given)."""
        if self.discrete:
            return a.cpu().numpy().astype(np.int64) + self.action_start
        env_a = to_env_action(a, self.low, self.high).cpu().numpy()  # (N, A)
        if self.action_shape is not None:
            env_a = env_a.reshape(len(env_a), *self.action_shape)
        return env_a


# ---------------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------------
def load_gtrxl_dataset(spec: Mapping[str, Any], seed: int) -> EpisodeDataset:
    """The run's dataset from its ``dataset:`` section (see the module docstring).

    Raises:
        ValueError: neither ``path`` nor ``scripted`` is given.
    """
    spec = dict(spec or {})
    if spec.get("scripted"):
        s = dict(spec["scripted"])
        return scripted_dataset(
            str(s.get("task", "recall")), int(s.get("episodes", 1000)), epsilon=float(s.get("epsilon", 0.2)),
            seed=int(s.get("seed", seed)), delay=int(s.get("delay", 8)),
        )
    return load_offline_dataset(spec)


def model_config_dict(cfg: GTrXLConfig) -> dict[str, Any]:
    """Checkpoint-safe dict of a :class:`GTrXLConfig` (inverse: ``GTrXLConfig(**d)``)."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg)}


# ---------------------------------------------------------------------------------------------
# the trainable agent
# ---------------------------------------------------------------------------------------------
def _plain(x: Any) -> Any:

    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    return x


def check_burn_in(burn_in: int, num_steps: int) -> None:
    """Refuse (or warn about) a burn-in that leaves the gradient windows without real steps.

    A training segment's first step is drawn uniformly over the ``num_steps`` dataset steps
    (:class:`~rl_tformers.envs.samplers.SegmentSampler`) and its gradient window starts
    ``burn_in + 1`` steps later (one leading step for the exact a_{t-1} / r_{t-1}, then the
    burn-in); slots past the end of the data are padding. So a fraction
    ``min(burn_in + 1, num_steps) / num_steps`` of the sampled segments has no real step in its
    window and adds nothing to the loss.

    Raises:
        ValueError: naming ``agent.burn_in``, when no window can hold a real step
            (``burn_in + 1 >= num_steps``: every update would train on padding, loss 0).

    Warns:
        UserWarning: when more than half of the sampled segments would be empty.
    """
    lead = burn_in + 1
    if lead >= num_steps:
        raise ValueError(
            f"agent.burn_in={burn_in}: a training segment's gradient window starts {lead} steps after the "
            f"segment's first step (one step for a_{{t-1}}, then the burn-in), which is drawn uniformly over the "
            f"dataset's {num_steps} steps: no gradient window would hold a real step (every update would train on "
            f"padding, loss 0); use agent.burn_in below {num_steps - 1}, well below for most segments to train")
    if lead / num_steps > 0.5:
        pct = 100.0 * lead / num_steps
        warnings.warn(
            f"agent.burn_in={burn_in}: {lead} of the dataset's {num_steps} steps start a segment whose gradient "
            f"window lies past the end of the data: {pct:.0f}% of the sampled segments have no real step in their "
            f"gradient window and add nothing to the loss; lower agent.burn_in or use more data", stacklevel=3)


def offline_model_config(a: GTrXLAgentConfig, info: DatasetInfo, backbone: Mapping[str, Any]) -> tuple[GTrXLConfig, float]:
    """The offline GTrXL model of options ``a`` on a dataset of ``info``, and the r_{t-1} input
    multiplier (IQL's 1000 / return spread with ``iql_reward_norm``, else 1 / reward scale)."""
    if a.objective == "iql" and a.iql_reward_norm:
        spread = info.return_max - info.return_min
        reward_mult = 1000.0 / spread if spread > 0 else 1.0  # IQL's locomotion normalisation
    else:
        reward_mult = 1.0 / info.reward_scale
    model_cfg = GTrXLConfig(
        obs_dim=info.obs_dim,
        act_dim=info.act_dim,
        discrete=info.discrete,
        backbone=backbone,
        rtg_input=a.objective == "rcbc",
        prev_action_input=a.prev_action,
        prev_reward_input=a.prev_reward,
        head_hidden=a.head_hidden,
        critic="iql" if a.objective == "iql" else "none",
        critic_hidden=a.critic_hidden,
        share_critic_encoder=a.share_critic_encoder,
        window=a.window,
        prev_action_zero_at_start=True,  # discrete a_{t-1} at an episode start: zeros, not action 0
        obs_shape=info.obs_shape,
        encoder=a.encoder.to_dict(),
    )
    return model_cfg, reward_mult


def check_window(window: int, seq_len: int, burn_in: int) -> None:
    """Refuse a burn-in with a plain window (no memory to rebuild); warn when the gradient window
    ``seq_len`` is not the acting window.

    Raises:
        ValueError: ``window`` > 0 with ``burn_in`` > 0.
    """
    if window and burn_in:
        raise ValueError(
            f"agent.window={window} keeps no memory to rebuild, so agent.burn_in="
            f"{burn_in} has nothing to warm up; the whole window recipe: "
            f"{window_recipe(window)}"
        )
    if window and seq_len > window:
        w = window
        warnings.warn(
            f"agent.seq_len={seq_len} > agent.window={w}: in training a step attends to up to "
            f"{seq_len - 1} earlier steps of its segment, when acting to only the {w - 1} of its "
            f"window; set agent.seq_len={w} so training sees the acting window", stacklevel=3)
    if window and seq_len < window:
        w = window
        warnings.warn(
            f"agent.seq_len={seq_len} < agent.window={w}: when acting a step attends to its {w - 1} "
            f"earlier steps, in training to at most {seq_len - 1}; set agent.seq_len={w} so training "
            f"sees the acting window", stacklevel=3)


class GTrXLAgent:
    """Offline GTrXL agent (the runtime's ``Trainable``); see the module docstring.

    Args:
        cfg: resolved run config (``agent``, ``backbone``, ``dataset``, ``train``, ``eval``, ``seed``).
        run_dir: the run directory (unused).
        device: training device.
        dataset: an already loaded dataset (tests); default: from ``cfg.dataset``.
        extra: a checkpoint's extra state: build for inference only, without the dataset.

    Raises:
        ValueError: a bad ``agent.*`` option (a ``ConfigFieldError`` naming it, before the
            dataset is read),
            unbounded Box actions, a bad dataset spec, an ``agent.burn_in`` that leaves no
            real step in any gradient window (:func:`check_burn_in`), an episode longer than a learned
            position table (``backbone.max_position``, :func:`position_limit`), or (``rcbc``) an
            ``agent.target_return`` that is not a finite number or beyond what the new model's
            float32 token embedding takes (:meth:`GTrXLPolicy.target_limit`).
    """

    targets_option = "agent.target_return"  # the config key of the default return target (eval messages)

    def __init__(
        self,
        cfg: Any,
        run_dir: Path | None,
        device: torch.device | str,
        dataset: EpisodeDataset | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        a = GTrXLAgentConfig.from_dict({k: v for k, v in _plain(cfg.agent).items() if k != "kind"}, where="agent")
        self.options = a
        self.cfg = cfg
        self.objective = a.objective
        self.seed = int(cfg.seed)
        self.device = torch.device(device)
        self.seq_len, self.burn_in = a.seq_len, a.burn_in
        self.dataset = dataset
        if extra is not None:  # inference: everything comes from the checkpoint
            self.extra = dict(extra)
            self.info = DatasetInfo.from_extra(self.extra)
            self.model_cfg = GTrXLConfig(**self.extra["model"])
        else:
            if self.dataset is None:
                self.dataset = load_gtrxl_dataset(_plain(cfg.dataset), self.seed)
            check_observations(a.encoder, *observation_layout(self.dataset),
                               f"the dataset {_plain(cfg.dataset).get('path') or self.dataset.metadata.location}")
            info = DatasetInfo.from_dataset(
                self.dataset, env_id=a.env_id, env_kwargs=a.env_kwargs, spec=_plain(cfg.dataset).get("path"),
                flatten_observations=flattens_observations(_plain(cfg.dataset)),
            )
            self.model_cfg, reward_mult = offline_model_config(a, info, _plain(cfg.backbone))
            check_window(self.model_cfg.window, self.seq_len, self.burn_in)
            check_burn_in(self.burn_in, self.dataset.num_steps)
            self.info = info
            self.extra = {**info.to_extra(), "reward_mult": float(reward_mult), "model": model_config_dict(self.model_cfg)}
        self.model = GTrXLModel(self.model_cfg).to(self.device)
        #: early exit and the kNN-LM datastore at evaluation (inference_setup)
        self.inference = GTrXLInference(self, lambda: load_gtrxl_dataset(_plain(cfg.dataset), self.seed))
        #: parameters some updates leave without a gradient: DDP must look for them (needs_find_unused)
        self.ddp_find_unused = needs_find_unused(self.model.encoder.backbone.config)
        limit = position_limit(self.model)
        if extra is None and limit is not None and self.info.longest_episode > limit:
            e = int(np.flatnonzero(self.dataset.lengths > limit)[0])  # the first episode too long
            raise DatasetError(
                f"backbone.max_position={limit} but the dataset has an episode of {int(self.dataset.lengths[e])} "
                f"steps (lengths: episode {e}): GTrXL's positions are episode steps, and "
                f"backbone.position.kind=learned has no table row past step {limit - 1}; raise backbone.max_position "
                f"(to cover the longest evaluation episode too) or use a relative position kind (xl_relative, the "
                f"GTrXL default)", field="lengths", episode=e, step=limit)
        if extra is None and limit is not None:
            warn_position_time_limit(self.info, limit)
        if extra is None and self.model_cfg.rtg_input and a.target_return is not None:
            # before training, not at the first evaluation: a target the float32 token embedding
            # cannot take (GTrXLPolicy.target_limit; rechecked at every evaluation)
            self.plain_policy().check_targets([a.target_return], "agent.target_return")
            self.model.train()

    # -- Trainable ---------------------------------------------------------------------------
    def batches(self, start_step: int):
        """Step-indexed dataset: batch ``s`` drawn from ``default_rng([seed, s])`` (resume-exact)."""

        if self.dataset is None:
            raise RuntimeError("this GTrXL agent was loaded for inference only (no dataset)")
        shape = self.dataset.observation_shape
        stats = None if self.info.image_obs else ObsStats(  # images: scaled in the encoder, not standardised
            self.info.obs_mean.reshape(shape), self.info.obs_std.reshape(shape))
        held = self.inference.heldout_mask(self.dataset.num_episodes)  # early exit: calibration episodes
        sampler = SegmentSampler(
            self.dataset.select(~held) if held.any() else self.dataset, self.seq_len, burn_in=self.burn_in + 1, reward_scale=self.info.reward_scale, obs_stats=stats
        )
        return StepBatchDataset(sampler, int(self.cfg.train.batch_size), seed=self.seed, num_steps=int(self.cfg.train.steps))

    def to_segments(self, batch: Mapping[str, Tensor], burn_in: int | None = None) -> SegmentBatch:
        """Sampler batch -> :class:`SegmentBatch` on the model's device (``burn_in``: default
        ``agent.burn_in``; the batch holds ``1 + burn_in + T`` steps)."""
        dev = next(self.model.parameters()).device
        info = self.info
        return segment_batch(
            {k: v.to(dev) for k, v in batch.items()},
            burn_in=self.burn_in if burn_in is None else burn_in,
            discrete=info.discrete,
            action_low=None if info.discrete else torch.as_tensor(info.action_low),
            action_high=None if info.discrete else torch.as_tensor(info.action_high),
            reward_factor=info.reward_scale * float(self.extra["reward_mult"]),
            action_start=info.action_start,
            image_obs=info.image_obs,
        )

    def loss(self, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor | float]]:
        """The objective's loss on one batch (IQL: Polyak-update the target first)."""
        seg = self.to_segments(batch)
        if self.objective == "iql":
            a = self.options
            polyak_update(self.model.target, self.model.critic_target_modules(), float(a.tau))
            return iql_loss(
                self.model, self.model.target, seg, gamma=float(a.gamma), expectile=float(a.expectile),
                beta=float(a.beta), max_weight=float(a.max_weight),
            )
        ee = self.options.early_exit
        return bc_loss(self.model, seg, exit_scheme=ee.scheme, exit_tol=float(ee.tol))

    def policy(self, deterministic: bool | None = None) -> Any:
        """The :class:`GTrXLPolicy` of the current weights, wrapped with the inference options in
        use (early exit, kNN-LM: :meth:`GTrXLInference.wrap`)."""
        return self.inference.wrap(self.plain_policy(deterministic))

    def inference_setup(self, **options: Any) -> dict[str, Any]:
        """Evaluation options (``rl-tformers eval --early-exit / --knn-*``): :meth:`GTrXLInference.setup`."""
        return self.inference.setup(**options)

    def plain_policy(self, deterministic: bool | None = None) -> GTrXLPolicy:
        """The :class:`GTrXLPolicy` of the current weights, without inference options."""
        info = self.info
        det = self.options.deterministic if deterministic is None else deterministic
        return GTrXLPolicy(
            self.model, obs_mean=info.obs_mean, obs_std=info.obs_std, action_low=info.action_low,
            action_high=info.action_high, rtg_scale=info.reward_scale, reward_mult=float(self.extra["reward_mult"]),
            deterministic=det, action_start=info.action_start,
            action_shape=None if info.discrete else info.action_shape,
        )

    def make_env(self):
        """Factory of the evaluation environment (the dataset's, masked like its ``pomdp`` record)."""
        return self.info.make_env()

    def default_targets(self) -> list[float | None]:
        """``agent.target_return`` or the best dataset return (rcbc); ``[None]`` otherwise."""
        if not self.model_cfg.rtg_input:
            return [None]
        t = self.options.target_return
        return [float(t) if t is not None else float(self.info.return_max)]

    def evaluate(self, step: int) -> dict[str, float]:
        """Mean/std return (and D4RL-normalised score when references exist) over ``eval.episodes``;
        ``rcbc`` also reports the ``target`` return it conditioned on (raw units).

        The policy is the one ``rl-tformers eval RUN`` evaluates without options:
        ``agent.early_exit.threshold`` (calibrated on the current weights for ``calibrate``) and
        ``agent.knn.*`` apply; both are dropped again afterwards."""
        was_training = self.model.training
        saved = self.inference.snapshot()
        try:
            self.inference.setup()
            report = evaluate(
                self.policy(), self.make_env(), self.default_targets(), episodes=int(self.cfg.eval.episodes),
                n_envs=int(self.cfg.eval.n_envs), seed=eval_seed(self.seed, step), normalize=self.info.normalizer(),
                env_id=self.info.env_id,
            )
        finally:
            self.inference.restore(saved)
            self.model.train(was_training)
        return report_logs(report)

    def extra_state(self) -> dict[str, Any]:
        """A copy of the extra state saved with a checkpoint (dataset statistics, reward
        multiplier, model config; read back by :meth:`load_extra_state`)."""
        return dict(self.extra)

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        """Take the checkpoint's extra state (``--resume``): dataset statistics, reward multiplier
        and model config.

        A resumed run trains on the dataset it reads now with the checkpoint's statistics
        (observation mean/std, reward scale and IQL reward multiplier, default target): data
        behind ``dataset.path`` that changed since the checkpoint (a rebuilt or overwritten file)
        would be trained on with stale statistics, and the resume would not continue the run.
        That is refused, naming what changed (the Decision Transformer's check,
        :func:`~rl_tformers.agents.common.offline.data_differences`).

        Raises:
            AgentBuildError: (a ValueError, reported by ``rl-tformers train`` as one ``error:``
                line) the statistics of the dataset read now differ from the checkpoint's.
        """

        saved = DatasetInfo.from_extra(state)
        if self.dataset is not None and getattr(self, "info", None) is not None:
            changed = data_differences(saved, self.info)
            if changed:
                spec = _plain(self.cfg.dataset) or {}
                where = spec.get("path") or f"built by dataset.scripted={dict(spec.get('scripted') or {})}"
                raise AgentBuildError(
                    f"the dataset {where} is not the data this run was trained on: its statistics differ from "
                    f"the checkpoint's ({'; '.join(changed)}; checkpoint -> now); resume with the original "
                    f"data, or start a new run on this dataset")
        self.extra = dict(state)
        self.info = saved


def load_for_inference(cfg: Any, state: Mapping[str, Any], device: torch.device | str = "cpu") -> GTrXLAgent:
    """A :class:`GTrXLAgent` rebuilt from a checkpoint dict, without reading its dataset."""
    agent = GTrXLAgent(cfg, None, device, extra=state["extra"])
    agent.model.load_state_dict(state["model"])
    agent.model.eval()
    return agent


@register_agent(
    "gtrxl",
    description="GTrXL (Parisotto et al. 2019) trained offline: BC, return-conditioned BC or IQL, with burn-in",
    defaults=GTRXL_DEFAULTS,
    check_backbone=check_causal,
    config_cls=GTrXLAgentConfig,
)
def build_gtrxl(cfg: Any, run_dir: Path, device: torch.device) -> GTrXLAgent:
    """Builder of ``agent.kind=gtrxl``."""
    return GTrXLAgent(cfg, run_dir, device)


register_inference_loader("gtrxl")(load_for_inference)
