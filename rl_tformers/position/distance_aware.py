"""Distance-aware re-weighting of attention scores (``distance_aware``; DA-Transformer, Wu et al. 2021)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.position.base import PositionConfig, PositionModule, per_head, rel_distance
from rl_tformers.registry import POSITION, Capabilities
from rl_tformers.types import to_acc


def da_weight(dist: Tensor, alpha: Tensor, beta: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The learnable sigmoid f of DA-Transformer on per-head weighted distances.

    Wu, Wu & Huang 2021, "DA-Transformer: Distance-aware Transformer", sec. 3::

        R^(h) = alpha_h R,  R_ij = |i - j|
        f(R^(h); beta_h) = (1 + exp(beta_h)) / (1 + exp(beta_h - R^(h)))
                         = (1 + exp(beta_h)) * sigmoid(R^(h) - beta_h)

    f(0) = 1, f -> 0 as R^(h) -> -inf, f -> 1 + exp(beta_h) as R^(h) -> +inf, monotonic.
    A negative alpha_h makes head h prefer short-term context, a positive one long-term.

    Args:
        dist: (B, 1, ..., T, S) float distances |i - j|.
        alpha, beta: (H,) per-head parameters.
        dtype: the computation dtype (float32; float64 for a float64 model).
    Returns:
        (B, H, ..., T, S) weights in ``dtype``.
    """
    r = per_head(alpha.to(dtype), dist.dim()) * dist.to(dtype)  # (B, H, ..., T, S)
    b = per_head(beta.to(dtype), dist.dim())  # (1, H, 1.., 1)
    return torch.exp(F.softplus(b)) * torch.sigmoid(r - b)  # softplus(b) = log(1 + e^b)


class DistanceAwarePosition(PositionModule):
    """Re-weights raw scores by the learnable sigmoid of the weighted distance, per head.

    DA-Transformer (Wu et al. 2021, sec. 3; survey "The Transformer Family v2.0")::

        attn = row-softmax( ReLU(Q K^T) * f(R^(h)) / sqrt(d) ) V

    Implemented as ``transform_scores(s) = ReLU(s) * f`` on the kernel's already scaled
    scores s = Q K^T / sqrt(d) (the scale is positive, so ReLU and the product commute with
    it). Needs explicit scores, so dense kernels take their reference path with this kind.
    Parameters: alpha (H,) and beta (H,) per layer, the paper's O(2h) extra memory.
    alpha starts spread over [-alpha_init, alpha_init] across heads (short- to long-term
    preferences), beta at ``beta_init``.
    """

    transforms_scores = True

    def __init__(self, n_heads: int, alpha_init: float, beta_init: float) -> None:
        super().__init__()
        spread = torch.linspace(-1.0, 1.0, n_heads) if n_heads > 1 else torch.zeros(1)
        self.alpha = nn.Parameter(alpha_init * spread)  # (H,)
        self.beta = nn.Parameter(torch.full((n_heads,), float(beta_init)))  # (H,)

    def transform_scores(self, scores: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """scores (B, H, ..., T, S) -> ReLU(scores) * f(alpha_h |i - j|; beta_h), in float32
        (float64 for float64 scores: a float64 model stays exact to float64 rounding)."""
        dist = rel_distance(pos_q, pos_k).abs()  # (B, 1, ..., T, S)
        scores = to_acc(scores)
        return F.relu(scores) * da_weight(dist, self.alpha, self.beta, scores.dtype)


@POSITION.register(
    "distance_aware",
    description="DA-Transformer: ReLU scores re-weighted by a learnable per-head sigmoid of |i-j|",
    paper="Wu, Wu & Huang 2021, DA-Transformer: Distance-aware Transformer (sec. 3)",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class DistanceAwareConfig(PositionConfig):
    """``alpha_init``: heads' initial distance weights spread over [-alpha_init, alpha_init];
    ``beta_init``: initial beta (f's upper bound is 1 + exp(beta))."""

    alpha_init: float = 0.1
    beta_init: float = 0.0

    def build(self, ctx) -> PositionModule:
        return DistanceAwarePosition(ctx.n_heads, self.alpha_init, self.beta_init)
