"""Blockwise self-attention with a block permutation per head (``blockwise``; BlockBERT).

Qiu et al. 2019/2020, "Blockwise Self-Attention for Long Document Understanding", sec. 3
(blockwise multi-head attention); survey "The Transformer Family v2.0", "Strided Context".
The L x L attention matrix is cut into n x n blocks of size L/n; head h keeps only the
blocks (i, pi_h(i)) of a permutation pi_h of the n block indices, so the queries of block i
attend the keys of block pi_h(i) only:

    Blockwise-Attention(Q, K, V, M) = [softmax(q_i k_{pi(i)}^T / sqrt(d)) v_{pi(i)}]_{i=1..n}

The paper uses the shifting permutations pi_k(i) = (i + k) mod n and assigns each to a
number of heads (e.g. 10:2 heads for n = 2, 8:2:2 for n = 3): identity heads model
short-range context, shifted heads long-range context. Cost per head: O(L^2 / n).

No causal form: for a shift k > 0 the blocks i < n - k attend only the later block i + k,
so under a causal mask those heads would see nothing at all; the identity heads alone under
a causal mask are block-diagonal local attention (kind ``local`` with ``memory: 0``). So
this kind is bidirectional only. Blocks are cut over the absolute key indices
``[prefix (M); segment (T)]`` into blocks of ceil(S / n) (n blocks, or fewer for a short S that
n does not divide: the permutations then run over the blocks that exist).

No cross-attention (``Capabilities.cross_attention`` false; the encoder-decoder refuses
``cross_attention.kind=blockwise``): the pattern pairs query block i with key block pi(i) *of the
same sequence*, and T targets over S source tokens have no such correspondence. Placing query i
at key S - T + i and cutting blocks over the source length (padding included) made the source
tokens a target reads depend on how many pad tokens follow or precede the source (padding
changed valid outputs); a padding-free version would need blocks cut per row over its real
source tokens and a target-block to source-block map that the paper does not define (it applies
blockwise attention to self-attention only).
"""

from __future__ import annotations

import dataclasses
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
    split_heads_by,
    tile_blocks,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.backbone import IncompatibleConfig
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext


