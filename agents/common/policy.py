"""The protocol every agent's inference side implements, so one evaluation loop serves all.

It follows Stable-Baselines3's recurrent API (``predict(obs, state, episode_start)``) with one
addition: the raw reward of the previous step, which return-conditioned agents (DT) need to
update their return-to-go. Evaluation runs N gymnasium vector environments and calls ``act``
once per step for all of them (one batched forward pass).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor


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


# -- return targets of return-conditioned policies (DT, GTrXL rcbc) --------------------------------


def embedding_target_limit(w: Tensor, offset: float, rtg_scale: float, share: float = 1.0) -> float:
    """Largest ``|target return|`` (raw reward units) whose scaled return-to-go a linear input
    embedding takes without overflowing float32 downstream.

    ``rtg_scale * (share * M - offset) / max|w|`` with ``M = sqrt(fmax / d) / 4``: an embedded
    vector whose entries stay below M has a sum of squares below ``fmax / 16``, so the LayerNorm
    that follows the embedding cannot overflow. ``fmax`` is float32's maximum (or ``w``'s dtype's,
    if smaller).

    Args:
        w: (d,) the embedding's weights on the return-to-go input (any float dtype).
        offset: largest ``|entry|`` the other terms (bias, other inputs) may add to an embedded
            entry, in embedding units.
        rtg_scale: the reward scale the return-to-go is divided by (return units per RTG unit).
        share: the fraction of M the return-to-go may use (GTrXL leaves half to its other inputs).

    Returns:
        The limit in raw return units; ``inf`` when ``w`` is all zeros, 0 when ``offset`` alone
        exceeds ``share * M``.

    Source: the derivation in the module docstrings of the DT policy and GTrXL agent.
    """
    fmax = min(torch.finfo(torch.float32).max, torch.finfo(w.dtype).max)
    w = w.detach().float().reshape(-1)
    bound = share * (math.sqrt(fmax / w.numel()) / 4)
    w_max = float(w.abs().max())
    if w_max == 0.0:
        return math.inf
    return max(0.0, (bound - float(offset)) / w_max) * rtg_scale


def check_return_targets(
    targets: Sequence[float | None], option: str, limit: Callable[[], float], rtg_scale: float, embedding: str
) -> None:
    """Refuse return targets a return-conditioned policy cannot take.

    Args:
        targets: raw target returns (reward units); ``None`` entries (the policy's default
            target, checked where it is set) are skipped.
        option: what to name in the message (``--targets``, ``agent.targets``, ...).
        limit: returns the policy's largest ``|target|`` (:func:`embedding_target_limit`); called
            once, at the first finite target.
        rtg_scale: the reward scale (named in the message).
        embedding: what overflows, for the message (e.g. ``"the return embedding's weights may
            overflow float32 in the embedding LayerNorm"``).

    Raises:
        ValueError: a target that is not a number, not finite, or with ``|target| > limit()``;
            the message names ``option``, the target and the limit.
    """
    bound = None
    for t in targets:
        if t is None:
            continue
        try:
            t = float(t)
        except (TypeError, ValueError):
            raise ValueError(f"{option}: {t!r} is not a number (a target return, raw units)") from None
        if not math.isfinite(t):
            raise ValueError(f"{option}: {t!r} is not a finite number")
        bound = limit() if bound is None else bound
        if abs(t) > bound:
            raise ValueError(
                f"{option}: {t:g} is beyond what this model takes: |target| must be at most "
                f"{bound:.3g}, or the return-to-go (target / reward scale {rtg_scale:g}) times "
                f"{embedding} and give NaN actions"
            )
