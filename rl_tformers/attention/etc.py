"""ETC global-local attention (``etc``): g2g, g2l, l2g and l2l pieces with a local radius.

Ainslie et al. 2020, "ETC: Encoding Long and Structured Inputs in Transformers", sec. 2.1
(global-local attention) and sec. 2.3 (structured inputs); survey "The Transformer Family
v2.0", "Combination of Local and Global Context".

ETC splits its input into a small *global* input x^g (n_g tokens) and the *long* input x^l
(n_l tokens). Attention is cut into four pieces by direction: global-to-global (g2g),
global-to-long (g2l), long-to-global (l2g) and long-to-long (l2l); only l2l is restricted, to
a radius w (|i - j| <= w, so it reshapes to n_l x (2w + 1)). Structure enters through the
masks M^{g2l} etc.: for inputs made of segments (sentences), each segment gets one global
token and the g2l mask may restrict a global token to the long tokens of its own segment
("hard masking").

Adaptation to a single-sequence backbone (it threads one (B, T, D) sequence between layers):
the global input is a designated subset of the segment's tokens, either listed
(``global_tokens``) or one per segment of ``global_every`` tokens (its first token: e.g.
``global_every: 3`` makes every return token of the Decision Transformer's (R, s, a) triplets
a global summary of its step); the long input is the rest. Q/K/V projections are shared by the
two inputs, and relative positions come from the backbone's positional kind (ETC uses Shaw-
style relative labels: ``position.kind=shaw``).

The global pieces are symmetric by definition and have **no causal form**, so the kind is
bidirectional only; the backbone refuses it causally and the Decision Transformer offers its
last-action mode instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.attention._blocksparse import (
    BlockSparseAttention,
    HeadGroup,
    Heads,
    Piece,
    band_piece,
    global_table,
    member,
    segment_indices,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext

G2L = ("full", "segment")


def etc_globals(global_tokens: tuple[int, ...], every: int, t: int, q0: int, device: torch.device) -> Tensor:
    """(G,) sorted absolute key indices of the global tokens: the listed segment indices plus
    the first token of every segment of ``every`` tokens (``every = 0``: none of those)."""
    listed = segment_indices(global_tokens, t, q0, device)
    if every <= 0:
        return listed
    heads = torch.arange(0, t, every, device=device) + q0
    return torch.unique(torch.cat([listed, heads]))


class ETCAttention(BlockSparseAttention):
    """ETC global-local attention (Ainslie et al. 2020, sec. 2.1), four pieces.

    For a long query: l2l (band |i - j| <= w over long keys) and l2g (all global keys),
    merged into one softmax. For a global query: g2g (all global keys) and g2l (all long
    keys, or with ``g2l="segment"`` the long keys of its own segment). Memory keys (a prefix)
    are long keys outside every segment.

    Shapes: l2l gathers blocks (B, H, N, bq, bq + 2w); l2g (B, H, N, bq, G); g2g (B, H, 1, G, G);
    g2l full (B, H, 1, G, S) or segment (B, H, G, 1, every). O(S (w + G) + G S) in full mode,
    O(S (w + G)) in segment mode (G = S / every tokens then attend `every` keys each).

    Cannot: causal masking, incremental decoding, dense weights.
    """

    def __init__(self, ctx, position, radius: int, global_tokens, global_every: int, g2l: str, block: int) -> None:
        super().__init__(ctx, position)
        self.radius, self.global_every, self.g2l, self.block = radius, global_every, g2l, block
        self.global_tokens = tuple(global_tokens)

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:
        dev, w = h.q.device, self.radius
        g = etc_globals(self.global_tokens, self.global_every, h.n_q, h.q0, dev)  # (G,)
        bq = self.block if self.block > 0 else max(16, min(128, w))
        l2l = band_piece(h.q0, h.n_k, -w, w, 1, bq, dev)
        if g.numel() == 0:
            return [HeadGroup(None, [l2l])]
        table = global_table(g, h.n_k, dev)  # (S,) True = global token
        q_long = ~member(table, l2l.q_idx)  # (N, bq)
        l2l.keep = l2l.keep & q_long[:, :, None] & ~member(table, l2l.k_idx)[:, None, :]
        l2g = Piece(l2l.q_idx, g[None, :], keep=q_long[:, :, None])  # (N, bq) x (1, G)
        gq = g[None, :]  # (1, G): one tiling object, so g2g and a full g2l fuse into one softmax
        g2g = Piece(gq, gq)  # (1, G) x (1, G)
        if self.g2l == "full":
            keys = torch.arange(h.k0, h.n_k, device=dev)[None, :]  # (1, S - k0)
            g2l = Piece(gq, keys, keep=~member(table, keys)[:, None, :])
        else:  # the long tokens of the global token's own segment: [g + 1, g + every)
            e = self.global_every
            g2l = Piece(g[:, None], g[:, None] + torch.arange(1, e, device=dev))  # (G, 1) x (G, every - 1)
            g2l.keep = ~member(table, g2l.k_idx)[:, None, :]
        # l2l + l2g share the long queries' tiling, g2g + g2l (full) the global queries': two
        # fused softmaxes over disjoint queries; segment g2l is LSE-merged with g2g
        return [HeadGroup(None, [l2l, l2g, g2g, g2l], disjoint=self.g2l == "full")]

    def pattern(self, ctx: AttnContext) -> Tensor:
        dev, q0 = ctx.pos_q.device, ctx.prefix_len
        a = torch.arange(ctx.q_len, device=dev)[:, None] + q0  # (T, 1)
        j = torch.arange(ctx.k_len, device=dev)[None, :]  # (1, S)
        g = etc_globals(self.global_tokens, self.global_every, ctx.q_len, q0, dev)
        is_g = torch.zeros(ctx.k_len, dtype=torch.bool, device=dev)
        is_g[g] = True
        qg, kg = is_g[q0:][:, None], is_g[None, :]  # (T, 1), (1, S)
        l2l = ~qg & ~kg & ((a - j).abs() <= self.radius)
        l2g = ~qg & kg
        g2g = qg & kg
        g2l = qg & ~kg
        if self.g2l == "segment":
            g2l = g2l & (j > a) & (j < a + self.global_every)
        return (l2l | l2g | g2g | g2l)[None, None]  # (1, 1, T, S)


@ATTENTION.register(
    "etc",
    description="ETC global-local attention: g2g/g2l/l2g unrestricted (g2l optionally per segment), l2l within radius w; bidirectional only",
    paper="Ainslie et al. 2020, ETC: Encoding Long and Structured Inputs in Transformers (sec. 2.1, 2.3)",
    capabilities=Capabilities(
        causal=False, bidirectional=True, key_padding=True, memory=True, incremental=False, exact=True, subquadratic=True,
        cross_attention=False,  # queries are the last T of the S keys: more queries than keys fail
    ),
)
@dataclass(frozen=True)
class ETCConfig(AttentionConfig):
    """``radius``: w of the l2l piece; ``global_tokens``: segment indices of global tokens
    (negative = from the end); ``global_every``: also make the first token of every segment
    of this many tokens global (0 = off); ``g2l``: ``full`` or ``segment`` (a global token
    sees only its own segment's long tokens; needs ``global_every`` and no ``global_tokens``);
    ``block``: query block length of the l2l band (0 = automatic)."""

    radius: int = 8
    global_tokens: tuple[int, ...] = (0,)
    global_every: int = 0
    g2l: str = "full"
    block: int = 0

    def __post_init__(self) -> None:
        if self.radius < 0 or self.global_every < 0 or self.block < 0:
            raise ValueError(
                f"attention.radius, global_every and block must be >= 0, got {self.radius}, {self.global_every}, {self.block}"
            )
        if self.g2l not in G2L:
            raise ValueError(f"attention.g2l={self.g2l!r}; use one of {', '.join(G2L)}")
        if self.g2l == "segment" and (self.global_every < 1 or self.global_tokens):
            raise ValueError(
                "attention.g2l='segment' needs attention.global_every >= 1 (one global token per segment) "
                "and attention.global_tokens=[] (listed tokens have no segment)"
            )

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: radius 64 (129 long keys) and one global token."""
        return {"radius": 64, "global_tokens": (0,)}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: radius 2 and the first token global."""
        return {"radius": 2 if seq_len < 256 else 32, "global_tokens": (0,)}

    def build(self, ctx, position) -> AttentionModule:
        return ETCAttention(
            ctx, position, self.radius, tuple(self.global_tokens), self.global_every, self.g2l, self.block
        )
