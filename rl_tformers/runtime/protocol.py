"""The agent protocol: everything ``train``, ``eval``, ``plot`` and ``sweep`` know of an agent.

An agent kind is one call to :func:`rl_tformers.runtime.agent_registry.register_agent`::

    @register_agent("my_agent", description="...", config_cls=MyConfig)
    def build(cfg, run_dir, device) -> MyAgent: ...

and, optionally, one inference loader
(:func:`rl_tformers.runtime.loading.register_inference_loader`) that rebuilds the agent from a
checkpoint without reading its dataset. Nothing else is imported from an agent's package: the
commands work on the objects these protocols describe.

Training side (:class:`Trainable`)
    ``model`` (the ``nn.Module`` the optimiser trains), ``loss(batch) -> (loss, logs)`` and
    ``batches(start_step)``; the optional members (``param_groups``, ``evaluate``,
    ``extra_state``...) are listed in :mod:`rl_tformers.runtime.agent_registry`.
    ``evaluate(step)`` returns ``report_logs(report)`` of an
    :class:`~rl_tformers.runtime.evaluation.EvalReport` seeded with
    :func:`~rl_tformers.runtime.evaluation.eval_seed` (plus figures, if any).

Inference side (:class:`EvaluableAgent`)
    ``policy()`` returns a :class:`Policy`; ``make_env()`` a zero-argument environment factory;
    ``default_targets()`` the target returns evaluated and plotted when none are given
    (``[None]`` for an agent that is not return-conditioned). Optional:
    ``inference_setup(**options) -> dict`` (inference-time options such as early exit; the dict
    goes into the report's ``extra``), ``check_targets(targets, option=...)`` (refuse targets
    the policy cannot take, raising ``ValueError``), ``eval_context_len`` with
    ``options.replace(eval_context_len=n).acting_context`` (agents acting on a window),
    ``targets_option`` (the config key holding the default targets, for messages),
    ``info.normalizer()`` (raw returns to D4RL-normalised scores), keyword options of
    ``policy(**options)`` such as ``timestep_overflow`` (:func:`policy_options`).

Typed configuration
    ``config_cls``: a frozen dataclass (:class:`~rl_tformers.typed_config.TypedConfig`) of the
    kind's ``agent:`` section, registered with the kind; ``compose`` checks the section with it.

Loading for inference
    :func:`rl_tformers.runtime.loading.load_run` reads a checkpoint and rebuilds the agent with
    the kind's inference loader, or with its builder plus ``model.load_state_dict`` and
    ``load_extra_state``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor, nn


@runtime_checkable
class Policy(Protocol):
    """Acting interface of an agent (Stable-Baselines3's recurrent ``predict(obs, state,
    episode_start)`` plus the previous step's raw reward, which return-conditioned agents use to
    update their return-to-go).

    ``state`` is opaque to the caller (a context window, a backbone memory state...) and is
    never stored on the policy object, so one policy serves any number of environments.
    """

    def initial_state(self, n_envs: int, target_return: float | None = None) -> Any:
        """State for ``n_envs`` fresh episodes.

        Args:
            n_envs: N, number of parallel environments.
            target_return: desired episode return in raw (unscaled) reward units, for
                return-conditioned agents; ignored by others.
        """
        ...

    def act(
        self,
        obs: np.ndarray,
        state: Any,
        episode_start: np.ndarray,
        last_reward: np.ndarray | None = None,
    ) -> tuple[np.ndarray, Any]:
        """Actions for one step of N environments.

        Args:
            obs: (N, *obs_shape) raw observations (the policy normalises them itself).
            state: from :meth:`initial_state` or the previous call.
            episode_start: (N,) bool, True where ``obs`` is the first observation of a new
                episode (that row's state must be reset before acting).
            last_reward: (N,) raw reward received after the previous action of each row
                (ignored where ``episode_start``); ``None`` on the very first call.

        Returns:
            actions (N, *act_shape) in the environment's action space, and the next state.
        """
        ...


@runtime_checkable
class Trainable(Protocol):
    """What a registered builder returns; the trainer drives it (the optional members are
    listed in :mod:`rl_tformers.runtime.agent_registry`)."""

    model: nn.Module

    def loss(self, batch: Any) -> tuple[Tensor, Mapping[str, float | Tensor]]:
        """Loss to minimise (0-dim tensor, mean over the batch) and extra scalars to log."""
        ...

    def batches(self, start_step: int) -> torch.utils.data.Dataset | Iterable[Any]:
        """Step-indexed dataset or iterable of batches starting at ``start_step``; the batch of
        step ``s`` is a pure function of ``(cfg.seed, s)``."""
        ...


@runtime_checkable
class EvaluableAgent(Protocol):
    """What ``eval`` and ``plot`` need from an agent object.

    Members:
        model: the trained ``nn.Module``.
        policy(): a :class:`Policy` of the current weights.
        make_env(): zero-argument factory of one evaluation environment (``gymnasium.Env``).
        default_targets(): target returns (raw reward units) to evaluate when none are given;
            ``[None]`` for agents that are not return-conditioned.
    """

    model: nn.Module

    def policy(self) -> Policy: ...

    def make_env(self) -> Callable[[], Any]: ...

    def default_targets(self) -> list[float | None]: ...


#: builder(cfg, run_dir, device) -> Trainable: ``cfg`` the resolved read-only run config,
#: ``run_dir`` where the run writes, ``device`` the training device
AgentBuilder = Callable[[Any, Path, torch.device], Trainable]

#: loader(cfg, checkpoint_state, device) -> EvaluableAgent: rebuilds an agent for inference
#: from a verified checkpoint dict alone (no dataset read)
InferenceLoader = Callable[[Any, Mapping[str, Any], torch.device], EvaluableAgent]

#: the members :class:`EvaluableAgent` requires to be callable
EVALUABLE_METHODS = ("policy", "make_env", "default_targets")


def policy_options(agent: Any) -> frozenset[str]:
    """The keyword options ``agent.policy(**options)`` accepts (e.g. ``timestep_overflow``), read
    from its signature; empty for a ``policy()`` without parameters."""
    try:
        params = inspect.signature(agent.policy).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return frozenset()
    return frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
