"""Sparse Transformer factorised attention: ``strided`` and ``fixed`` patterns.

Child, Gray, Radford & Sutskever 2019, "Generating Long Sequences with Sparse Transformers",
sec. 4.2 (factorised self-attention), sec. 4.3 (three ways to use it); survey "The
Transformer Family v2.0", "Strided Context". With stride l (~ sqrt(n) in the paper) and query
i, key j (absolute key indices, causal j <= i):

- strided: A1_i = {j : i - l <= j <= i} (the previous l keys and i itself),
           A2_i = {j : (i - j) mod l = 0} (the "column" every l steps back);
- fixed:   A1_i = {j : floor(j / l) = floor(i / l)} (the same block of l),
           A2_i = {j : j mod l in {l - c, ..., l - 1}} (the last c "summary" positions of
           every block).

Ways to combine them (``mode``): ``interleaved`` (layer n uses A^(n mod 2)), ``union`` (every
head attends A1 | A2) and ``heads`` (each head takes its own pattern, ``head_patterns``).

The paper defines the patterns autoregressively; the bidirectional forms used here are the
symmetric ones (strided A1: |i - j| <= l; A2: all j with (i - j) mod l = 0; fixed: unchanged
sets without the causal restriction).

Cost per head: strided O(L (l + L / l)) = O(L^1.5) at l = sqrt(L); fixed O(L (l + c L / l))
(quadratic in L with the factor c / l, as in the paper).
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
    band_piece,
    key_range,
    split_heads_by,
    tile_blocks,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.backbone import IncompatibleConfig
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext

MODES = ("union", "interleaved", "heads")
PATTERNS = ("a1", "a2", "union")


def head_plan(mode: str, head_patterns: tuple[str, ...], n_heads: int, layer: int) -> list[str]:
    """The pattern (``a1``, ``a2`` or ``union``) of each head of a layer (Child et al. sec. 4.3).

    ``interleaved``: every head of layer n uses A^(n mod 2 + 1); ``union``: every head uses
    A1 | A2; ``heads``: ``head_patterns`` (one per head; default alternating a1, a2).
    """
    if mode == "union":
        return ["union"] * n_heads
    if mode == "interleaved":
        return [("a1", "a2")[layer % 2]] * n_heads
    if head_patterns:
        return list(head_patterns)
    return [("a1", "a2")[h % 2] for h in range(n_heads)]


class _FactorisedAttention(BlockSparseAttention):
    """Shared machinery: per-head plans of A1 / A2 / union pieces (strided or fixed)."""

    incremental = True

    def __init__(self, ctx, position, stride: int, plan: list[str]) -> None:
        super().__init__(ctx, position)
        self.stride = stride
        self.plan = plan

    def pieces(self, h: Heads, which: str) -> list[Piece]:  # pragma: no cover - abstract
        raise NotImplementedError

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:
        labels = [PATTERNS.index(p) for p in self.plan]
        by = split_heads_by(labels, h.q.device)
        return [HeadGroup(None if len(by) == 1 else heads, self.pieces(h, PATTERNS[lab])) for lab, heads in by]

    def dense(self, a: Tensor, j: Tensor, causal: bool) -> tuple[Tensor, Tensor]:  # pragma: no cover
        raise NotImplementedError

    def pattern(self, ctx: AttnContext) -> Tensor:
        dev = ctx.pos_q.device
        a = torch.arange(ctx.q_len, device=dev)[:, None] + ctx.prefix_len  # (T, 1)
        j = torch.arange(ctx.k_len, device=dev)[None, :]  # (1, S)
        a1, a2 = self.dense(a, j, ctx.causal)  # (T, S) each
        per = {"a1": a1, "a2": a2, "union": a1 | a2}
        return torch.stack([per[p] for p in self.plan])[None]  # (1, H, T, S)


class StridedAttention(_FactorisedAttention):
    """Strided factorised attention (Child et al. 2019, sec. 4.2, fig. 3b).

    Pieces: A1 is a band of distances [0, l] (bidirectionally [-l, l]) gathered in blocks;
    A2 splits keys and queries into their l residue classes mod l and attends within each
    class: (B, h, l, ceil(T / l), ceil(S / l)) scores, O(T S / l). In the union, A2 drops
    the keys A1 already owns (|i - j| <= l) so the two softmax pieces merge exactly.

    Cannot: return dense attention weights. Incremental decoding keeps every key (A2 reaches
    back to the start) unless every head of the layer is A1 only (``mode=heads``,
    ``head_patterns`` all ``a1``): then the cache keeps the last ``stride`` keys.
    """

    def lookback(self) -> int | None:
        return self.stride if all(p == "a1" for p in self.plan) else None

    def pieces(self, h: Heads, which: str) -> list[Piece]:
        l_, dev, causal = self.stride, h.q.device, h.ctx.causal
        out = []
        if which in ("a1", "union"):
            lo, hi = (0, l_) if causal else (-l_, l_)
            out.append(band_piece(h.q0, h.n_k, lo, hi, 1, max(16, min(l_, 128)), dev))
        if which in ("a2", "union"):
            r = torch.arange(l_, device=dev)[:, None]  # (l, 1) residue classes
            mq = torch.arange(h.q0 // l_, (h.n_k - 1) // l_ + 1, device=dev)  # quotients of the queries
            mk = torch.arange(max(h.k0, 0) // l_, (h.n_k - 1) // l_ + 1, device=dev)  # of the keys at hand
            q_idx = r + l_ * mq[None, :]  # (l, nq): group r holds the queries = r mod l
            k_idx = r + l_ * mk[None, :]  # (l, nk): and the keys = r mod l
            keep = None
            if which == "union":
                diff = q_idx[:, :, None] - k_idx[:, None, :]  # (l, nq, nk)
                keep = diff.abs() > l_  # A1 owns |i - j| <= l
            out.append(Piece(q_idx, k_idx, keep=keep))
        return out

    def dense(self, a: Tensor, j: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
        d = a - j  # (T, S)
        a1 = (d >= 0) & (d <= self.stride) if causal else d.abs() <= self.stride
        a2 = d % self.stride == 0
        return a1, a2


class FixedAttention(_FactorisedAttention):
    """Fixed factorised attention (Child et al. 2019, sec. 4.2, fig. 3c).

    Pieces: A1 is block-diagonal (query block of l attends its own block of l keys); A2
    gathers the c summary keys of every block once, (1, c * ceil(S / l)), shared by all query
    blocks: (B, h, N, l, c S / l) scores, O(c T S / l). In the union, A2 drops the summary
    keys of the query's own block (A1 owns them).

    Cannot: return dense attention weights. Incremental decoding keeps every key (A2 reaches
    back to the start) unless every head of the layer is A1 only (``mode=heads``,
    ``head_patterns`` all ``a1``): then the cache keeps the last ``stride - 1`` keys. Blocks (and so the summary positions) are aligned to key index 0 of the sequence, not to a row's first real
    token: the number of left-padding tokens before a trajectory, or the keys a KV cache
    held before a ``reset_state``, shift the blocks of the tokens after them (the Decision
    Transformer pads its training windows and its evaluation buffer alike, so its training
    and acting see the same blocks).
    """

    def __init__(self, ctx, position, stride: int, summary: int, plan: list[str]) -> None:
        super().__init__(ctx, position, stride, plan)
        self.summary = summary

    def lookback(self) -> int | None:
        return self.stride - 1 if all(p == "a1" for p in self.plan) else None

    def pieces(self, h: Heads, which: str) -> list[Piece]:
        l_, c, dev = self.stride, self.summary, h.q.device
        q_idx, starts = tile_blocks(h.q0, h.n_k, l_, dev)  # (N, l), (N,)
        out = []
        if which in ("a1", "union"):
            out.append(Piece(q_idx, key_range(starts, 0, l_)))  # (N, l) own block
        if which in ("a2", "union"):
            kb = torch.arange(max(h.k0, 0) // l_, (h.n_k - 1) // l_ + 1, device=dev) * l_  # key block starts
            k_idx = key_range(kb, l_ - c, l_).reshape(1, -1)  # (1, nkb * c) summary keys
            keep = None
            if which == "union":
                keep = (k_idx[:, None, :] // l_) != (starts[:, None, None] // l_)  # (N, 1, K) not own block
            out.append(Piece(q_idx, k_idx, keep=keep))
        return out

    def dense(self, a: Tensor, j: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
        a1 = (a // self.stride) == (j // self.stride)
        a2 = (j % self.stride) >= self.stride - self.summary
        return a1.expand(a.shape[0], j.shape[1]), a2.expand(a.shape[0], j.shape[1])


@dataclass(frozen=True)
class _FactorisedFields(AttentionConfig):
    """``stride``: l; ``mode``: ``union`` | ``interleaved`` | ``heads`` (Child et al. sec. 4.3);
    ``head_patterns``: with ``mode=heads``, one of ``a1``, ``a2``, ``union`` per head
    (default: alternating a1, a2)."""

    stride: int = 16
    mode: str = "union"
    head_patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.stride < 1:
            raise ValueError(f"attention.stride must be >= 1, got {self.stride}")
        if self.mode not in MODES:
            raise ValueError(f"attention.mode={self.mode!r}; use one of {', '.join(MODES)}")
        bad = [p for p in self.head_patterns if p not in PATTERNS]
        if bad:
            raise ValueError(f"attention.head_patterns: {bad[0]!r} is not one of {', '.join(PATTERNS)}")

    def check(self, cfg) -> None:

        if self.head_patterns and self.mode != "heads":
            raise IncompatibleConfig("backbone.attention.head_patterns is only used with backbone.attention.mode=heads")
        if self.mode == "heads" and self.head_patterns and len(self.head_patterns) != cfg.n_heads:
            raise IncompatibleConfig(
                f"backbone.attention.head_patterns has {len(self.head_patterns)} entries but backbone.n_heads={cfg.n_heads}"
            )
        if self.mode == "heads" and not self.head_patterns and cfg.n_heads < 2:
            raise IncompatibleConfig(
                "backbone.attention.mode=heads splits the patterns across heads and needs backbone.n_heads >= 2 "
                "(or give backbone.attention.head_patterns)"
            )

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: the paper's stride l ~ sqrt(n)."""
        return {"stride": max(2, math.isqrt(length))}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: the paper's stride l ~ sqrt(n) (cost O(n^1.5))."""
        return {"stride": max(2, math.isqrt(seq_len))}

    def _plan(self, ctx) -> list[str]:
        return head_plan(self.mode, tuple(self.head_patterns), ctx.n_heads, max(ctx.layer_idx, 0))


