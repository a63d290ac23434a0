"""Early exit for the Decision Transformer at inference: the acting wrapper, held-out episodes and
threshold calibration.

A DT whose backbone has depth kind ``early_exit`` trains its head on every layer's output
(:mod:`rl_tformers.depth.early_exit`); acting, it can stop after the first layer whose prediction
is confident (:meth:`~rl_tformers.agents.decision_transformer.model.DecisionTransformer.forward_early_exit`).
The confidence threshold is calibrated on episodes held out from training (CALM, Schuster et al.
2022, sec. 4): the smallest threshold whose early actions agree with the full model's on
held-out decisions, with Learn-then-Test guarantees (:func:`~rl_tformers.depth.early_exit.calibrate_threshold`).
:class:`EarlyExitPolicy` wraps a :class:`~rl_tformers.agents.decision_transformer.policy.DTPolicy`
and acts with that threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.decision_transformer.context import DTState, acting_context_mask
from rl_tformers.agents.decision_transformer.model import DecisionTransformer
from rl_tformers.agents.decision_transformer.policy import Decision, DTPolicy, DTPolicyWrapper
from torch import Tensor

from rl_tformers.depth.early_exit import Calibration, calibrate_threshold

#: thresholds tested by default: 0, 0.05, ..., 1
DEFAULT_CANDIDATES = tuple(i / 20 for i in range(21))


class EarlyExitPolicy(DTPolicyWrapper):
    """A :class:`DTPolicy` that acts with early exit (depth kind ``early_exit``).

    Each step's forward pass is
    :meth:`~rl_tformers.agents.decision_transformer.model.DecisionTransformer.forward_early_exit`
    on the policy's acting context: only the current step's state token of the counted rows
    (``DTPolicy.count_rows``) decides, and the layer loop stops once every one of them exited at
    ``threshold``. The action is then chosen as the plain policy chooses it (mean or draw).
    :meth:`stats` adds ``exit_mean_layer`` (1-based) and ``exit_early_frac``, means over the
    counted decisions.

    Args:
        policy: the plain DT policy (early exit changes its forward pass, so it wraps no other
            wrapper; a :class:`~rl_tformers.agents.decision_transformer.knn_lm.KNNLMPolicy` goes
            on top of it).
        threshold: the confidence threshold (``None``: the backbone's stored one, +inf unless
            calibrated or configured; +inf runs every layer).

    Raises:
        TypeError: ``policy`` is not a :class:`DTPolicy`.
        ValueError: the model's depth kind is not ``early_exit``.
    """

    def __init__(self, policy: DTPolicy, threshold: float | None = None) -> None:
        if not isinstance(policy, DTPolicy):
            raise TypeError(f"EarlyExitPolicy wraps a DTPolicy (it changes the forward pass), got {type(policy).__name__}")
        if not policy.model.early_exit:
            raise ValueError("EarlyExitPolicy: exit_threshold needs backbone.depth.kind=early_exit")
        super().__init__(policy)
        self.exit_threshold = threshold
        self.reset_own_stats()

    def decide(self, state: DTState, rows: Tensor, slot: Tensor, counted: np.ndarray) -> Decision:
        """The plain policy's choice from an early-exit forward pass (arguments as
        :meth:`DTPolicy.decide`); the exit layers of the counted rows go to :meth:`stats`."""
        pol = self.inner
        decide = torch.zeros_like(state.mask)  # (N, K): the current step decides
        decide[rows, slot] = torch.as_tensor(counted, device=decide.device)  # (rows whose decisions count)
        mask = acting_context_mask(state.mask, slot, pol.context_steps)
        out = pol.model.forward_early_exit(state.obs, state.actions, state.rtg, state.timesteps, mask,
                                           exit_steps=decide, exit_threshold=self.exit_threshold)
        d = pol.choose(out, state, rows, slot)
        n = int(counted.sum())
        self.decisions += n
        self.exit_layer_sum += float(out.metrics["exit/mean_layer"]) * n
        self.early_sum += float(out.metrics["exit/early_frac"]) * n
        return d

    def own_stats(self) -> dict[str, Any]:
        """``exit_mean_layer`` and ``exit_early_frac`` once a decision was counted."""
        if not self.decisions:
            return {}
        return {"exit_mean_layer": self.exit_layer_sum / self.decisions, "exit_early_frac": self.early_sum / self.decisions}

    def reset_own_stats(self) -> None:
        """Zero the decisions and their exit layers."""
        self.decisions = 0
        self.exit_layer_sum = 0.0
        self.early_sum = 0.0


def heldout_mask(num_episodes: int, frac: float, enabled: bool) -> np.ndarray:
    """(episodes,) bool: the calibration episodes, never trained on.

    Every ``round(1 / frac)``-th episode (the last of each group), so the split is deterministic
    and spread over the dataset; none when ``frac`` is 0, there are fewer than 2 episodes or
    early exit is not ``enabled`` (the depth kind is not ``early_exit``).
    """
    if not enabled or frac <= 0 or num_episodes < 2:
        return np.zeros(num_episodes, dtype=bool)
    every = max(2, round(1.0 / frac))
    return (np.arange(num_episodes) % every) == every - 1


@torch.no_grad()
def calibrate_exit_threshold(
    model: DecisionTransformer, batch: Mapping[str, Tensor], *, context_steps: int | None, tol: float,
    delta: float, epsilon: float, candidates: Sequence[float] | None = None, chunk: int = 512,
) -> tuple[float | None, Calibration]:
    """The exit threshold calibrated on windows of held-out episodes (CALM sec. 4).

    In each window only the last real step decides, as when acting (its window holds the K steps
    up to it, cut to the acting context). A decision is consistent when the early-exit action
    equals the full model's (discrete) or is within ``tol`` in every dimension (continuous,
    normalised units); the smallest candidate whose inconsistency is <= ``delta`` with
    probability >= 1 - ``epsilon`` is picked.

    Args:
        model: a DT with depth kind ``early_exit``; left in the training mode it had.
        batch: model-unit windows (``obs`` (W, K, O), ``actions``, ``rtg``, ``timesteps``, ``mask`` (W, K)).
        context_steps: the acting context (``agent.eval_context_len``; None: K).
        tol, delta, epsilon, candidates: as above (candidates default :data:`DEFAULT_CANDIDATES`).
        chunk: windows per forward pass.

    Returns:
        (threshold, calibration): None when no candidate passed (the full model).
    """
    mask = batch["mask"]
    dev = mask.device
    k = mask.shape[1]
    last = k - 1 - mask.flip(1).long().argmax(1)  # (W,) slot of the last real step
    decide = torch.zeros_like(mask)
    decide[torch.arange(mask.shape[0], device=dev), last] = True
    mask = acting_context_mask(mask, last, context_steps)  # the context the policy reads when acting
    was = model.training
    model.eval()
    args = (batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], mask)
    chunks = [slice(i, i + chunk) for i in range(0, mask.shape[0], chunk)]

    def decisions(threshold: float | None) -> Tensor:
        out = []
        for c in chunks:
            o = model.forward_early_exit(*(x[c] for x in args), exit_steps=decide[c], exit_threshold=threshold)
            out.append(o.action[:, -1] if model.cfg.mode == "last_action"
                       else o.action[torch.arange(o.action.shape[0], device=dev), last[c]])  # (w, A) or (w,)
        return torch.cat(out)

    full = decisions(None)

    def consistent(threshold: float) -> Tensor:
        a = decisions(threshold)
        return (a == full) if model.cfg.discrete else ((a - full).abs().amax(-1) <= tol)

    cands = list(DEFAULT_CANDIDATES) if candidates is None else list(candidates)
    cal = calibrate_threshold(consistent, cands, delta=delta, epsilon=epsilon)
    model.train(was)
    return (None if math.isinf(cal.threshold) else float(cal.threshold)), cal
