"""Longformer attention: sliding window (``sliding_window``) and window + global (``longformer``).

Beltagy, Peters & Cohan 2020, "Longformer: The Long-Document Transformer", sec. 3.1
(attention pattern) and sec. 4.1 (window sizes per layer); survey "The Transformer Family
v2.0", "Combination of Local and Global Context".

- Sliding window: each token attends a window of w keys around it (w/2 on each side;
  causally the w most recent keys including itself). Cost O(L w).
- Dilated sliding window: the window has gaps of size d (keys at distances that are
  multiples of d), reaching w * d tokens at the same cost. Longformer uses it on a few heads
  of the higher layers only (``dilated_heads``).
- Window sizes per layer: ``window`` / ``dilation`` may be tuples with one value per layer
  (the paper grows the window from lower to higher layers).
- Global attention: preselected tokens attend every token and every token attends them.
  The global part is symmetric by definition and has **no causal form**, so ``longformer``
  is bidirectional only (the backbone refuses it causally; the Decision Transformer then
  offers its last-action mode). ``sliding_window`` has both forms and incremental decoding.

Windows are defined on absolute key indices (keys ``[prefix (M); segment (T)]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.attention._blocksparse import (
    BlockSparseAttention,
    HeadGroup,
    Heads,
    band_piece,
    segment_indices,
    split_heads_by,
    with_globals,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.backbone import IncompatibleConfig
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext


def per_layer(value: int | tuple[int, ...], layer: int, name: str) -> int:
    """The value of ``name`` for ``layer``: an int, or the layer's entry of a per-layer tuple."""
    if isinstance(value, (tuple, list)):
        if not 0 <= layer < len(value):
            raise ValueError(f"attention.{name} has {len(value)} per-layer values, layer {layer} has none")
        return int(value[layer])
    return int(value)


