"""Early exit for GTrXL at acting time: the policy wrapper and threshold calibration.

A GTrXL whose backbone has depth kind ``early_exit`` trains its actor on every layer's output and
its exit classifier on agreement with the last layer (:func:`~rl_tformers.agents.gtrxl.loss.exit_terms`).
Acting, each environment's new step exits after the first layer whose confidence reaches the
threshold (CALM, Schuster et al. 2022, sec. 3): its state there is its output, and it is copied
to every layer above (CALM's state propagation, sec. 3.3), so the Transformer-XL memory of each
skipped layer stores the exited state for the later steps to attend to
(:class:`~rl_tformers.depth.early_exit.EarlyExitDepth`). The layer loop stops once every
environment's step exited: the saving. The threshold is calibrated on episodes held out from
training (CALM sec. 4, Learn-then-Test): :func:`calibrate_exit_threshold`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from rl_tformers.agents.decision_transformer.early_exit import DEFAULT_CANDIDATES
from rl_tformers.agents.gtrxl.loss import SegmentBatch
from rl_tformers.agents.gtrxl.model import GTrXLModel
from rl_tformers.agents.gtrxl.replay import GTrXLPolicyWrapper, exit_kwargs, replay_features
from torch import Tensor

from rl_tformers.depth.early_exit import Calibration, calibrate_threshold


class EarlyExitPolicy(GTrXLPolicyWrapper):
    """A GTrXL policy that acts with early exit (depth kind ``early_exit``).

    Each step's token runs through the layers until its confidence reaches ``threshold``; only
    the counted rows (``count_rows``: environments still in an episode) decide, and the loop
    stops once every one of them exited. The action is then chosen as the plain policy chooses
    it (mode or draw) from the exited features. :meth:`stats` adds ``exit_mean_layer`` (1-based
    layer of the counted decisions), ``exit_early_frac`` and ``exit_layers_run`` (mean number of
    layers the loop ran per step).

    Args:
        policy: the plain :class:`~rl_tformers.agents.gtrxl.agent.GTrXLPolicy` (early exit
            changes its forward pass, so it wraps no other wrapper).
        threshold: the confidence threshold (``None``: the backbone's stored one, +inf: every layer).

    Raises:
        TypeError: ``policy`` is a wrapper.
        ValueError: the model's depth kind is not ``early_exit``.
    """

    def __init__(self, policy: Any, threshold: float | None = None) -> None:
        if isinstance(policy, GTrXLPolicyWrapper):
            raise TypeError(f"EarlyExitPolicy wraps the plain GTrXL policy (it changes the forward pass), "
                            f"got {type(policy).__name__}")
        if not policy.model.encoder.early_exit:
            raise ValueError("gtrxl: early exit needs backbone.depth.kind=early_exit in the run's config")
        super().__init__(policy)
        self.exit_threshold = threshold
        self.reset_own_stats()

    def decide(self, x: Tensor, t: Tensor, memory: Any, start: Tensor, state: Any) -> Any:
        """The plain decision from an early-exit forward pass (arguments as ``GTrXLPolicy.decide``)."""
        pol = self.base
        n = x.shape[0]
        counted = torch.as_tensor(self.counted(n), device=x.device)  # (N,)
        if pol.model.encoder.stateful:
            deciding = counted[:, None]  # (N, 1): the new step
        else:  # plain window: only the newest slot decides
            w = state.window_x.shape[1]
            deciding = torch.zeros(n, w, dtype=torch.bool, device=x.device)
            deciding[:, -1] = counted
        h, mem, win = pol.features(x, t, memory, start, state, **exit_kwargs(pol.model, self.exit_threshold, deciding))
        m = pol.last_metrics
        k = int(counted.sum())
        self.steps += 1
        self.layers_run += float(m["exit/layers_run"])
        self.decisions += k
        self.exit_layer_sum += float(m["exit/mean_layer"]) * k
        self.early_sum += float(m["exit/early_frac"]) * k
        return pol.choose(h, mem, win)

    def own_stats(self) -> dict[str, float | int]:
        """``exit_mean_layer``, ``exit_early_frac`` and ``exit_layers_run`` once a step ran."""
        if not self.steps:
            return {}
        out = {"exit_layers_run": self.layers_run / self.steps}
        if self.decisions:
            out.update(exit_mean_layer=self.exit_layer_sum / self.decisions,
                       exit_early_frac=self.early_sum / self.decisions)
        return out

    def reset_own_stats(self) -> None:
        """Zero the steps, decisions and their exit layers."""
        self.steps = 0
        self.layers_run = 0.0
        self.decisions = 0
        self.exit_layer_sum = 0.0
        self.early_sum = 0.0


@torch.no_grad()
def calibrate_exit_threshold(
    model: GTrXLModel, seg: SegmentBatch, *, tol: float, delta: float, epsilon: float,
    candidates: Sequence[float] | None = None,
) -> tuple[float | None, Calibration]:
    """The exit threshold calibrated on segments of held-out episodes (CALM sec. 4).

    Each segment is acted through step by step as the policy acts (:func:`replay_features`:
    every step exits at the candidate threshold, its state filling the memory of the layers it
    skipped); the decision compared is the segment's last real step (one per segment, so the
    decisions are independent, as Learn-then-Test assumes). It is consistent when its action
    equals the full model's (discrete argmax) or is within ``tol`` in every dimension
    (continuous, normalised units); the smallest candidate whose inconsistency is <= ``delta``
    with probability >= 1 - ``epsilon`` is picked
    (:func:`~rl_tformers.depth.early_exit.calibrate_threshold`).

    Args:
        model: a GTrXL model with depth kind ``early_exit`` (memory mode).
        seg: W segments (B = W rows of L steps, model units).
        tol, delta, epsilon: as above; candidates: default 0, 0.05, ..., 1.

    Returns:
        (threshold, calibration): None when no candidate passed (the full model).
    """
    rows = torch.arange(seg.mask.shape[0], device=seg.mask.device)
    last = seg.mask.shape[1] - 1 - seg.mask.flip(1).long().argmax(1)  # (W,) the last real step
    discrete = model.cfg.discrete

    def decision(threshold: float) -> Tensor:
        _, out = replay_features(model, seg, threshold, early_exit=True)
        out = out[rows, last]  # (W, A)
        return out.argmax(-1) if discrete else out.clamp(-1.0, 1.0)

    full = decision(math.inf)

    def consistent(threshold: float) -> Tensor:
        a = decision(threshold)
        return (a == full) if discrete else ((a - full).abs().amax(-1) <= tol)

    cands = list(DEFAULT_CANDIDATES) if candidates is None else list(candidates)
    cal = calibrate_threshold(consistent, cands, delta=delta, epsilon=epsilon)
    return (None if math.isinf(cal.threshold) else float(cal.threshold)), cal
