"""Relative position representations with clipping (``shaw``; Shaw, Uszkoreit & Vaswani 2018)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rl_tformers.position.base import PositionConfig, PositionModule, rel_distance
from rl_tformers.registry import POSITION, Capabilities


class ShawPosition(PositionModule):
    """Learned relative position vectors for keys and values, offsets clipped to +-k.

    Shaw et al. 2018, "Self-Attention with Relative Position Representations", sec. 3::

        e_ij = x_i W^Q (x_j W^K + a^K_ij)^T / sqrt(d_z)            (eq. 4)
        z_i  = sum_j alpha_ij (x_j W^V + a^V_ij)                    (eq. 3)
        a^K_ij = w^K_clip(j - i, k),  a^V_ij = w^V_clip(j - i, k)   (sec. 3.2)

    so there are 2k + 1 learned vectors w^K and 2k + 1 vectors w^V of size Dh, shared across
    heads (as in the paper) and separate per layer. Offsets beyond +-k share the edge vector.
    Offsets ``j - i`` are computed from the caller's positions (any integer units).

    Cost: the key term is ``q @ w^K^T`` (B, H, ..., T, 2k+1) gathered to (B, H, ..., T, S); the
    value term sums the probabilities per offset bucket (B, H, ..., T, 2k+1) and multiplies by
    w^V, so no (T, S, Dh) tensor is ever built.

    Args:
        head_dim: Dh (the paper's d_z).
        clip: k, the largest distinguished offset.
        values: also learn w^V (eq. 3); off = keys only (then the fused SDPA path is used).
    """

    additive_bias = True

    def __init__(self, head_dim: int, clip: int, values: bool) -> None:
        super().__init__()
        self.clip = clip
        self.scale = 1.0 / math.sqrt(head_dim)
        self.key_table = nn.Parameter(torch.randn(2 * clip + 1, head_dim) * 0.02)  # w^K (2k+1, Dh)
        self.value_table = nn.Parameter(torch.randn(2 * clip + 1, head_dim) * 0.02) if values else None  # w^V
        self.value_bias = values

    def bucket(self, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """Table row of each (query, key) pair: clip(j - i, -k, k) + k -> (B, 1, ..., T, S) long."""
        return (-rel_distance(pos_q, pos_k)).clamp(-self.clip, self.clip) + self.clip

    def score_bias(self, q: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor:
        """q (B, H, ..., T, Dh) -> q_i . a^K_ij / sqrt(Dh): (B, H, ..., T, S)."""
        qa = torch.matmul(q, self.key_table.to(q.dtype).t())  # (B, H, ..., T, 2k+1)
        idx = self.bucket(pos_q, pos_k)  # (B, 1, ..., T, S)
        idx = idx.expand(*qa.shape[:-1], idx.shape[-1])  # (B, H, ..., T, S)
        return torch.gather(qa, -1, idx) * self.scale

    def value_term(self, probs: Tensor, pos_q: Tensor, pos_k: Tensor) -> Tensor | None:
        """probs (B, H, ..., T, S) -> sum_j p_ij a^V_ij: (B, H, ..., T, Dh)."""
        if self.value_table is None:
            return None
        idx = self.bucket(pos_q, pos_k).expand_as(probs)  # (B, H, ..., T, S)
        per_bucket = probs.new_zeros(*probs.shape[:-1], 2 * self.clip + 1)  # (B, H, ..., T, 2k+1)
        per_bucket = per_bucket.scatter_add(-1, idx, probs)
        return torch.matmul(per_bucket, self.value_table.to(probs.dtype))  # (B, H, ..., T, Dh)


@POSITION.register(
    "shaw",
    description="Learned relative position vectors for keys and values, offsets clipped to +-k",
    paper="Shaw, Uszkoreit & Vaswani 2018, Self-Attention with Relative Position Representations (sec. 3)",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class ShawConfig(PositionConfig):
    """``clip``: k, in the caller's position units (the paper's base models use 16);
    ``values``: learn the value vectors w^V too.

    Raises:
        ValueError: ``clip`` < 0.
    """

    clip: int = 16
    values: bool = True

    def __post_init__(self) -> None:
        if self.clip < 0:
            raise ValueError(f"position.clip must be >= 0, got {self.clip}")

    def build(self, ctx) -> PositionModule:
        return ShawPosition(ctx.head_dim, self.clip, self.values)
