"""Return targets of return-conditioned policies (DT, GTrXL rcbc): how large a target the
return embedding takes, and the check that refuses larger ones. The acting protocol itself is
:class:`rl_tformers.runtime.protocol.Policy`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

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


class PolicyWrapper(ABC):
    """A policy (or another wrapper) whose next action is produced differently: what the agents'
    inference wrappers share (the DT's :class:`~rl_tformers.agents.decision_transformer.policy.DTPolicyWrapper`,
    GTrXL's :class:`~rl_tformers.agents.gtrxl.replay.GTrXLPolicyWrapper`).

    Every member of the policy protocol the wrapper does not define (``initial_state``,
    ``count_rows``, ``check_targets``, ...) is the wrapped policy's; :meth:`stats` adds the
    wrapper's counters (:meth:`own_stats`) to the wrapped policy's. Subclasses implement ``act``,
    :meth:`own_stats` and :meth:`reset_own_stats`.

    Args:
        policy: the wrapped policy (:attr:`inner`), which has a ``base`` (the plain policy).
    """

    def __init__(self, policy: Any) -> None:
        self.inner = policy

    @property
    def base(self) -> Any:
        """The plain policy under every wrapper."""
        return self.inner.base

    @abstractmethod
    def own_stats(self) -> dict[str, float | int]:
        """This wrapper's counters (merged into :meth:`stats`)."""

    @abstractmethod
    def reset_own_stats(self) -> None:
        """Zero this wrapper's counters."""

    def stats(self) -> dict[str, float | int]:
        """The wrapped policy's counters, then this wrapper's."""
        return {**self.inner.stats(), **self.own_stats()}

    def reset_stats(self) -> None:
        """Zero the counters of :meth:`stats`, the wrapped policy's included."""
        self.inner.reset_stats()
        self.reset_own_stats()

    def __getattr__(self, name: str) -> Any:  # the rest of the policy protocol: the wrapped policy's
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class InferenceOptions:
    """What an agent's inference options (early exit, kNN-LM datastore) share: the exit threshold
    in use, the datastore and the threshold it was built for, saved and put back as one."""

    exit_threshold: float | None
    knn_memory: Any
    _knn_for: Any

    def snapshot(self) -> tuple[Any, ...]:
        """The current options (for :meth:`restore`)."""
        return self.exit_threshold, self.knn_memory, self._knn_for

    def restore(self, saved: tuple[Any, ...]) -> None:
        """Put back the options of a :meth:`snapshot`."""
        self.exit_threshold, self.knn_memory, self._knn_for = saved