_CAPS = Capabilities(
    causal=True, bidirectional=True, key_padding=True, memory=True, incremental=True, exact=True, subquadratic=True,
    # the patterns are on key indices with query i at key S - T + i (the last T keys): as cross-attention
    # with more queries than keys the first ones would see no key at all (a silent zero output)
    cross_attention=False,
)


@ATTENTION.register(
    "strided",
    description="Sparse Transformer strided pattern: the previous l keys and every l-th key back (interleaved, union or per head)",
    paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers (sec. 4.2-4.3, fig. 3b)",
    capabilities=_CAPS,
)
@dataclass(frozen=True)
class StridedConfig(_FactorisedFields):
    def build(self, ctx, position) -> AttentionModule:
        return StridedAttention(ctx, position, self.stride, self._plan(ctx))


@ATTENTION.register(
    "fixed",
    description="Sparse Transformer fixed pattern: own block of l plus the c summary keys of every block",
    paper="Child et al. 2019, Generating Long Sequences with Sparse Transformers (sec. 4.2-4.3, fig. 3c)",
    capabilities=_CAPS,
)
@dataclass(frozen=True)
class FixedConfig(_FactorisedFields):
    """Plus ``summary``: c, the summary positions at the end of every block (1 <= c <= l)."""

    summary: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.summary <= self.stride:
            raise ValueError(f"attention.summary must lie in [1, stride={self.stride}], got {self.summary}")

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: l ~ sqrt(n) and c = l / 16 (the paper: c in {8..32} for l in {128, 256})."""
        stride = max(2, math.isqrt(length))
        return {"stride": stride, "summary": max(1, stride // 16)}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: l ~ sqrt(n) and a fixed c (cost O(c n^1.5))."""
        return {"stride": max(2, math.isqrt(seq_len)), "summary": 1 if seq_len < 256 else 2}

    def build(self, ctx, position) -> AttentionModule:
        return FixedAttention(ctx, position, self.stride, self.summary, self._plan(ctx))
