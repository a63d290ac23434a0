"""Absolute positional encodings added to the input: ``none``, ``sinusoidal``, ``learned``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rl_tformers.position.base import PositionConfig, PositionModule, check_positions, embedding_table
from rl_tformers.registry import POSITION, Capabilities
from rl_tformers.types import acc_dtype


@POSITION.register(
    "none",
    description="No positional encoding (the caller adds its own, e.g. DT's timestep embedding)",
    paper="-",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class NoPositionConfig(PositionConfig):
    """No fields: every hook is the identity / no-op of :class:`PositionModule`."""

    def build(self, ctx) -> PositionModule:
        return PositionModule()


def sinusoid(pos: Tensor, dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32) -> Tensor:
    """Sinusoidal table (Vaswani et al. 2017, section 3.5) at arbitrary positions.

    PE(i, 2k) = sin(i / base^(2k/d)), PE(i, 2k+1) = cos(i / base^(2k/d)).

    Args:
        pos: (...) positions (any numeric dtype).
        dim: D, even.
    Returns:
        (..., D) in ``dtype`` (float32; float64 for a float64 model).
    Raises:
        ValueError: ``dim`` is odd.
    """
    if dim % 2:
        raise ValueError(f"sinusoidal encoding needs an even dimension, got {dim}")
    inv = torch.exp(torch.arange(0, dim, 2, device=pos.device, dtype=dtype) * (-math.log(base) / dim))
    ang = pos.to(dtype)[..., None] * inv  # (..., D/2)
    out = torch.stack((ang.sin(), ang.cos()), dim=-1)  # (..., D/2, 2): interleave sin/cos
    return out.flatten(-2)


class SinusoidalPosition(PositionModule):
    """Adds PE(pos) (:func:`sinusoid`) to the input of the first layer only. x (B, T, D), pos (B, T)."""

    absolute = True

    def __init__(self, dim: int, base: float, active: bool) -> None:
        super().__init__()
        self.dim, self.base, self.active = dim, base, active

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """x (B, T, D) + PE(pos (B, T)) in layer 0; x unchanged in the others."""
        if not self.active:
            return x
        return x + sinusoid(pos, self.dim, self.base, acc_dtype(x.dtype)).to(x.dtype)


@POSITION.register(
    "sinusoidal",
    description="Fixed sinusoidal absolute encoding added to the input",
    paper="Vaswani et al. 2017, Attention Is All You Need (sec. 3.5)",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class SinusoidalConfig(PositionConfig):
    """``base``: wavelength base (10000 in the paper).

    Raises:
        ValueError: ``base`` <= 0; (``build``) an odd ``backbone.d_model``.
    """

    base: float = 10000.0

    def __post_init__(self) -> None:
        if self.base <= 0:
            raise ValueError(f"position.base must be > 0 (the wavelength base), got {self.base}")

    def build(self, ctx) -> PositionModule:
        """Raises ValueError for an odd ``backbone.d_model`` (sin/cos pairs need an even width)."""
        if ctx.d_model % 2:
            raise ValueError(f"position.kind='sinusoidal' needs an even backbone.d_model, got {ctx.d_model}")
        return SinusoidalPosition(ctx.d_model, self.base, active=ctx.layer_idx == 0)


class LearnedPosition(PositionModule):
    """Adds a learned row per position to the layer input (first layer, or every layer with
    ``per_layer``). x (B, T, D), pos (B, T) in [0, max_position) (else ValueError)."""

    absolute = True

    def __init__(self, dim: int, max_position: int, active: bool) -> None:
        super().__init__()
        self.max_position = max_position
        self.table = embedding_table(max_position, dim, "backbone.max_position") if active else None
        if self.table is not None:
            nn.init.normal_(self.table.weight, std=0.02)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """x (B, T, D) + table[pos (B, T)] where the layer has a table; x unchanged otherwise.

        Raises:
            ValueError: ``pos`` not of an integer dtype or outside [0, max_position).
        """
        if self.table is None:
            return x
        check_positions(pos, self.max_position, "position.learned")
        return x + self.table(pos.long())


@POSITION.register(
    "learned",
    description="Learned absolute position table; optionally one table per layer",
    paper="Gehring et al. 2017 (learned); Al-Rfou et al. 2018 (per layer)",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class LearnedConfig(PositionConfig):
    """``per_layer``: a separate table added at every layer's input (Al-Rfou et al. 2018).

    The table has ``backbone.max_position`` rows; positions beyond it raise ValueError.
    """

    per_layer: bool = False

    def build(self, ctx) -> PositionModule:
        active = self.per_layer or ctx.layer_idx == 0
        return LearnedPosition(ctx.d_model, ctx.config.max_position, active)
