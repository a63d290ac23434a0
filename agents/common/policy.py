"""The protocol every agent's inference side implements, so one evaluation loop serves all.

It follows Stable-Baselines3's recurrent API (``predict(obs, state, episode_start)``) with one
addition: the raw reward of the previous step, which return-conditioned agents (DT) need to
update their return-to-go. Evaluation runs N gymnasium vector environments and calls ``act``
once per step for all of them (one batched forward pass).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Policy(Protocol):
    """Inference interface of an agent.

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
