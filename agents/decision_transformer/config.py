"""Options of the Decision Transformer agent (``agent.kind=dt``), typed and checked.

:class:`DTAgentConfig` is the ``agent:`` section of a run config; ``rl-tformers agents dt``
lists its fields with their defaults and docs. Each field is checked against its type and
range when the section is read (:meth:`~rl_tformers.typed_config.TypedConfig.from_dict`), before
any data is read, so a bad value is refused with one line naming ``agent.<key>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_tformers.agents.common.encoders import EncoderConfig
from rl_tformers.agents.common.encoders.flat import LinearEncoderConfig
from rl_tformers.agents.common.knn_memory import METRICS
from rl_tformers.agents.decision_transformer.model import EMBED_INITS, MODES
from rl_tformers.agents.decision_transformer.policy import OVERFLOW_POLICIES

from rl_tformers.depth.early_exit import SCHEMES
from rl_tformers.runtime.evaluation import repeated_target
from rl_tformers.typed_config import ConfigFieldError, TypedConfig, check_value, option

#: words of ``agent.early_exit.threshold`` that mean the full model
FULL_MODEL_WORDS = ("none", "off")
#: |agent.log_std_min|, |agent.log_std_max| at most this: exp(2 log_std), the gaussian head's
#: variance, stays a normal float32 (exp(-87.3) is the smallest, exp(88.7) the largest)
LOG_STD_BOUND = 40.0


@dataclass(frozen=True)
class EarlyExitOptions(TypedConfig):
    """``agent.early_exit``: used with ``backbone.depth.kind=early_exit`` only (docs/memory_adaptive.md)."""

    scheme: str = option("sampled", "exits the head is trained on: sampled (one random exit per step), weighted "
                         "or uniform", choices=SCHEMES)
    tol: float = option(0.1, "continuous actions: exit n agrees with the last layer when max |a^n - a^N| <= tol "
                        "(normalised action units)", ge=0)
    heldout_frac: float = option(0.05, "episodes kept out of training to calibrate the threshold (every "
                                 "round(1/heldout_frac)-th; 0: none)", ge=0, le=0.5)
    threshold: float | str | None = option(None, "evaluation threshold: null or 'none' (full model), a "
                                           "confidence (0 exits after layer 1, above 1 never early), or "
                                           "'calibrate'", ge=0, choices=("calibrate", *FULL_MODEL_WORDS))
    delta: float = option(0.1, "calibration: tolerated inconsistency with the full model", gt=0, lt=1)
    epsilon: float = option(0.05, "calibration: failure probability (Learn-then-Test, Hoeffding)", gt=0, lt=1)
    windows: int = option(2000, "calibration: held-out decisions", ge=1)

    def __post_init__(self) -> None:
        if self.threshold in FULL_MODEL_WORDS:
            object.__setattr__(self, "threshold", None)


def exit_threshold(value: Any, key: str) -> float | str | None:
    """An early-exit threshold given outside the config (``rl-tformers eval --early-exit``), held to
    ``agent.early_exit.threshold``'s type and range: a number (or a string that reads as one),
    ``'calibrate'``, or ``'none'`` / ``'off'`` / None (the full model, returned as None).

    Raises:
        ConfigFieldError: naming ``key``, e.g. ``--early-exit must be ..., got -0.5``.
    """
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = value.strip().lower()
    value = check_value(EarlyExitOptions, "threshold", value, key)
    return None if value in FULL_MODEL_WORDS else value


@dataclass(frozen=True)
class KNNOptions(TypedConfig):
    """``agent.knn``: the kNN-LM action memory at evaluation (agents/common/knn_memory.py)."""

    lam: float = option(0.0, "weight of the neighbours' action (0: off)", ge=0, le=1)
    k: int = option(16, "neighbours per query", ge=1)
    temperature: float = option(1.0, "distance temperature of the neighbour weights", gt=0)
    max_entries: int = option(100000, "largest datastore (a seeded uniform subset of the dataset's steps)", ge=1)
    metric: str = option("l2", "distance of the datastore", choices=METRICS)


@dataclass(frozen=True)
class DTAgentConfig(TypedConfig):
    """``agent:`` of ``agent.kind=dt``; defaults are the paper's for MuJoCo (Chen et al. 2021, table 8).

    Raises (on construction):
        ConfigFieldError: a field of the wrong type or out of range; ``log_std_max`` not above
            ``log_std_min``; ``eval_context_len`` above
            ``context_len``; ``align=start`` with ``mode=last_action``; ``targets`` empty or with
            a target given twice.
    """

    context_len: int = option(20, "K, steps per window", ge=1)
    max_ep_len: int = option(1000, "timestep embedding size; episodes must not be longer", ge=1)
    mode: str = option("causal", "causal, or last_action for kernels without a causal form", choices=MODES)
    align: str = option("auto", "training windows and acting context: auto (start if causal, else end), start "
                        "or end", choices=("auto", "start", "end"))
    head: str = option("deterministic", "action head: deterministic (tanh, MSE) or gaussian (Online DT)",
                       choices=("deterministic", "gaussian"))
    embed_dropout: float = option(0.1, "dropout after the embedding LayerNorm", ge=0, lt=1)
    embed_init: str = option("gpt2", "embeddings and action head init: gpt2 (N(0, 0.02)) or paper (official "
                             "code)", choices=EMBED_INITS)
    log_std_min: float = option(-5.0, "gaussian head: lower bound of the log standard deviation (exp(2 log_std) "
                                "stays a normal float32)", ge=-LOG_STD_BOUND, le=LOG_STD_BOUND)
    log_std_max: float = option(2.0, "gaussian head: upper bound of the log standard deviation",
                                ge=-LOG_STD_BOUND, le=LOG_STD_BOUND)
    init_temperature: float = option(0.1, "gaussian head: initial entropy temperature", gt=0)
    target_entropy: float | None = option(None, "gaussian head: target entropy; null = -act_dim")
    reward_scale: str | float = option("auto", "divisor of returns-to-go: auto = power of ten at or below the "
                                       "largest |episode return|, at most 1000 (the paper's MuJoCo scale)", gt=0, choices=("auto",))
    normalize_obs: bool = option(True, "standardise flat observations with the dataset's mean/std (image "
                                 "observations are scaled by 1/255 in the encoder instead)")
    encoder: EncoderConfig = option(factory=LinearEncoderConfig, doc="observation encoder")
    targets: tuple[float, ...] | float | None = option(None, "evaluation target returns, raw units; null = "
                                                       "[dataset best]")
    timestep_overflow: str = option("error", "evaluation episode steps >= max_ep_len: error or clamp",
                                    choices=OVERFLOW_POLICIES)
    eval_context_len: int | None = option(None, "steps of context read when acting (the last min(t + 1, "
                                          "eval_context_len)); null = context_len", ge=1)
    deciding_step_only: bool = option(False, "acting (causal mode): the last layer computes only each row's "
                                      "deciding step, 1.17-1.18x per act() call (docs/performance.md); off: every "
                                      "window step, whose actions do not depend on how many environments act "
                                      "together (batched GEMM rounding does)")
    env_id: str | None = option(None, "evaluation environment; null = the dataset's")
    env_kwargs: dict | None = option(None, "gym.make keyword arguments of the evaluation environment")
    eval_figure: bool = option(True, "log the return-conditioning figure at each evaluation")
    early_exit: EarlyExitOptions = option(factory=EarlyExitOptions, doc="early exit (backbone.depth.kind=early_exit)")
    knn: KNNOptions = option(factory=KNNOptions, doc="kNN-LM action memory at evaluation")

    def __post_init__(self) -> None:
        if self.log_std_min >= self.log_std_max:
            raise ConfigFieldError("log_std_max", f"must be above agent.log_std_min={self.log_std_min:g} (the gaussian "
                                                  f"head's log standard deviation lies between them), got "
                                                  f"{self.log_std_max:g}")
        if self.eval_context_len is not None and self.eval_context_len > self.context_len:
            raise ConfigFieldError(
                "eval_context_len", f"must be at most agent.context_len={self.context_len} (the steps of context "
                                    f"read when acting) or null (all K), got {self.eval_context_len}")
        if self.align == "start" and self.mode != "causal":
            raise ConfigFieldError("align", "=start needs agent.mode=causal; use auto or end", sep="")
        if self.targets is not None:
            targets = self.targets if isinstance(self.targets, tuple) else (self.targets,)
            if not targets:
                raise ConfigFieldError("targets", "must be a target return or a non-empty list of them (raw reward "
                                                  "units, e.g. [3600, 1800]) or null for the dataset's best return, "
                                                  "got []")
            twice = repeated_target([float(t) for t in targets])
            if twice is not None:
                i, j = twice
                raise ConfigFieldError(
                    "targets", f": the target {float(targets[i]):g} is given twice (items {i + 1} and {j + 1}); give "
                               f"each target once: each is evaluated on the same episodes and is one point of the "
                               f"return-conditioning plot", sep="")
            object.__setattr__(self, "targets", tuple(float(t) for t in targets))

    @property
    def acting_context(self) -> int | None:
        """Steps of context the policy reads when acting; None: the whole window (K)."""
        return None if self.eval_context_len in (None, self.context_len) else self.eval_context_len


@dataclass(frozen=True)
class OnlineOptions(TypedConfig):
    """``agent.online``: the online phase of Online DT (Zheng et al. 2022)."""

    buffer_size: int = option(1000, "trajectories in the replay buffer (paper: 1000)", ge=1)
    rollouts_per_round: int = option(1, "complete episodes collected per round (paper: 1; 0: the "
                                     "offline-continuation control, no rollouts)", ge=0)
    updates_per_round: int = option(300, "gradient updates per round (paper: 300)", ge=1)
    target_return: float | None = option(None, "exploration return-to-go g_online, raw units; null = t + |t| for "
                                         "the evaluation target t (2t if t >= 0)")
    n_envs: int = option(1, "vector environments acting together (at most rollouts_per_round are used)", ge=1)


@dataclass(frozen=True)
class ODTAgentConfig(DTAgentConfig):
    """``agent:`` of ``agent.kind=odt``: the DT's options (the model and data ones are taken from the
    offline run, :data:`~rl_tformers.agents.decision_transformer.online.OFFLINE_AGENT_KEYS`) plus
    the offline run to fine-tune and the online phase."""

    head: str = option("gaussian", "action head (the offline run's is used: gaussian)",
                       choices=("deterministic", "gaussian"))
    init_from: str | None = option(None, "required: an offline dt run directory (its newest valid checkpoint) or "
                                   "a checkpoint file")
    online: OnlineOptions = option(factory=OnlineOptions, doc="the online phase")
