"""Decision Transformer inference: the :class:`~rl_tformers.agents.common.policy.Policy` of a DT.

N environments are served by one batched forward pass per step. The context of each
environment lives in preallocated (N, K, ...) buffers held in a :class:`DTState` (owned by the
caller, never by the policy), laid out like the training windows (``align``):

- ``align="start"`` (the paper's sampler; causal mode only): step t of an episode is written at
  slot ``min(t, K-1)``; once the window is full, the row is shifted left by one slot before
  writing, so the window always holds the last K steps starting at slot 0, exactly like a
  training window that starts at ``max(0, t - K + 1)``; the prediction is read at slot
  ``min(t, K-1)``.
- ``align="end"`` (``last_action`` mode, or causal mode trained on end-aligned windows): every
  step shifts the row left by one and writes at slot K-1; slots before the episode's first step
  stay padding; the prediction is read at slot K-1.

Return-to-go (Chen et al. 2021, algorithm 1): the first step of an episode is conditioned on the
target return, and after each reward ``R_{t+1} = R_t - r_t``, in raw units (float64); the model
sees ``R_t / rtg_scale``, the same scale as the training windows, whose RTG is the suffix sum
``sum_{t' >= t} r_{t'}`` (:func:`rl_tformers.envs.trajectory.returns_to_go`). The update is the
data layer's :func:`~rl_tformers.envs.trajectory.next_return_to_go`, that recursion solved for
``R_{t+1}``, so replaying a dataset trajectory with target = its return feeds exactly its
training-time RTG (tested).

Target returns too large for the model (:meth:`DTPolicy.target_limit`): the RTG token is
``LayerNorm(w * R / rtg_scale + b + E_time[t])`` in float32; LayerNorm squares the deviations of
its d inputs from their mean, so a huge ``R`` makes them overflow to inf and every action NaN.
The limit is the largest ``|R|`` for which every input stays below ``M = sqrt(float32_max / d) / 4``
(then each squared deviation is at most ``(2M)^2`` and their sum over d at most
``float32_max / 4``, whatever the order of summation):
``|R| <= rtg_scale * (M - max|b + E_time|) / max|w|``. It is a sufficient bound, from the
weights, not a guess from the data; for a d = 16 model with weights of order 0.05 and
rtg_scale 1000 it is about 3e22 (that run's actions turned NaN some 80x above it). Far below it the
embedding already saturates (LayerNorm is scale-invariant: all huge targets look alike), but
that is the model's answer, not a numerical failure. :meth:`DTPolicy.initial_state` refuses a
target above the limit; :meth:`DTPolicy.check_targets` checks a list up front.

Timesteps past ``max_ep_len`` (the size of the timestep embedding): ``timestep_overflow="error"``
(default) raises a ValueError naming the option; ``"clamp"`` reuses the last timestep index
``max_ep_len - 1`` for all later steps (documented, tested).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.common.knn_memory import interpolate_continuous, interpolate_discrete
from rl_tformers.agents.common.policy import check_return_targets, embedding_target_limit
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, to_env_action
from rl_tformers.envs.trajectory import next_return_to_go
from torch import Tensor

from rl_tformers.runtime.evaluation import NonFiniteError

OVERFLOW_POLICIES = ("error", "clamp")


@dataclass
class DTState:
    """Context buffers of N environments (updated in place by :meth:`DTPolicy.act` and returned).

    Attributes:
        obs: (N, K, obs_dim) normalised observations.
        actions: (N, K, A) normalised actions in [-1, 1] (continuous) or (N, K) long (discrete).
        rtg: (N, K) returns-to-go fed to the model (raw / rtg_scale).
        timesteps: (N, K) long episode steps.
        mask: (N, K) bool, True = real step.
        t: (N,) int64 step of the current observation in its episode (-1 before the first).
        rtg_raw: (N,) float64 remaining return in raw reward units.
        target: (N,) float64 target return of each row (raw units).
    """

    obs: Tensor
    actions: Tensor
    rtg: Tensor
    timesteps: Tensor
    mask: Tensor
    t: np.ndarray
    rtg_raw: np.ndarray
    target: np.ndarray


def acting_context_mask(mask: Tensor, slot: Tensor, context_steps: int | None) -> Tensor:
    """The context a DT reads when it decides at ``slot``: ``mask`` (N, K) bool, True = real
    step, cut to the last ``context_steps`` slots up to and including ``slot`` (N,) long
    (Online DT's evaluation context length, Zheng et al. 2022); ``None``: ``mask`` unchanged.
    Used alike by acting (:meth:`DTPolicy.act`), early-exit calibration and the kNN-LM
    datastore, so that all three see the same context."""
    if context_steps is None:
        return mask
    keep = torch.arange(mask.shape[1], device=mask.device)[None, :] > slot[:, None] - context_steps  # (N, K)
    return mask & keep


def _check_acting_options(model: DecisionTransformer, sample: bool, context_steps: int | None,
                          exit_threshold: float | None, align: str | None,
                          timestep_overflow: str) -> tuple[int | None, str]:
    """Refuse :class:`DTPolicy` options that do not fit ``model``; returns (context_steps, align) in
    effect (``None`` for a context of all K steps; the mode's default alignment).

    Raises:
        ValueError: as :class:`DTPolicy` says, naming the option.
    """
    if sample and model.cfg.head != "gaussian":
        raise ValueError(f"DTPolicy: sample=True draws from the stochastic head and needs agent.head=gaussian; "
                         f"this model's head is {model.cfg.head!r}")
    k = model.cfg.context_len
    if context_steps is not None and (isinstance(context_steps, bool) or not 1 <= int(context_steps) <= k):
        raise ValueError(f"DTPolicy: context_steps={context_steps!r}; give an integer in [1, {k}] "
                         f"(agent.eval_context_len, at most agent.context_len) or None")
    if exit_threshold is not None and not model.early_exit:
        raise ValueError("DTPolicy: exit_threshold needs backbone.depth.kind=early_exit")
    align = align or ("start" if model.cfg.mode == "causal" else "end")
    if align not in ("start", "end") or (align == "start" and model.cfg.mode != "causal"):
        raise ValueError(f"DTPolicy: align={align!r}; use 'start' (causal mode only) or 'end'")
    if timestep_overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"timestep_overflow={timestep_overflow!r}; use one of {', '.join(OVERFLOW_POLICIES)}")
    return (None if context_steps is None or int(context_steps) == k else int(context_steps)), align


class ActingCounters:
    """What :meth:`DTPolicy.stats` reports: forward passes, their wall time, decisions, exit layers, kNN hits."""

    def __init__(self) -> None:
        self.steps = 0
        self.forward_s = 0.0
        self.decisions = 0
        self.exit_layer_sum = 0.0
        self.early_sum = 0.0
        self.knn_hits = 0

    def add(self, seconds: float, decisions: int, exit_metrics: Mapping[str, Any] | None) -> None:
        """One forward pass of ``seconds`` deciding ``decisions`` rows; with early exit its
        ``exit/mean_layer`` and ``exit/early_frac`` (means over the deciding rows)."""
        self.forward_s += seconds
        self.steps += 1
        self.decisions += decisions
        if exit_metrics is not None:
            self.exit_layer_sum += float(exit_metrics["exit/mean_layer"]) * decisions
            self.early_sum += float(exit_metrics["exit/early_frac"]) * decisions

    def as_dict(self, early_exit: bool, knn: bool) -> dict[str, float | int]:
        """``steps``, ``forward_ms_per_step``; with early exit ``exit_mean_layer`` (1-based) and
        ``exit_early_frac``; with kNN ``knn_hit_frac``."""
        out: dict[str, float | int] = {"steps": int(self.steps)}  # a count: an int in the JSON
        if self.steps:
            out["forward_ms_per_step"] = 1000.0 * self.forward_s / self.steps
        if early_exit and self.decisions:
            out["exit_mean_layer"] = self.exit_layer_sum / self.decisions
            out["exit_early_frac"] = self.early_sum / self.decisions
        if knn and self.decisions:
            out["knn_hit_frac"] = self.knn_hits / self.decisions
        return out


class DTPolicy:
    """Acts with a trained :class:`DecisionTransformer` in N environments at once.

    Args:
        model: the model (put in eval mode here).
        obs_mean, obs_std: (obs_dim,) observation statistics used in training.
        rtg_scale: divisor of returns-to-go, as in training (paper: 1000 for MuJoCo).
        action_low, action_high: (A,) bounds of a continuous action space (ignored when discrete).
        default_target: target return used when ``initial_state`` gets none.
        timestep_overflow: ``error`` or ``clamp`` (see the module docstring).
        device: where the model runs (default: the model's device).
        align: context layout, ``start`` or ``end`` (default: ``start`` in causal mode, ``end``
            in last_action mode); must match the training windows.
        exit_threshold: depth kind ``early_exit``: act with early exit at this confidence
            threshold (the current step's state token decides; the layer loop stops once every
            row's decision exited). ``None``: the backbone's stored threshold (+inf unless
            calibrated: the full model).
        knn: a :class:`~rl_tformers.agents.common.knn_memory.KNNPolicyMemory` whose datastore
            was built from the training dataset (:meth:`DTAgent.build_knn_memory`): the
            action is interpolated with the neighbours' (kNN-LM; the weighted form for
            continuous actions) with weight ``knn.lam``.
        action_start: discrete actions: ``start`` of the environment's ``Discrete`` space,
            added to the model's class index (``[0, n)``) to give the environment action.
        action_shape: continuous actions: the shape of one environment's Box action (e.g.
            ``(2, 2)``); :meth:`act` returns ``(N, *action_shape)``. ``None``: flat ``(N, A)``.
        sample: ``gaussian`` head only: act with a draw ``tanh(mean + std * eps)``, ``eps ~ N(0, I)``,
            of the tanh-squashed Gaussian (Online DT's exploration, Zheng et al. 2022) instead of
            its mean ``tanh(mean)`` (the default, used for evaluation). The sampled action is also
            the one written into the context.
        generator: with ``sample``: the ``torch.Generator`` (on the model's device) the noise is
            drawn from, one (N, A) draw per :meth:`act` call; ``None``: torch's global generator.
        context_steps: act on the last ``min(t + 1, context_steps)`` steps of the K in the
            context (the older steps are masked out as padding; Online DT's evaluation context
            length, Zheng et al. 2022, 5 on Hopper); ``None``: all K. In causal mode a training
            window already predicts from every shorter prefix, so this stays within what the
            model was trained on. With slot-position backbones (``position.kind`` learned,
            sinusoidal, ...) the kept steps keep their slots (masked, not moved).

    :meth:`stats` reports, since the last :meth:`reset_stats`: forward-pass milliseconds per
    step (one call for all N environments), mean exit layer and early-exit fraction of the
    decisions (early exit), and the fraction of decisions with a kNN neighbour.

    Raises:
        ValueError: unknown option values, ``align="start"`` in last_action mode, missing
            action bounds for a continuous space, an ``action_shape`` that does not hold the
            model's A action values, early-exit options without ``early_exit``, ``sample``
            without the gaussian head (``agent.head=gaussian``), ``context_steps`` not in [1, K].
    """

    def __init__(
        self,
        model: DecisionTransformer,
        obs_mean: np.ndarray,
        obs_std: np.ndarray,
        rtg_scale: float,
        action_low: np.ndarray | None = None,
        action_high: np.ndarray | None = None,
        default_target: float | None = None,
        timestep_overflow: str = "error",
        device: torch.device | str | None = None,
        align: str | None = None,
        exit_threshold: float | None = None,
        knn: Any = None,
        action_start: int = 0,
        action_shape: Sequence[int] | None = None,
        sample: bool = False,
        generator: torch.Generator | None = None,
        context_steps: int | None = None,
    ) -> None:
        self.context_steps, self.align = _check_acting_options(
            model, sample, context_steps, exit_threshold, align, timestep_overflow)
        self.sample = bool(sample)
        self.generator = generator
        self.exit_threshold = exit_threshold
        self.knn = knn
        self.action_start = int(action_start)
        self._counted: np.ndarray | None = None  # count_rows: rows whose decisions stats() counts
        self.counters = ActingCounters()
        self.model = model.eval()
        self.cfg = model.cfg
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        f32 = dict(dtype=torch.float32, device=self.device)
        self.obs_mean = torch.as_tensor(np.asarray(obs_mean, dtype=np.float32), **f32)
        self.obs_std = torch.as_tensor(np.asarray(obs_std, dtype=np.float32), **f32)
        if not rtg_scale > 0:
            raise ValueError(f"DTPolicy: rtg_scale must be > 0, got {rtg_scale}")
        self.rtg_scale = float(rtg_scale)
        self.default_target = default_target
        self.timestep_overflow = timestep_overflow
        if not self.cfg.discrete:
            if action_low is None or action_high is None:
                raise ValueError("DTPolicy: a continuous action space needs action_low and action_high")
            self.low = torch.as_tensor(np.asarray(action_low, dtype=np.float32), **f32)
            self.high = torch.as_tensor(np.asarray(action_high, dtype=np.float32), **f32)
        self.action_shape = None if action_shape is None else tuple(int(k) for k in action_shape)
        if self.action_shape is not None and not self.cfg.discrete and math.prod(self.action_shape) != self.cfg.act_dim:
            raise ValueError(f"DTPolicy: action_shape={self.action_shape} does not hold the model's "
                             f"{self.cfg.act_dim} action values")

    def count_rows(self, rows: np.ndarray | None) -> None:
        """Count only these rows' decisions in :meth:`stats` from the next :meth:`act` on.

        ``rows``: (N,) bool, False for rows whose actions the caller discards (the evaluation's
        idle environments past their episode quota); ``None``: every row (the default). Those
        rows' state tokens do not decide either (with early exit they never exit, so they do not
        hold back the layer loop); the counted rows' actions are unchanged.
        """
        self._counted = None if rows is None else np.asarray(rows, dtype=bool).copy()

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`."""
        self.counters = ActingCounters()

    def stats(self) -> dict[str, float | int]:
        """Counters since :meth:`reset_stats` (means over forward passes / decisions).

        Keys: ``steps`` (forward passes), ``forward_ms_per_step`` (wall ms of one batched
        forward pass incl. kNN search); with early exit ``exit_mean_layer`` (1-based) and
        ``exit_early_frac``; with kNN ``knn_hit_frac``.
        """
        return self.counters.as_dict(early_exit=self.model.early_exit, knn=self.knn is not None)

    def target_limit(self) -> float:
        """Largest ``|target return|`` (raw units) the float32 RTG embedding takes without overflow.

        See the module docstring: ``rtg_scale * (M - max|b + E_time|) / max|w|`` with
        ``M = sqrt(float32_max / d) / 4``, ``w``, ``b`` the return embedding's weight and bias and
        ``E_time`` every row of the timestep embedding. ``inf`` when ``w`` is all zeros.
        """
        m = self.model
        c = (m.embed_return.bias.detach().float() + m.embed_timestep.weight.detach().float()).abs().max()
        return embedding_target_limit(m.embed_return.weight.reshape(-1), float(c), self.rtg_scale)

    def check_targets(self, targets: Sequence[float | None], option: str = "target return") -> None:
        """Refuse targets whose scaled return-to-go would overflow the model (:meth:`target_limit`).

        Args:
            targets: raw target returns (``None``: the default target).
            option: what to name in the message (``--targets``, ``agent.targets``).

        Raises:
            ValueError: a target that is not a number or not finite, or one with
                ``|target| > target_limit()``; the message names ``option``, the target and the limit
                (:func:`~rl_tformers.agents.common.policy.check_return_targets`).
        """
        check_return_targets(
            [self.default_target if t is None else t for t in targets], option, self.target_limit, self.rtg_scale,
            "the return embedding's weights may overflow float32 in the embedding LayerNorm",
        )

    def initial_state(self, n_envs: int, target_return: float | None = None) -> DTState:
        """Empty context for ``n_envs`` episodes conditioned on ``target_return`` (raw units).

        Raises:
            ValueError: no target given and no default target stored with the agent, or a
                target beyond :meth:`target_limit` (:meth:`check_targets`).
        """
        target = self.default_target if target_return is None else target_return
        if target is None:
            raise ValueError("Decision Transformer needs a target return: pass --targets (raw reward units)")
        self.check_targets([target])
        cfg, dev, n, k = self.cfg, self.device, n_envs, self.cfg.context_len
        act_shape = (n, k) if cfg.discrete else (n, k, cfg.act_dim)
        return DTState(
            obs=torch.zeros(n, k, cfg.obs_dim, device=dev),
            actions=torch.zeros(act_shape, device=dev, dtype=torch.long if cfg.discrete else torch.float32),
            rtg=torch.zeros(n, k, device=dev),
            timesteps=torch.zeros(n, k, dtype=torch.long, device=dev),
            mask=torch.zeros(n, k, dtype=torch.bool, device=dev),
            t=np.full(n, -1, dtype=np.int64),
            rtg_raw=np.full(n, float(target), dtype=np.float64),
            target=np.full(n, float(target), dtype=np.float64),
        )

    @torch.no_grad()
    def act(
        self,
        obs: np.ndarray,
        state: DTState,
        episode_start: np.ndarray,
        last_reward: np.ndarray | None = None,
    ) -> tuple[np.ndarray, DTState]:
        """Actions for one step of N environments (one forward pass); see the module docstring.

        Args:
            obs: (N, obs_dim) raw observations.
            state: from :meth:`initial_state` or the previous call (updated in place).
            episode_start: (N,) bool; those rows are cleared and conditioned on their target.
            last_reward: (N,) raw rewards of the previous step (ignored where a row starts).

        Returns:
            actions (N, A) float32 in the action box (``(N, *action_shape)`` when given), or (N,)
            int64 in ``[action_start, action_start + n)`` for discrete spaces; the state.

        Raises:
            ValueError: a step at or past ``max_ep_len`` with ``timestep_overflow="error"``, or a
                row that has never started an episode.
            NonFiniteError: (a ValueError) the model's prediction of a row is NaN/inf.
        """
        start = np.asarray(episode_start, dtype=bool)
        n = start.shape[0]
        t = self._advance(state, start, last_reward)
        rows, slot = self._write_step(state, obs, start, t)
        if self._counted is not None and self._counted.shape != (n,):
            raise ValueError(f"DTPolicy.act: count_rows was given {self._counted.shape[0]} rows but act got {n}; "
                             f"call count_rows(None) to count every row")
        counted = np.ones(n, bool) if self._counted is None else self._counted
        a = self._decide(state, rows, slot, counted)
        state.actions[rows, slot] = a
        if self.cfg.discrete:  # class index -> environment action
            return a.cpu().numpy().astype(np.int64) + self.action_start, state
        env_a = to_env_action(a, self.low, self.high).cpu().numpy().astype(np.float32)  # (N, A)
        if self.action_shape is not None:
            env_a = env_a.reshape(n, *self.action_shape)
        return env_a, state

    def _advance(self, state: DTState, start: np.ndarray, last_reward: np.ndarray | None) -> np.ndarray:
        """Start rows at their target (step 0), move the others one step on (R_{t+1} = R_t - r_t).

        Returns:
            (N,) int64 episode steps now.

        Raises:
            ValueError: a row continues an episode that never started, or a step at or past
                ``max_ep_len`` with ``timestep_overflow="error"``.
        """
        cfg = self.cfg
        cont = ~start
        if (cont & (state.t < 0)).any():
            raise ValueError("DTPolicy.act: a row continues an episode that never started (episode_start must be True first)")
        if last_reward is not None:  # R_{t+1} = R_t - r_t (the data layer's recursion)
            r = np.asarray(last_reward, dtype=np.float64)
            state.rtg_raw = np.where(cont, next_return_to_go(state.rtg_raw, r), state.rtg_raw)
        state.rtg_raw[start] = state.target[start]
        state.t = np.where(start, 0, state.t + 1)
        t = state.t
        if int(t.max()) >= cfg.max_ep_len:
            if self.timestep_overflow == "error":
                raise ValueError(
                    f"Decision Transformer: episode step {int(t.max())} >= agent.max_ep_len={cfg.max_ep_len} "
                    f"(the timestep embedding has no entry for it); evaluate on episodes of at most "
                    f"{cfg.max_ep_len} steps, train with a larger agent.max_ep_len, or set "
                    f"timestep_overflow='clamp' to reuse the last timestep index (agent.timestep_overflow=clamp "
                    f"in the run config, `rl-tformers eval --timestep-overflow clamp`)"
                )
        return t

    def _write_step(self, state: DTState, obs: np.ndarray, start: np.ndarray, t: np.ndarray) -> tuple[Tensor, Tensor]:
        """Shift full windows, clear starting rows and write step t (observation, return-to-go,
        timestep; action 0 until decided) at its slot. Returns (rows (N,), slot (N,)) long tensors."""
        cfg, k, dev = self.cfg, self.cfg.context_len, self.device
        n = start.shape[0]
        # shift rows whose window is full (align start) or that continue (align end) one slot left
        shift_np = (t >= k) if self.align == "start" else ~start
        shift = torch.as_tensor(shift_np, device=dev)
        st = torch.as_tensor(start, device=dev)
        for name in ("obs", "actions", "rtg", "timesteps", "mask"):
            buf = getattr(state, name)
            sh = shift.view((n,) + (1,) * (buf.dim() - 1))
            new = torch.where(sh, buf.roll(-1, dims=1), buf)
            new = torch.where(st.view_as(sh), torch.zeros_like(new), new)  # clear starting rows
            setattr(state, name, new)
        slot_np = np.minimum(t, k - 1) if self.align == "start" else np.full(n, k - 1)
        rows = torch.arange(n, device=dev)
        slot = torch.as_tensor(slot_np, device=dev)
        obs_t = torch.as_tensor(np.asarray(obs, dtype=np.float32), device=dev).reshape(n, cfg.obs_dim)
        state.obs[rows, slot] = (obs_t - self.obs_mean) / self.obs_std
        state.rtg[rows, slot] = torch.as_tensor(state.rtg_raw / self.rtg_scale, dtype=torch.float32, device=dev)
        state.timesteps[rows, slot] = torch.as_tensor(np.minimum(t, cfg.max_ep_len - 1), device=dev)
        state.mask[rows, slot] = True
        state.actions[rows, slot] = 0
        return rows, slot

    def _decide(self, state: DTState, rows: Tensor, slot: Tensor, counted: np.ndarray) -> Tensor:
        """One forward pass over the windows: the action (N, A) or (N,) at each row's deciding
        state token (mean or a draw, then the kNN-LM interpolation), counted in :meth:`stats`
        for the ``counted`` (N,) rows."""
        cfg, dev = self.cfg, self.device
        n, k = rows.shape[0], cfg.context_len
        n_counted = int(counted.sum())
        t0 = time.perf_counter()
        kw: dict[str, Any] = {}
        if self.model.early_exit:
            decide = torch.zeros(n, k, dtype=torch.bool, device=dev)  # (N, K): the current step decides
            decide[rows, slot] = torch.as_tensor(counted, device=dev)  # (rows whose decisions count)
            kw = {"exit_steps": decide, "exit_threshold": self.exit_threshold}
        mask = acting_context_mask(state.mask, slot, self.context_steps)
        forward = self.model.forward_early_exit if kw else self.model
        out = forward(state.obs, state.actions, state.rtg, state.timesteps, mask, **kw)
        p = (rows, slot) if cfg.mode == "causal" else (slice(None), -1)  # the deciding state token
        a = out.action[p]  # (N, A) or (N,)
        if self.sample:  # a draw of the tanh-squashed Gaussian instead of its mean
            mean, log_std = out.mean[p], out.log_std[p]  # (N, A)
            eps = torch.randn(mean.shape, generator=self.generator, device=mean.device, dtype=mean.dtype)
            a = torch.tanh(mean + log_std.exp() * eps)
        self._check_finite(out.logits[p] if cfg.discrete else a, state)
        if self.knn is not None:
            a = self._interpolate(out.features[p], out.logits[p] if cfg.discrete else a, counted)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.counters.add(time.perf_counter() - t0, n_counted, out.metrics if self.model.early_exit else None)
        return a

    def _check_finite(self, pred: Tensor, state: DTState) -> None:
        """Raise (:class:`~rl_tformers.runtime.evaluation.NonFiniteError`) if the model's
        prediction (N, ...) of some row is NaN/inf: no action (a discrete argmax of NaN logits is
        an arbitrary class) is returned from it."""
        bad = ~torch.isfinite(pred.reshape(pred.shape[0], -1)).all(dim=1)
        if not bool(bad.any()):
            return

        i = int(torch.nonzero(bad)[0, 0])
        raise NonFiniteError(
            f"Decision Transformer: the model's prediction is not finite (NaN/inf) for target return "
            f"{float(state.target[i]):g} at episode step {int(state.t[i])} (env {i}; return-to-go fed "
            f"{float(state.rtg_raw[i]):g} / reward scale {self.rtg_scale:g}); no action is taken from it"
        )

    def _interpolate(self, features: Tensor, pred: Tensor, counted: np.ndarray) -> Tensor:
        """kNN-LM at the decision: features (N, D); pred = logits (N, n_actions) or action (N, A);
        ``counted`` (N,) bool: the rows whose hits :meth:`stats` counts."""

        nb = self.knn.neighbours(features)
        self.counters.knn_hits += int(nb.valid.any(-1).cpu()[torch.as_tensor(counted)].sum())
        if self.cfg.discrete:
            return interpolate_discrete(pred, nb, self.knn.lam, self.knn.temperature).argmax(-1)
        return interpolate_continuous(pred, nb, self.knn.lam, self.knn.temperature).clamp(-1.0, 1.0)
