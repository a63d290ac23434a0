"""Rotary position embedding (``rotary``; RoPE, Su et al. 2021)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.position.base import PositionConfig, PositionModule
from rl_tformers.registry import POSITION, Capabilities
from rl_tformers.types import acc_dtype, to_acc


def rotary_angles(pos: Tensor, dim: int, base: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """Angles m * theta_k for positions m and theta_k = base^(-2k/dim), k = 0 .. dim/2 - 1.

    Args:
        pos: (...) positions (any integer units).
        dim: rotated width (even).
    Returns:
        (..., dim/2) in ``dtype`` (float32; float64 for a float64 model).
    """
    inv = base ** (-torch.arange(0, dim, 2, device=pos.device, dtype=dtype) / dim)  # (dim/2,)
    return pos.to(dtype)[..., None] * inv


def apply_rotary(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate consecutive pairs (x_2k, x_2k+1) of the last axis by ``angles`` (RoPE eq. 34).

    Args:
        x: (..., Dh) queries or keys.
        angles: broadcastable to (..., Dh/2).
    Returns:
        (..., Dh) in x's dtype, computed in the dtype of ``angles`` (:meth:`RotaryPosition.rotate`
        passes float32 angles, float64 for float64 x).
    """
    pairs = to_acc(x).unflatten(-1, (-1, 2)).to(angles.dtype)  # (..., Dh/2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = angles.cos(), angles.sin()
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (..., Dh/2, 2)
    return out.flatten(-2).to(x.dtype)


class RotaryPosition(PositionModule):
    """RoPE: rotate each query/key pair of dims (2k, 2k+1) by angle m * theta_k.

    Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", sec. 3.4 (eq. 34):
    f(x, m) = R^d_{Theta, m} x with theta_k = base^(-2k/d). Because R_m^T R_n = R_{n-m},
    q_m . k_n depends on positions only through n - m (shifting every position leaves the
    scores unchanged). Queries and keys are rotated by their own caller positions, keys
    before they enter a KV cache. No parameters.

    Shapes: ``rotate(x (B, H, ..., L, Dh), pos (B, ..., L))``.
    """

    rotates = True

    def __init__(self, head_dim: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, base

    def rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        """x (B, H, ..., L, Dh) rotated by pos (B, ..., L).

        The angles m * theta_k are formed in float64 and reduced modulo 2 pi before they are
        cast to the compute dtype (float32 for float32 and half models): a float32 product
        m * theta_k is off by up to half an ulp of m (0.03 rad at m = 1e6, whole radians at
        1e9), which broke the shift invariance of the scores at large positions; reduced, every
        angle is within ~2e-7 rad up to m ~ 1e9. (MPS has no float64: there, float32 as before.)
        """
        exact = torch.float32 if pos.device.type == "mps" else torch.float64
        ang = rotary_angles(pos, self.head_dim, self.base, exact)  # (B, ..., L, Dh/2)
        ang = torch.remainder(ang, 2 * math.pi).to(acc_dtype(x.dtype)).unsqueeze(1)  # (B, 1, ..., L, Dh/2) in [0, 2 pi)
        return apply_rotary(x, ang)


@POSITION.register(
    "rotary",
    description="Rotary position embedding: queries and keys rotated by their positions (scores depend on i-j)",
    paper="Su et al. 2021, RoFormer: Enhanced Transformer with Rotary Position Embedding (sec. 3.4)",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class RotaryConfig(PositionConfig):
    """``base``: wavelength base of theta_k (10000 in the paper).

    Raises:
        ValueError: ``base`` <= 0; (``build``) an odd head dim ``d_model / n_heads``.
    """

    base: float = 10000.0

    def __post_init__(self) -> None:
        if self.base <= 0:
            raise ValueError(f"position.base must be > 0 (the wavelength base), got {self.base}")

    def build(self, ctx) -> PositionModule:
        if ctx.head_dim % 2:
            raise ValueError(
                f"position.kind='rotary' needs an even head dim, got d_model/n_heads = {ctx.head_dim}"
            )
        return RotaryPosition(ctx.head_dim, self.base)
