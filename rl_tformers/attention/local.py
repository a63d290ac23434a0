"""Fixed local context of the Image Transformer: 1D local (``local``) and 2D local (``local_2d``).

Parmar et al. 2018, "Image Transformer", sec. 3.2 (local self-attention) and fig. 2; survey
"The Transformer Family v2.0", "Fixed Local Context". The sequence is split into
non-overlapping query blocks; every query of a block attends the same *memory block*: the
query block itself plus a fixed flange of neighbouring keys. Cost O(L * (block + flange)).

Patterns are defined on absolute key indices (keys are ``[prefix (M); segment (T)]``), so a
Transformer-XL memory or an incremental cache extends them naturally; block boundaries are
aligned to multiples of the block length from the first key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.attention._blocksparse import (
    BlockSparseAttention,
    HeadGroup,
    Heads,
    Piece,
    key_range,
    tile_blocks,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext


def _abs_grid(ctx: AttnContext) -> tuple[Tensor, Tensor]:
    """Absolute key indices of the queries (T, 1) and of the keys (1, S) (dense test masks)."""
    dev = ctx.pos_q.device
    a = torch.arange(ctx.q_len, device=dev)[:, None] + ctx.prefix_len + ctx.key_offset  # (T, 1)
    j = torch.arange(ctx.k_len, device=dev)[None, :] + ctx.key_offset  # (1, S)
    return a, j


class Local1DAttention(BlockSparseAttention):
    """Image Transformer 1D local attention (Parmar et al. 2018, sec. 3.2, "1D local attention").

    Keys are cut into query blocks of ``block`` (l_q) consecutive indices; the queries of the
    block starting at ``s`` attend keys ``[s - memory, s + block)`` (the paper's memory block:
    the query block plus ``memory`` = l_m keys generated before it), with the causal mask on
    top in the decoder. Bidirectionally the memory block also extends ``memory`` keys after the
    query block (tensor2tensor's unmasked local_attention_1d with flanges on both sides).

    Shapes: one piece with N = ceil(S / block) groups of ``block`` query slots and
    K = memory + block (+ memory) gathered keys each: scores (B, H, N, block, K), i.e.
    O(S * (block + 2 memory)) time and memory.

    Cannot: return dense attention weights. Incremental decoding keeps the last
    ``block - 1 + memory`` keys. Blocks are aligned to key index 0 of the sequence, not to a row's first real
    token: the number of left-padding tokens before a trajectory, or the keys a KV cache
    held before a ``reset_state``, shift the blocks of the tokens after them (the Decision
    Transformer pads its training windows and its evaluation buffer alike, so its training
    and acting see the same blocks).
    """

    incremental = True

    def __init__(self, ctx, position, block: int, memory: int) -> None:
        super().__init__(ctx, position)
        self.block, self.memory = block, memory

    def lookback(self) -> int:
        return self.block - 1 + self.memory

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:
        b, m = self.block, self.memory
        q_idx, starts = tile_blocks(h.q0, h.n_k, b, h.q.device)  # (N, block), (N,)
        k_idx = key_range(starts, -m, b + (0 if h.ctx.causal else m))  # (N, K)
        return [HeadGroup(None, [Piece(q_idx, k_idx)])]

    def pattern(self, ctx: AttnContext) -> Tensor:
        a, j = _abs_grid(ctx)
        start = a // self.block * self.block  # (T, 1) start of each query's block
        hi = start + self.block + (0 if ctx.causal else self.memory)
        return ((j >= start - self.memory) & (j < hi))[None, None]  # (1, 1, T, S)


@ATTENTION.register(
    "local",
    description="Image Transformer 1D local attention: query blocks attend their block plus a flange of preceding keys",
    paper="Parmar et al. 2018, Image Transformer (sec. 3.2, 1D local attention)",
    capabilities=Capabilities(
        causal=True, bidirectional=True, key_padding=True, memory=True, incremental=True, exact=True, subquadratic=True,
        # its pattern is on key indices with query i at key S - T + i (the last T keys): as cross-attention
        # with more queries than keys the first ones would see no key at all (a silent zero output)
        cross_attention=False,
    ),
)
@dataclass(frozen=True)
class LocalConfig(AttentionConfig):
    """``block``: query block length l_q; ``memory``: flange l_m of keys before the block
    (and after it when bidirectional). With ``block >= L`` this is dense attention."""

    block: int = 32
    memory: int = 32

    def __post_init__(self) -> None:
        if self.block < 1 or self.memory < 0:
            raise ValueError(f"attention.block must be >= 1 and attention.memory >= 0, got {self.block}, {self.memory}")

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: query blocks of 64 with a 64-key flange (128 keys per query)."""
        return {"block": 64, "memory": 64}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: several blocks at the suite's length."""
        return {"block": 4, "memory": 3} if seq_len < 256 else {"block": 64, "memory": 64}

    def build(self, ctx, position) -> AttentionModule:
        return Local1DAttention(ctx, position, self.block, self.memory)


class Local2DAttention(BlockSparseAttention):
    """Image Transformer 2D local attention (Parmar et al. 2018, sec. 3.2, "2D local attention").

    The key indices are laid out in raster order on a grid of ``width`` columns (row
    ``j // width``, column ``j % width``). The grid is cut into rectangular query blocks of
    ``query_shape = (qh, qw)``; each attends its memory block: the query block extended by
    ``flange = (fh, fw)``: fh rows up, fw columns left and right (and fh rows down when
    bidirectional). The causal raster-order mask applies on top in the decoder, as in the paper.

    Shapes: one piece, N = ceil(rows / qh) * ceil(width / qw) groups of qh * qw query slots,
    K = (qh + fh [+ fh]) * (qw + 2 fw) gathered keys each: O(S * K) time and memory.
    A row shorter than ``width`` (the last one) and columns beyond ``width`` are masked.

    Cannot: return dense attention weights. Incremental decoding keeps the last
    ``(qh - 1 + fh) * width + qw - 1 + fw`` keys. The grid is laid over key indices from 0:
    left padding or a reset under a KV cache moves the tokens after them to other cells.
    """

    incremental = True

    def __init__(self, ctx, position, width: int, query_shape: tuple[int, int], flange: tuple[int, int]) -> None:
        super().__init__(ctx, position)
        self.width = width
        self.qh, self.qw = query_shape
        self.fh, self.fw = flange

    def lookback(self) -> int:
        return (self.qh - 1 + self.fh) * self.width + self.qw - 1 + self.fw

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:
        w, qh, qw, fh, fw = self.width, self.qh, self.qw, self.fh, self.fw
        dev = h.q.device
        row_first, row_last = h.q0 // w, (h.n_k - 1) // w  # grid rows holding queries
        r0 = torch.arange(row_first // qh, row_last // qh + 1, device=dev) * qh  # (nR,) block top rows
        c0 = torch.arange(math.ceil(w / qw), device=dev) * qw  # (nC,) block left columns
        n = r0.numel() * c0.numel()
        # query slots: (nR, nC, qh, qw) -> (N, qh * qw)
        qr = r0[:, None, None, None] + torch.arange(qh, device=dev)[None, None, :, None]
        qc = c0[None, :, None, None] + torch.arange(qw, device=dev)[None, None, None, :]
        qc = qc.expand(r0.numel(), -1, qh, -1)
        q_idx = (qr * w + qc).reshape(n, qh * qw)
        q_ok = (qc < w).reshape(n, qh * qw)
        # memory block: (nR, nC, kh, kw) -> (N, kh * kw)
        kr = r0[:, None, None, None] + torch.arange(-fh, qh + (0 if h.ctx.causal else fh), device=dev)[None, None, :, None]
        kc = c0[None, :, None, None] + torch.arange(-fw, qw + fw, device=dev)[None, None, None, :]
        kr, kc = torch.broadcast_tensors(kr, kc)
        k_idx = (kr * w + kc).reshape(n, -1)
        k_ok = ((kc >= 0) & (kc < w) & (kr >= 0)).reshape(n, -1)
        return [HeadGroup(None, [Piece(q_idx, k_idx, q_ok=q_ok, k_ok=k_ok)])]

    def pattern(self, ctx: AttnContext) -> Tensor:
        a, j = _abs_grid(ctx)
        w = self.width
        ra, ca, rj, cj = a // w, a % w, j // w, j % w
        top, left = ra // self.qh * self.qh, ca // self.qw * self.qw  # (T, 1) query block corner
        bottom = top + self.qh + (0 if ctx.causal else self.fh)
        rows = (rj >= top - self.fh) & (rj < bottom)
        cols = (cj >= left - self.fw) & (cj < left + self.qw + self.fw)
        return (rows & cols)[None, None]  # (1, 1, T, S)


@ATTENTION.register(
    "local_2d",
    description="Image Transformer 2D local attention: rectangular query blocks over a raster grid attend a memory block around them",
    paper="Parmar et al. 2018, Image Transformer (sec. 3.2, 2D local attention)",
    capabilities=Capabilities(
        causal=True, bidirectional=True, key_padding=True, memory=True, incremental=True, exact=True, subquadratic=True,
        # its pattern is on key indices with query i at key S - T + i (the last T keys): as cross-attention
        # with more queries than keys the first ones would see no key at all (a silent zero output)
        cross_attention=False,
    ),
)
@dataclass(frozen=True)
class Local2DConfig(AttentionConfig):
    """``width``: grid columns (tokens per raster row; e.g. 3 * k for k Decision Transformer
    steps of (return, state, action)); ``query_shape``: (rows, cols) of a query block;
    ``flange``: (rows, cols) by which the memory block extends the query block (up, and
    left/right; also down when bidirectional)."""

    width: int = 8
    query_shape: tuple[int, int] = (4, 4)
    flange: tuple[int, int] = (4, 4)

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"attention.width must be >= 1, got {self.width}")
        if len(self.query_shape) != 2 or min(self.query_shape) < 1:
            raise ValueError(f"attention.query_shape must be two positive ints, got {self.query_shape}")
        if len(self.flange) != 2 or min(self.flange) < 0:
            raise ValueError(f"attention.flange must be two ints >= 0, got {self.flange}")

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: a ~sqrt(L)-wide grid (an image), 8 x 8 query blocks, flange 4 x 8."""
        return {"width": max(8, 2 ** round(math.log2(max(length, 1)) / 2)), "query_shape": (8, 8), "flange": (4, 8)}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: a 4-wide grid with 2 x 2 query blocks (several blocks at 12 tokens)."""
        if seq_len < 256:
            return {"width": 4, "query_shape": (2, 2), "flange": (1, 1)}
        return {"width": 32, "query_shape": (4, 8), "flange": (4, 8)}

    def build(self, ctx, position) -> AttentionModule:
        return Local2DAttention(ctx, position, self.width, tuple(self.query_shape), tuple(self.flange))
