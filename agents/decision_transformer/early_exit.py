"""Early exit for the Decision Transformer at inference: held-out episodes and threshold calibration.

A DT whose backbone has depth kind ``early_exit`` trains its head on every layer's output
(:mod:`rl_tformers.depth.early_exit`); acting, it can stop after the first layer whose prediction
is confident (:meth:`~rl_tformers.agents.decision_transformer.model.DecisionTransformer.forward_early_exit`).
The confidence threshold is calibrated on episodes held out from training (CALM, Schuster et al.
2022, sec. 4): the smallest threshold whose early actions agree with the full model's on
held-out decisions, with Learn-then-Test guarantees (:func:`~rl_tformers.depth.early_exit.calibrate_threshold`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from rl_tformers.agents.decision_transformer.model import DecisionTransformer
from rl_tformers.agents.decision_transformer.policy import acting_context_mask
from torch import Tensor

from rl_tformers.depth.early_exit import Calibration, calibrate_threshold

#: thresholds tested by default: 0, 0.05, ..., 1
DEFAULT_CANDIDATES = tuple(i / 20 for i in range(21))


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
