"""Post-norm (vanilla Transformer) and pre-norm (GPT-2 style) residual blocks."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from rl_tformers.blocks.base import BlockConfig, BlockModule
from rl_tformers.registry import BLOCK, Capabilities
from rl_tformers.types import AttnContext, BlockOutput, LayerState, TokenIndex, take_tokens


class PostNormBlock(BlockModule):
    """x = LN(x + Attn(x)); x = LN(x + FFN(x))  (Vaswani et al. 2017, sec. 3.1).

    ``queries``: a slice along T or a (B, P) long tensor of per-row token indices
    (:func:`~rl_tformers.types.take_tokens`); only those tokens' outputs are computed (B, T', D), every
    token still serving as a key (see :attr:`BlockModule.query_subset`).
    """

    query_subset = True

    def __init__(self, ctx, position) -> None:
        super().__init__(ctx, position)
        self.norm1 = nn.LayerNorm(ctx.d_model)
        self.norm2 = nn.LayerNorm(ctx.d_model)

    def forward(self, x: Tensor, ctx: AttnContext, state: LayerState | None = None,
                queries: TokenIndex | None = None) -> BlockOutput:
        mem = None if state is None else state.memory
        a = self.attend(x, mem, ctx, state, queries)
        if queries is not None:
            x = take_tokens(x, queries)  # (B, T', D)
        x = self.norm1(x + self.dropout(a.out))
        x = self.norm2(x + self.dropout(self.transition(x, ctx)))
        return BlockOutput(x, a.cache, a.aux, a.metrics, a.weights)


class PreNormBlock(BlockModule):
    """x = x + Attn(LN(x)); x = x + FFN(LN(x))  (GPT-2; Xiong et al. 2020). Memory is normed too.

    ``queries``: as :class:`PostNormBlock`.
    """

    query_subset = True

    def __init__(self, ctx, position) -> None:
        super().__init__(ctx, position)
        self.norm1 = nn.LayerNorm(ctx.d_model)
        self.norm2 = nn.LayerNorm(ctx.d_model)

    def forward(self, x: Tensor, ctx: AttnContext, state: LayerState | None = None,
                queries: TokenIndex | None = None) -> BlockOutput:
        mem = None if state is None or state.memory is None else self.norm1(state.memory)
        a = self.attend(self.norm1(x), mem, ctx, state, queries)
        if queries is not None:
            x = take_tokens(x, queries)  # (B, T', D)
        x = x + self.dropout(a.out)
        x = x + self.dropout(self.transition(self.norm2(x), ctx))
        return BlockOutput(x, a.cache, a.aux, a.metrics, a.weights)


@BLOCK.register(
    "post_norm",
    description="Residual then LayerNorm after each sub-layer (the vanilla Transformer)",
    paper="Vaswani et al. 2017, Attention Is All You Need",
    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class PostNormConfig(BlockConfig):
    """No fields: builds :class:`PostNormBlock`."""

    def build(self, ctx, position) -> BlockModule:
        return PostNormBlock(ctx, position)


@BLOCK.register(
    "pre_norm",
    description="LayerNorm before each sub-layer, identity residual path (GPT-2)",
    paper="Radford et al. 2019 (GPT-2); Xiong et al. 2020, On Layer Normalization in the Transformer",
    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class PreNormConfig(BlockConfig):
    """No fields: builds :class:`PreNormBlock`."""

    def build(self, ctx, position) -> BlockModule:
        return PreNormBlock(ctx, position)