def window_bounds(window: int, causal: bool) -> tuple[int, int]:
    """(lo, hi) of the allowed steps a - j: causal (0, w - 1); bidirectional (-w//2, w//2)."""
    return (0, window - 1) if causal else (-(window // 2), window // 2)


def auto_block(window: int, block: int) -> int:
    """Query block length of the gathered band: ``block`` if set, else ~window/2 in [16, 128]."""
    return block if block > 0 else max(16, min(128, window // 2))


class SlidingWindowAttention(BlockSparseAttention):
    """Longformer sliding window with optional dilation on some heads, plus global tokens.

    Beltagy et al. 2020, sec. 3.1. Query a attends key j iff ``a - j = k d`` with
    ``k in [lo, hi]`` (causal: [0, w-1]; bidirectional: [-w//2, w//2]), and, with global
    tokens G, iff ``a in G`` or ``j in G``.

    Shapes: per head group one band piece (see
    :func:`~rl_tformers.attention._blocksparse.band_piece`): scores (B, h, N, bq, bq + hi - lo)
    with N * bq ~ S, so O(S (w + bq)) time and memory; globals add O(T G + G S).

    Args:
        window, dilation: w and d of this layer.
        dilated_heads: number of heads (the last ones) using the dilation; the others use
            d = 1. ``None`` = all heads.
        global_tokens: segment indices of the global tokens (negative = from the end); empty
            for the pure sliding window.
        block: query block length of the gathered band (0 = automatic).

    Cannot: return dense attention weights; a causal form of the global part (it has none).
    Incremental decoding (sliding window only) keeps the last (w - 1) * d keys.
    """

    def __init__(
        self, ctx, position, window: int, dilation: int, dilated_heads: int | None, global_tokens: tuple[int, ...], block: int
    ) -> None:
        super().__init__(ctx, position)
        self.window, self.dilation, self.block = window, dilation, block
        self.global_tokens = tuple(global_tokens)
        n_dil = self.n_heads if dilated_heads is None else dilated_heads
        # head -> dilation; the last n_dil heads are dilated (Longformer dilates a few heads)
        self.head_dilation = [1] * (self.n_heads - n_dil) + [dilation] * n_dil
        self.incremental = not self.global_tokens

    def lookback(self) -> int:
        return (self.window - 1) * max(self.head_dilation)

    def groups(self, h: Heads, x_q: Tensor) -> list[HeadGroup]:
        lo, hi = window_bounds(self.window, h.ctx.causal)
        bq = auto_block(self.window, self.block)
        g_abs = segment_indices(self.global_tokens, h.n_q, h.q0, h.q.device)  # (G,)
        by_d = split_heads_by(self.head_dilation, h.q.device)
        out = []
        for d, heads in by_d:
            pieces = with_globals(h, [band_piece(h.q0, h.n_k, lo, hi, d, bq, h.q.device)], g_abs)
            out.append(HeadGroup(None if len(by_d) == 1 else heads, pieces, disjoint=True))  # see with_globals
        return out

    def pattern(self, ctx: AttnContext) -> Tensor:
        dev = ctx.pos_q.device
        a = torch.arange(ctx.q_len, device=dev)[:, None] + ctx.prefix_len  # (T, 1)
        j = torch.arange(ctx.k_len, device=dev)[None, :]  # (1, S)
        lo, hi = window_bounds(self.window, ctx.causal)
        d = torch.tensor(self.head_dilation, device=dev)[:, None, None]  # (H, 1, 1)
        diff = (a - j)[None]  # (1, T, S)
        band = (diff % d == 0) & (diff >= lo * d) & (diff <= hi * d)  # (H, T, S)
        g = segment_indices(self.global_tokens, ctx.q_len, ctx.prefix_len, dev)
        is_g = torch.zeros(ctx.k_len, dtype=torch.bool, device=dev)
        is_g[g] = True
        # query global: by its key index a (negative for the first queries when S < T,
        # cross-attention; such queries are never global)
        q_g = is_g[a.clamp(0, max(ctx.k_len - 1, 0))] & (a >= 0)  # (T, 1)
        glob = is_g[None, :] | q_g  # (T, S): key global or query global
        return (band | glob[None])[None]  # (1, H, T, S)


def _check_layers(cfg, name: str, value) -> None:

    if isinstance(value, (tuple, list)) and len(value) != cfg.n_layers:
        raise IncompatibleConfig(
            f"backbone.attention.{name} has {len(value)} per-layer values but backbone.n_layers={cfg.n_layers}"
        )


@dataclass(frozen=True)
class _WindowFields(AttentionConfig):
    """``window``: w, keys per window (int, or one per layer); ``dilation``: d (int, or one per
    layer); ``dilated_heads``: how many heads (the last ones) use the dilation (None = all);
    ``block``: query block length of the gathered band (0 = automatic)."""

    window: int | tuple[int, ...] = 32
    dilation: int | tuple[int, ...] = 1
    dilated_heads: int | None = None
    block: int = 0

    def __post_init__(self) -> None:
        for name in ("window", "dilation"):
            v = getattr(self, name)
            vals = v if isinstance(v, (tuple, list)) else (v,)
            if not vals or min(int(x) for x in vals) < 1:
                raise ValueError(f"attention.{name} must be >= 1 (or a tuple of such), got {v}")
        if self.block < 0:
            raise ValueError(f"attention.block must be >= 0, got {self.block}")

    def check(self, cfg) -> None:
        _check_layers(cfg, "window", self.window)
        _check_layers(cfg, "dilation", self.dilation)

        if self.dilated_heads is not None and not 0 <= self.dilated_heads <= cfg.n_heads:
            raise IncompatibleConfig(
                f"backbone.attention.dilated_heads={self.dilated_heads} must lie in [0, backbone.n_heads={cfg.n_heads}]"
            )

    def _layer(self, ctx) -> tuple[int, int]:
        i = max(ctx.layer_idx, 0)
        return per_layer(self.window, i, "window"), per_layer(self.dilation, i, "dilation")


@ATTENTION.register(
    "sliding_window",
    description="Longformer's (dilated) sliding window: each token attends w keys around it (causally: the w most recent)",
    paper="Beltagy et al. 2020, Longformer (sec. 3.1 sliding and dilated windows; sec. 4.1 window sizes per layer)",
    capabilities=Capabilities(
        causal=True, bidirectional=True, key_padding=True, memory=True, incremental=True, exact=True, subquadratic=True,
        # its pattern is on key indices with query i at key S - T + i (the last T keys): as cross-attention
        # with more queries than keys the first ones would see no key at all (a silent zero output)
        cross_attention=False,
    ),
)
@dataclass(frozen=True)
class SlidingWindowConfig(_WindowFields):
    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: a window of 128 keys."""
        return {"window": 128}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: windows per layer, one dilated head (the suite's backbones have 2 layers)."""
        if seq_len < 256:
            return {"window": (3, 5), "dilation": (1, 2), "dilated_heads": 1}
        return {"window": 64, "dilation": (1, 2), "dilated_heads": 1}

    def build(self, ctx, position) -> AttentionModule:
        w, d = self._layer(ctx)
        return SlidingWindowAttention(ctx, position, w, d, self.dilated_heads, (), self.block)


@ATTENTION.register(
    "longformer",
    description="Longformer: (dilated) sliding window + symmetric global attention on preselected tokens; bidirectional only",
    paper="Beltagy et al. 2020, Longformer (sec. 3.1 attention pattern, sec. 4.1 window sizes per layer)",
    capabilities=Capabilities(
        causal=False, bidirectional=True, key_padding=True, memory=True, incremental=False, exact=True, subquadratic=True,
        cross_attention=False,  # queries are the last T of the S keys: more queries than keys fail
    ),
)
@dataclass(frozen=True)
class LongformerConfig(_WindowFields):
    """Plus ``global_tokens``: segment indices of the tokens with global attention (negative =
    from the end; e.g. (-1,) makes the last token, whose action the Decision Transformer's
    last-action mode predicts, global). Indices beyond a short segment are ignored."""

    global_tokens: tuple[int, ...] = (0,)

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: a window of 128 keys and one global token."""
        return {"window": 128, "global_tokens": (0,)}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: a short dilated window and two global tokens."""
        if seq_len < 256:
            return {"window": 4, "dilation": (1, 2), "dilated_heads": 1, "global_tokens": (0, -1)}
        return {"window": 64, "global_tokens": (0, -1)}

    def build(self, ctx, position) -> AttentionModule:
        w, d = self._layer(ctx)
        return SlidingWindowAttention(ctx, position, w, d, self.dilated_heads, tuple(self.global_tokens), self.block)
