"""Decision Transformer inference: the :class:`~rl_tformers.runtime.protocol.Policy` of a DT.

N environments are served by one batched forward pass per step: the context window of each
(:mod:`~rl_tformers.agents.decision_transformer.context`: layout, return-to-go, timesteps) is
written, the model runs on it (:meth:`DTPolicy.forward`, the paper's algorithm), and the action
is read at the current step's state token (:meth:`DTPolicy.choose`: the mean, or a draw of the
Gaussian head). What inference adds on top wraps a :class:`DTPolicy` and changes how the next
action is produced (:class:`DTPolicyWrapper`): early exit at a calibrated threshold
(:class:`~rl_tformers.agents.decision_transformer.early_exit.EarlyExitPolicy`) and the kNN-LM
interpolation with a datastore
(:class:`~rl_tformers.agents.decision_transformer.knn_lm.KNNLMPolicy`).

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
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from rl_tformers.agents.common.policy import PolicyWrapper, check_return_targets, embedding_target_limit
from rl_tformers.agents.decision_transformer.context import (
    OVERFLOW_POLICIES,
    ContextWindow,
    DTState,
    acting_context_mask,
)
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTOutput
from torch import Tensor

from rl_tformers.runtime.eval_profile import span
from rl_tformers.runtime.evaluation import NonFiniteError


def _check_acting_options(model: DecisionTransformer, sample: bool, context_steps: int | None, align: str | None,
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
    align = align or ("start" if model.cfg.mode == "causal" else "end")
    if align not in ("start", "end") or (align == "start" and model.cfg.mode != "causal"):
        raise ValueError(f"DTPolicy: align={align!r}; use 'start' (causal mode only) or 'end'")
    if timestep_overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"timestep_overflow={timestep_overflow!r}; use one of {', '.join(OVERFLOW_POLICIES)}")
    return (None if context_steps is None or int(context_steps) == k else int(context_steps)), align


class ActingCounters:
    """What :meth:`DTPolicy.stats` reports: forward passes, their wall time and the decisions counted."""

    def __init__(self) -> None:
        self.steps = 0
        self.forward_s = 0.0
        self.decisions = 0

    def add(self, seconds: float, decisions: int) -> None:
        """One forward pass of ``seconds`` deciding ``decisions`` counted rows."""
        self.forward_s += seconds
        self.steps += 1
        self.decisions += decisions

    def as_dict(self) -> dict[str, float | int]:
        """``steps`` and, after a step, ``forward_ms_per_step``."""
        out: dict[str, float | int] = {"steps": int(self.steps)}  # a count: an int in the JSON
        if self.steps:
            out["forward_ms_per_step"] = 1000.0 * self.forward_s / self.steps
        return out


class Decision(NamedTuple):
    """The decision of N rows at their deciding state tokens (model units).

    Attributes:
        action: (N, A) float in [-1, 1] (continuous) or (N,) long class index (discrete).
        features: (N, D) the feature the action head read (``DTOutput.features``).
        logits: (N, n_actions) the head's logits (discrete), else None.
    """

    action: Tensor
    features: Tensor
    logits: Tensor | None


#: how a step's action is produced from the written context: (state, rows, slot, counted) -> Decision
Decide = Callable[[DTState, Tensor, Tensor, np.ndarray], Decision]


def check_finite_prediction(pred: Tensor, state: DTState, rtg_scale: float, counted: np.ndarray | None = None) -> None:
    """Raise (:class:`~rl_tformers.runtime.evaluation.NonFiniteError`) if the model's prediction
    ``pred`` (N, ...) of some row (of the ``counted`` (N,) bool ones, when given) is NaN/inf, naming
    its target, episode step and return-to-go: no action (a discrete argmax of NaN logits is an
    arbitrary class) is returned from it."""
    if bool(torch.isfinite(pred).all()):  # one reduction and one read on the host per step
        return
    bad = ~torch.isfinite(pred.reshape(pred.shape[0], -1)).all(dim=1)
    if counted is not None:
        bad &= torch.as_tensor(counted, device=bad.device)
    i = int(torch.nonzero(bad)[0, 0])
    raise NonFiniteError(
        f"Decision Transformer: the model's prediction is not finite (NaN/inf) for target return "
        f"{float(state.target[i]):g} at episode step {int(state.t[i])} (env {i}; return-to-go fed "
        f"{float(state.rtg_raw[i]):g} / reward scale {rtg_scale:g}); no action is taken from it"
    )


class DTPolicy:
    """Acts with a trained :class:`DecisionTransformer` in N environments at once: the plain DT.

    Args:
        model: the model (put in eval mode here).
        obs_mean, obs_std: (obs_dim,) observation statistics used in training.
        rtg_scale: divisor of returns-to-go, as in training (paper: 1000 for MuJoCo).
        action_low, action_high: (A,) bounds of a continuous action space (ignored when discrete).
        default_target: target return used when ``initial_state`` gets none.
        timestep_overflow: ``error`` or ``clamp``
            (:mod:`~rl_tformers.agents.decision_transformer.context`).
        device: where the model runs (default: the model's device).
        align: context layout, ``start`` or ``end`` (default: ``start`` in causal mode, ``end``
            in last_action mode); must match the training windows.
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
        deciding_step_only: causal mode: predict only each row's deciding step
            (``DecisionTransformer.forward(predict_at=slot)``): with a backbone that allows it
            (dense attention, fixed depth, pre/post-norm blocks) the last layer computes one state
            token per row instead of K (``docs/performance.md``, Evaluation). The actions equal
            the full forward's to float rounding (1e-6), but that rounding then depends on the
            number of rows acting together (BLAS libraries pick other GEMM kernels for products
            of few rows, e.g. MKL at most 10), so over a long episode of a chaotic task (Hopper)
            a batched and a one-at-a-time evaluation may part ways; off by default, so that they
            play the same episodes (what ``rl-tformers bench eval`` checks).

    :meth:`stats` reports, since the last :meth:`reset_stats`, the forward passes and their
    milliseconds per step (one call for all N environments); a :class:`DTPolicyWrapper` adds its own.

    Raises:
        ValueError: unknown option values, ``align="start"`` in last_action mode, missing
            action bounds for a continuous space, an ``action_shape`` that does not hold the
            model's A action values, ``sample`` without the gaussian head
            (``agent.head=gaussian``), ``context_steps`` not in [1, K].
    """

    #: the plain DT runs every layer and interpolates with no datastore; the wrappers
    #: (EarlyExitPolicy, KNNLMPolicy) report the threshold and datastore they act with
    exit_threshold: float | None = None
    knn: Any = None

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
        action_start: int = 0,
        action_shape: Sequence[int] | None = None,
        sample: bool = False,
        generator: torch.Generator | None = None,
        context_steps: int | None = None,
        deciding_step_only: bool = False,
    ) -> None:
        self.context_steps, self.align = _check_acting_options(model, sample, context_steps, align, timestep_overflow)
        self.sample = bool(sample)
        self.deciding_step_only = bool(deciding_step_only) and model.cfg.mode == "causal"
        self.generator = generator
        self.action_start = int(action_start)
        self._counted: np.ndarray | None = None  # count_rows: rows whose decisions stats() counts
        self.counters = ActingCounters()
        self.model = model.eval()
        self.cfg = model.cfg
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        f32 = dict(dtype=torch.float32, device=self.device)
        if not rtg_scale > 0:
            raise ValueError(f"DTPolicy: rtg_scale must be > 0, got {rtg_scale}")
        self.rtg_scale = float(rtg_scale)
        self.default_target = default_target
        self.timestep_overflow = timestep_overflow
        self.window = ContextWindow(
            self.cfg, self.align, torch.as_tensor(np.asarray(obs_mean, dtype=np.float32), **f32),
            torch.as_tensor(np.asarray(obs_std, dtype=np.float32), **f32), self.rtg_scale, timestep_overflow, self.device)
        if not self.cfg.discrete:
            if action_low is None or action_high is None:
                raise ValueError("DTPolicy: a continuous action space needs action_low and action_high")
            self.low = torch.as_tensor(np.asarray(action_low, dtype=np.float32), **f32)
            self.high = torch.as_tensor(np.asarray(action_high, dtype=np.float32), **f32)
            self._low_np, self._high_np = self.low.cpu().numpy(), self.high.cpu().numpy()
            with np.errstate(over="ignore"):  # an infinite width: the convex combination of _to_env
                self._span_np = self._high_np - self._low_np  # float32, as to_env_action's high - low
            self._wide_np = ~np.isfinite(self._span_np)
        self.action_shape = None if action_shape is None else tuple(int(k) for k in action_shape)
        if self.action_shape is not None and not self.cfg.discrete and math.prod(self.action_shape) != self.cfg.act_dim:
            raise ValueError(f"DTPolicy: action_shape={self.action_shape} does not hold the model's "
                             f"{self.cfg.act_dim} action values")

    @property
    def base(self) -> DTPolicy:
        """The plain DT policy under any wrappers: this one."""
        return self

    def count_rows(self, rows: np.ndarray | None) -> None:
        """Count only these rows' decisions in :meth:`stats` from the next :meth:`act` on.

        ``rows``: (N,) bool, False for rows whose actions the caller discards (the evaluation's
        idle environments past their episode quota); ``None``: every row (the default). The
        plain DT runs its model on the counted rows only (:meth:`decide`); with early exit the
        other rows' state tokens do not decide (they never exit, so they do not hold back the
        layer loop); the counted rows' actions are unchanged.
        """
        self._counted = None if rows is None else np.asarray(rows, dtype=bool).copy()

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`."""
        self.counters = ActingCounters()

    def stats(self) -> dict[str, float | int]:
        """Counters since :meth:`reset_stats`: ``steps`` (forward passes) and
        ``forward_ms_per_step`` (wall ms of one batched forward pass, with what a wrapper adds
        to it, e.g. the kNN search)."""
        return self.counters.as_dict()

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
        return self.window.empty(n_envs, float(target))

    @torch.no_grad()
    def act(
        self, obs: np.ndarray, state: DTState, episode_start: np.ndarray, last_reward: np.ndarray | None = None,
    ) -> tuple[np.ndarray, DTState]:
        """Actions for one step of N environments (one forward pass): :meth:`step` with :meth:`decide`.

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
        return self.step(obs, state, episode_start, last_reward, self.decide)

    @torch.no_grad()
    def step(self, obs: np.ndarray, state: DTState, episode_start: np.ndarray, last_reward: np.ndarray | None,
             decide: Decide) -> tuple[np.ndarray, DTState]:
        """One step of N environments whose action ``decide`` produces (this policy's
        :meth:`decide`, or a wrapper's): write step t into the context, decide (timed in
        :meth:`stats`), write the action into the context and map it to the environment's
        space. Arguments, returns and errors as :meth:`act`."""
        start = np.asarray(episode_start, dtype=bool)
        n = start.shape[0]
        with span("context"):
            t = self.window.advance(state, start, last_reward)
            rows, slot = self.window.write(state, obs, start, t)
        if self._counted is not None and self._counted.shape != (n,):
            raise ValueError(f"DTPolicy.act: count_rows was given {self._counted.shape[0]} rows but act got {n}; "
                             f"call count_rows(None) to count every row")
        counted = np.ones(n, bool) if self._counted is None else self._counted
        with span("forward"):
            t0 = time.perf_counter()
            a = decide(state, rows, slot, counted).action
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.counters.add(time.perf_counter() - t0, int(counted.sum()))
        with span("context"):
            self.window.write_action(state, rows, slot, a)
        with span("decode"):
            a_np = a.cpu().numpy()
            if self.cfg.discrete:  # class index -> environment action
                return a_np.astype(np.int64) + self.action_start, state
            env_a = self._to_env(a_np)  # (N, A) float32
        if self.action_shape is not None:
            env_a = env_a.reshape(n, *self.action_shape)
        return env_a, state

    def _to_env(self, a: np.ndarray) -> np.ndarray:
        """:func:`~rl_tformers.agents.decision_transformer.model.to_env_action` on the host: (N, A)
        float32 in [-1, 1] -> the box, the same float32 operations in the same order (the same values)."""
        low, high, width = self._low_np, self._high_np, self._span_np
        with np.errstate(all="ignore"):  # a dimension of infinite width takes the convex combination below
            x = low + 0.5 * (a + 1.0) * width
            if self._wide_np.any():
                x = np.where(self._wide_np, 0.5 * (1.0 - a) * low + 0.5 * (1.0 + a) * high, x)
        return np.minimum(np.maximum(x, low), high).astype(np.float32, copy=False)

    def decide(self, state: DTState, rows: Tensor, slot: Tensor, counted: np.ndarray) -> Decision:
        """The plain DT's decision: :meth:`forward` on the context, then :meth:`choose`.

        Args:
            state: the context with step t written (:meth:`step`).
            rows, slot: (N,) long, where step t of each row sits.
            counted: (N,) bool, the rows whose decisions :meth:`stats` counts. When only some
                are (:meth:`count_rows`: the evaluation's rows past their quota, whose actions
                are discarded), the model runs on those rows only and every other row gets a
                copy of the first counted row's decision (finite, in the action space).
        """
        live = np.flatnonzero(counted) if 0 < int(counted.sum()) < counted.shape[0] else None
        return self.choose(self.forward(state, slot, live), state, rows, slot, None if live is None else counted)

    def forward(self, state: DTState, slot: Tensor, live: np.ndarray | None = None) -> DTOutput:
        """The model over the acting context (Chen et al. 2021, algorithm 1): the window cut to
        ``context_steps`` (:func:`acting_context_mask`); predictions for every step (N, K, ...)
        (causal), or (N, 1, ...) at each row's deciding step only: ``slot`` (N,) with
        ``deciding_step_only`` (``DecisionTransformer.forward(predict_at=slot)``, whose last
        layer then computes one state token per row), or the last step (last_action).

        ``live``: (L,) indices of the rows to run the model on (None: all N); the output keeps N
        rows, the others copies of row ``live[0]``'s."""
        at = slot if self.deciding_step_only else None
        if live is None:
            mask = acting_context_mask(state.mask, slot, self.context_steps)
            return self.model(state.obs, state.actions, state.rtg, state.timesteps, mask, predict_at=at)
        idx = torch.as_tensor(live, device=self.device)
        obs, actions, rtg, timesteps, mask = self.window.inputs(state.view[idx])  # laid out as the full batch's
        mask = acting_context_mask(mask, slot[idx], self.context_steps)
        out = self.model(obs, actions, rtg, timesteps, mask, predict_at=None if at is None else at[idx])
        src = np.zeros(state.mask.shape[0], np.int64)  # row i's row of the L computed ones
        src[live] = np.arange(len(live))
        return out.take_rows(torch.as_tensor(src, device=self.device))

    def choose(self, out: DTOutput, state: DTState, rows: Tensor, slot: Tensor,
               counted: np.ndarray | None = None) -> Decision:
        """The action at each row's deciding state token of ``out``: the head's mean (argmax
        for discrete) or, with ``sample``, a draw of the tanh-squashed Gaussian.

        Args:
            out: the model's predictions for every step (N, K, ...), read at ``(rows, slot)``,
                or at the deciding step only (N, 1, ...: ``deciding_step_only``, last_action mode).
            state: the context (named in errors).
            rows, slot: (N,) long, where step t of each row sits.
            counted: (N,) bool, the rows a non-finite prediction is looked for in (None: all;
                the others are copies of counted rows, :meth:`forward` with ``live``).

        Raises:
            NonFiniteError: (a ValueError) the prediction of some row is NaN/inf.
        """
        p = (rows, slot) if out.action.shape[1] > 1 else (slice(None), 0)  # the deciding state token
        a = out.action[p]  # (N, A) or (N,)
        if self.sample:  # a draw of the tanh-squashed Gaussian instead of its mean
            mean, log_std = out.mean[p], out.log_std[p]  # (N, A)
            eps = torch.randn(mean.shape, generator=self.generator, device=mean.device, dtype=mean.dtype)
            a = torch.tanh(mean + log_std.exp() * eps)
        logits = out.logits[p] if self.cfg.discrete else None
        check_finite_prediction(a if logits is None else logits, state, self.rtg_scale, counted)
        return Decision(a, out.features[p], logits)

class DTPolicyWrapper(PolicyWrapper):
    """A :class:`DTPolicy` (or another wrapper) whose next action is produced differently.

    :meth:`act` runs the plain policy's :meth:`DTPolicy.step` (the context, the timing, the
    action mapping) with this wrapper's :meth:`decide`; every other member of the policy
    protocol (``initial_state``, ``count_rows``, ``check_targets``, ...) is the wrapped policy's
    (:class:`~rl_tformers.agents.common.policy.PolicyWrapper`).
    Subclasses implement :meth:`decide`, :meth:`own_stats` and :meth:`reset_own_stats`.

    Args:
        policy: the wrapped policy (:attr:`inner`).
    """

    @torch.no_grad()
    def act(
        self, obs: np.ndarray, state: DTState, episode_start: np.ndarray, last_reward: np.ndarray | None = None,
    ) -> tuple[np.ndarray, DTState]:
        """As :meth:`DTPolicy.act`, each action produced by :meth:`decide`."""
        return self.base.step(obs, state, episode_start, last_reward, self.decide)

    @abstractmethod
    def decide(self, state: DTState, rows: Tensor, slot: Tensor, counted: np.ndarray) -> Decision:
        """The decision of this step (arguments as :meth:`DTPolicy.decide`)."""