def head_shifts(n_blocks: int, heads_per_shift: tuple[int, ...], n_heads: int) -> list[int]:
    """Shift k of each head (pi_k(i) = (i + k) mod n).

    ``heads_per_shift[k]`` heads use shift k (summing to H); default: H // n heads for every
    shift k >= 1 and the rest on the identity (the paper's assignments favour the identity).
    """
    if heads_per_shift:
        counts = list(heads_per_shift)
    else:
        counts = [n_heads // n_blocks] * n_blocks
        counts[0] = n_heads - (n_blocks - 1) * (n_heads // n_blocks)
    return [k for k, c in enumerate(counts) for _ in range(c)]


class BlockwiseAttention(BlockSparseAttention):
    """BlockBERT blockwise attention (Qiu et al., sec. 3), one permutation per head.

    Shapes: per shift k (a head group) one piece: N query blocks of b slots, each gathering the
    b keys of block (i + k) mod n: scores (B, h, N, b, b). With n fixed (the paper) b = ceil(S/n)
    and the cost is O(S^2 / n); with a fixed block length b it is O(S b).

    Cannot: causal masking (see the module docstring), incremental decoding, dense weights.
    """

    def __init__(self, ctx, position, n_blocks: int, block: int, shifts: list[int]) -> None:
        super().__init__(ctx, position)
        self.n_blocks, self.block = n_blocks, block
        self.shifts = shifts

    def layout(self, s: int) -> tuple[int, int]:
        """(block length b, number of blocks n) for S keys: n fixed (b = ceil(S / n)), or b
        fixed (n = ceil(S / b)) when ``block`` is set.

        n is the number of blocks that hold keys, ceil(S / b): with ``n_blocks`` fixed it is
        ``n_blocks`` unless S is small and not a multiple of it (S = 6, n_blocks = 4: b = 2, three
        blocks), where a permutation over ``n_blocks`` would send a whole query block to an
        empty fourth block (no key at all, a zero output on the shifted heads)."""
        if self.block > 0:
            return self.block, max(1, math.ceil(s / self.block))
        b = max(1, math.ceil(s / self.n_blocks))
        return b, max(1, math.ceil(s / b))

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:
        b, n = self.layout(h.n_k)
        q_idx, starts = tile_blocks(h.q0, h.n_k, b, h.q.device)  # (N, b), (N,)
        blk = starts // b  # (N,) block index i of each query block
        by = split_heads_by(self.shifts, h.q.device)
        out = []
        for k, heads in by:
            k_idx = key_range(((blk + k) % n) * b, 0, b)  # (N, b) keys of block pi_k(i)
            out.append(HeadGroup(None if len(by) == 1 else heads, [Piece(q_idx, k_idx)]))
        return out

    def pattern(self, ctx: AttnContext) -> Tensor:
        dev = ctx.pos_q.device
        b, n = self.layout(ctx.k_len)
        a = torch.arange(ctx.q_len, device=dev)[:, None] + ctx.prefix_len  # (T, 1)
        j = torch.arange(ctx.k_len, device=dev)[None, :]  # (1, S)
        k = torch.tensor(self.shifts, device=dev)[:, None, None]  # (H, 1, 1)
        return ((j // b)[None] == ((a // b)[None] + k) % n)[None]  # (1, H, T, S)


@ATTENTION.register(
    "blockwise",
    description="BlockBERT: n x n block-sparse attention, head h attends block pi_h(i) = (i + k_h) mod n; bidirectional only; "
                "subquadratic only with a fixed block length (block > 0; fixed n_blocks costs L^2 / n)",
    paper="Qiu et al. 2020, Blockwise Self-Attention for Long Document Understanding (sec. 3)",
    capabilities=Capabilities(
        # subquadratic only with a fixed block length (block > 0): the paper's fixed n_blocks costs
        # O(S^2 / n) (BlockwiseConfig.config_capabilities)
        causal=False, bidirectional=True, key_padding=True, memory=True, incremental=False, exact=True, subquadratic=False,
        # query block i reads key block pi(i) of the same sequence: cross-attention has no such correspondence
        # (query i sits at key S - T + i, blocks are cut over the padded source length), so the source a
        # target reads would depend on the number of pad tokens; see the module docstring
        cross_attention=False,
    ),
)
@dataclass(frozen=True)
class BlockwiseConfig(AttentionConfig):
    """``n_blocks``: n (blocks of ceil(S / n) keys; cost O(S^2 / n)); ``block``: a fixed block
    length b instead (n = ceil(S / b) then grows with S; cost O(S b); 0 = use ``n_blocks``);
    ``heads_per_shift``: heads assigned to shift k = 0, 1, ... (sums to n_heads; default: even
    split over ``n_blocks`` shifts, remainder on the identity)."""

    n_blocks: int = 2
    block: int = 0
    heads_per_shift: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n_blocks < 1 or self.block < 0:
            raise ValueError(f"attention.n_blocks must be >= 1 and block >= 0, got {self.n_blocks}, {self.block}")
        if self.heads_per_shift and (len(self.heads_per_shift) > self.n_blocks or min(self.heads_per_shift) < 0):
            raise ValueError(
                f"attention.heads_per_shift needs at most n_blocks={self.n_blocks} counts >= 0, got {self.heads_per_shift}"
            )

    def config_capabilities(self) -> Capabilities:
        """The kind's capabilities with ``subquadratic`` true only for a fixed block length
        (``block > 0``: cost O(S b)); with ``n_blocks`` fixed (the paper) the n blocks grow with S
        and the cost is O(S^2 / n), a quadratic growth."""
        return dataclasses.replace(type(self).capabilities, subquadratic=self.block > 0)  # type: ignore[attr-defined]

    def check(self, cfg) -> None:
        """Refuse head assignments that do not add up to ``backbone.n_heads``, and a default
        split (no ``heads_per_shift``) that leaves a shift k >= 1 without a head: with fewer heads
        than ``n_blocks`` (one head, say) the block permutations would silently disappear and
        every query block read only its own block, which is kind ``local``. An explicit
        ``heads_per_shift`` may leave shifts out."""
        if self.heads_per_shift and sum(self.heads_per_shift) != cfg.n_heads:
            raise IncompatibleConfig(
                f"backbone.attention.heads_per_shift={list(self.heads_per_shift)} sums to "
                f"{sum(self.heads_per_shift)}, not backbone.n_heads={cfg.n_heads}"
            )
        if not self.heads_per_shift and cfg.n_heads < self.n_blocks:
            raise IncompatibleConfig(
                f"backbone.n_heads={cfg.n_heads} leaves the shifts 1..{self.n_blocks - 1} of "
                f"backbone.attention.n_blocks={self.n_blocks} without a head (blockwise gives each block "
                f"permutation its own heads: n_heads >= n_blocks); raise backbone.n_heads, lower "
                f"backbone.attention.n_blocks, or set backbone.attention.heads_per_shift explicitly"
            )

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: blocks of 128 keys (n = L / 128; with the paper's n = 2 the cost
        stays quadratic, L^2 / 2)."""
        return {"n_blocks": 2, "block": 128}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: 3 blocks at the suite's short length, blocks of 64 at long ones (O(L b))."""
        return {"n_blocks": 3} if seq_len < 256 else {"n_blocks": 2, "block": 64}

    @classmethod
    def contract_backbone(cls, seq_len: int) -> dict:
        """4 heads: every shift of the 3 blocks has a head (shifts 0, 0, 1, 2)."""
        return {"n_heads": 4}

    def build(self, ctx, position) -> AttentionModule:
        shifts = head_shifts(self.n_blocks, tuple(self.heads_per_shift), ctx.n_heads)
        return BlockwiseAttention(ctx, position, self.n_blocks, self.block, shifts)
