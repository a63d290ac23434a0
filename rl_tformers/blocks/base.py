"""Interface of blocks, and the position-wise feed-forward network they share.

A block kind is a registered config whose ``build(ctx, position)`` returns a
:class:`BlockModule` holding one attention (built from ``ctx.config.attention``), a
feed-forward network and its residual/normalisation scheme::

    forward(x (B, T, D), ctx: AttnContext, state: LayerState | None) -> BlockOutput

``state.memory`` (B, M, D), when present, is prepended to the keys/values (Transformer-XL);
``state.cache`` is the kernel's incremental-decoding cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.backbone_config import SlotConfig
from rl_tformers.dropout import Dropout
from rl_tformers.types import AttnContext, BlockOutput, LayerState, TokenIndex, take_tokens


@dataclass(frozen=True)
class BlockConfig(SlotConfig):
    """Base class of block configs (``build(ctx, position) -> BlockModule``).

    ``runs_stack`` (class attribute): True for kinds whose blocks run the whole stack as one
    function (reversible layers), which a per-layer stack cannot mix with other block kinds.
    """

    runs_stack = False

    def build(self, ctx, position) -> BlockModule:  # pragma: no cover - abstract
        raise NotImplementedError


_ACT = {"gelu": F.gelu, "relu": F.relu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class FeedForward(nn.Module):
    """Position-wise feed-forward: W2 act(W1 x + b1) + b2 (Vaswani et al. 2017, eq. 2).

    With ``chunks > 1`` the sequence axis is processed in that many chunks (Reformer's chunked
    feed-forward, Kitaev et al. 2020, sec. 3): identical output, peak activation memory of
    the hidden layer divided by ``chunks``. Shapes: (B, T, D) -> (B, T, D).
    """

    def __init__(self, d_model: int, d_ff: int, activation: str, dropout: float, chunks: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.act = _ACT[activation]
        self.dropout = Dropout(dropout)
        self.chunks = chunks

    def _ff(self, x: Tensor) -> Tensor:
        if self.act is F.relu and hasattr(self.fc1, "forward_relu"):  # ReLU fused into the product
            return self.fc2(self.dropout(self.fc1.forward_relu(x)))  # (cpu_matmul: onednn)
        return self.fc2(self.dropout(self.act(self.fc1(x))))

    def forward(self, x: Tensor) -> Tensor:
        if self.chunks == 1 or x.shape[1] <= 1:
            return self._ff(x)
        return torch.cat([self._ff(c) for c in x.chunk(self.chunks, dim=1)], dim=1)


def build_ffn(ctx) -> FeedForward:
    """The :class:`FeedForward` of ``ctx.config``: width ``ff_dim``, its activation, hidden
    dropout ``ffn_dropout`` (``dropout`` when None) and ``ffn_chunks`` chunks."""
    cfg = ctx.config
    hidden_dropout = cfg.dropout if cfg.ffn_dropout is None else cfg.ffn_dropout
    return FeedForward(cfg.d_model, cfg.ff_dim, cfg.activation, hidden_dropout, cfg.ffn_chunks)


class BlockModule(nn.Module):
    """Base block: owns ``self.attn`` and ``self.ffn``; subclasses define the residual scheme."""

    #: True for blocks whose stack must be run by a special runner (reversible layers).
    reversible = False
    #: True for blocks whose ``forward(..., queries=...)`` computes only those tokens' outputs
    #: (a slice along T, or a (B, P) long tensor of per-row indices: :func:`~rl_tformers.types.take_tokens`).
    query_subset = False

    def __init__(self, ctx, position) -> None:
        super().__init__()
        self.layer_idx = ctx.layer_idx
        self.checkpoint = ctx.config.checkpoint  # recomputed in backward (rl_tformers.depth.base.call_block)
        self.attn = ctx.config.attention.build(ctx, position)
        # A memory kind may wrap one layer's attention (memory kind ``knn``: the kNN-augmented
        # layer of the Memorizing Transformer); ``wrap_attention(ctx, attn) -> AttentionModule``.
        wrap = getattr(ctx.config.memory, "wrap_attention", None)
        if wrap is not None:
            self.attn = wrap(ctx, self.attn)
        self.ffn = build_ffn(ctx)
        self.dropout = Dropout(ctx.config.dropout)

    def transition(self, x: Tensor, ctx: AttnContext) -> Tensor:
        """The feed-forward sub-layer on x (B, T, D) -> (B, T, D): ``self.ffn(x)``, or
        ``self.ffn(x, ctx)`` for a transition that reads its neighbours (``takes_context``: the
        Universal Transformer's separable convolution, :mod:`rl_tformers.blocks.transition`)."""
        return self.ffn(x, ctx) if getattr(self.ffn, "takes_context", False) else self.ffn(x)

    def attend(self, h: Tensor, mem: Tensor | None, ctx: AttnContext, state: LayerState | None,
               queries: TokenIndex | None = None):
        """Run attention with queries ``h`` (B, T, D) and keys ``[mem; h]`` (B, M + T, D);
        with ``queries`` only those queries (B, T', D), :func:`~rl_tformers.types.take_tokens`
        (dense kernels only)."""
        kv = h if mem is None else torch.cat([mem, h], dim=1)
        cache = None if state is None else state.cache
        if queries is not None:
            return self.attn(take_tokens(h, queries), kv, ctx.select_queries(queries), cache)
        return self.attn(h, kv, ctx, cache)

    def forward(self, x: Tensor, ctx: AttnContext, state: LayerState | None = None) -> BlockOutput:  # pragma: no cover
        """x (B, T, D), the layer's ``state`` (memory (B, M, D) and/or cache) ->
        :class:`BlockOutput` with hidden (B, T, D) and the kernel's new cache."""
        raise NotImplementedError
