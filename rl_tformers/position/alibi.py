"""Attention with Linear Biases (``alibi``; Press, Smith & Lewis 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.position.base import PositionConfig, PositionModule, per_head, rel_distance
from rl_tformers.registry import POSITION, Capabilities


def alibi_slopes(n_heads: int) -> list[float]:
    """Fixed head slopes m_1..m_H of ALiBi (Press et al. 2022, sec. 3).

    For H a power of two: the geometric sequence starting at and with ratio 2^(-8/H)
    (8 heads: 1/2, 1/4, ..., 1/256). Otherwise, as in the paper's footnote/reference code: the
    slopes of the closest smaller power of two P, followed by every other slope of 2P until H
    slopes are collected.

    Raises:
        ValueError: ``n_heads`` < 1.
    """
    if n_heads < 1:
        raise ValueError(f"alibi needs at least one head, got {n_heads}")

    def pow2(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]  # (2^(-8/n))^(i+1), exact powers

    p = 2 ** int(math.floor(math.log2(n_heads)))
    if p == n_heads:
        return pow2(n_heads)
    return pow2(p) + pow2(2 * p)[0::2][: n_heads - p]


class ALiBiPosition(PositionModule):
    """Adds -m_h * |i - j| to the (already scaled) score of query i and key j in head h.

    Press et al. 2022, "Train Short, Test Long", eq. in sec. 3:
    softmax(q_i K^T + m . [-(i-1), ..., -2, -1, 0]). With a causal mask only j <= i is seen,
    so the bias is -m (i - j); without one the symmetric -m |i - j| is used. Slopes are
    fixed (a buffer, no parameters); distances are in the caller's position units.
    """

    additive_bias = True

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)  # (H,)

    def score_bias(self, q: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """-m_h |i - j| as (B, H, ..., T, S), at least float32 (float64 when the module was cast
        to float64; never bf16/fp16, which would round long distances)."""
        dist = rel_distance(pos_q, pos_k).abs().to(torch.float32)  # (B, 1, ..., T, S)
        return -per_head(self.slopes, dist.dim()) * dist  # (B, H, ..., T, S)


@POSITION.register(
    "alibi",
    description="Attention with linear biases: fixed geometric per-head slopes times -|i-j|",
    paper="Press, Smith & Lewis 2022, Train Short, Test Long: Attention with Linear Biases (sec. 3)",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class ALiBiConfig(PositionConfig):
    """No fields: slopes are fixed by ``backbone.n_heads`` (:func:`alibi_slopes`)."""

    def build(self, ctx) -> PositionModule:
        return ALiBiPosition(ctx.n_heads)
