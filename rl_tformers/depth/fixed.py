"""Depth kind ``fixed``: N distinct blocks applied once each (the standard stack)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from rl_tformers.depth.base import DepthConfig, DepthModule, DepthOutput
from rl_tformers.registry import DEPTH, Capabilities
from rl_tformers.types import AttnContext, LayerState, TokenIndex


def build_blocks(ctx, n: int) -> nn.ModuleList:
    """N blocks from the backbone config, each with its own positional module, block i from
    layer i's config (``ctx.at_layer(i)``: the kinds ``backbone.layers`` sets for it).

    Raises:
        IncompatibleConfig / ValueError: what a layer's kinds refuse when built; in a per-layer
            stack the message names the layer's entry (``backbone.layers[i]...``).
    """
    blocks = []
    for i in range(n):
        lctx = ctx.at_layer(i)
        try:
            blocks.append(lctx.config.block.build(lctx, lctx.config.position.build(lctx)))
        except ValueError as exc:  # IncompatibleConfig included
            if not ctx.config.layers:
                raise
            raise type(exc)(ctx.config.at_layer_message(i, str(exc))) from exc
    return nn.ModuleList(blocks)


class FixedDepth(DepthModule):
    """``n_layers`` distinct blocks applied once each, in order (Vaswani et al. 2017); a stack of
    reversible blocks is handed whole to their ``run_stack`` (:func:`run_reversible`)."""

    query_subset = True  # queries (slice or (B, P) indices): the last layer computes only those tokens

    def __init__(self, ctx) -> None:
        super().__init__()
        self.blocks = build_blocks(ctx, ctx.n_layers)

    def forward(
        self, x: Tensor, ctx: AttnContext, layer_states: list[LayerState] | None, need_hidden: bool = False,
        queries: TokenIndex | None = None, **kw
    ) -> DepthOutput:
        """x (B, T, D) through every block -> :class:`DepthOutput` with hidden (B, T, D), or
        (B, T', D) with ``queries`` (only the last layer computes just those tokens).

        Raises:
            TypeError: any extra keyword argument (``kw``).
            NotImplementedError: ``layer_states`` with reversible blocks.
        """
        if kw:
            raise TypeError(f"depth kind 'fixed' takes no extra arguments, got {sorted(kw)}")
        first = self.blocks[0]
        if getattr(first, "reversible", False):
            return first.run_stack(self.blocks, x, ctx, layer_states, need_hidden)
        out = DepthOutput(hidden=x, layer_inputs=[], caches=[], weights=[])
        hidden = []
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = self.run_layer(i, block, x, ctx, layer_states, out, queries if i == last else None)
            if need_hidden:
                hidden.append(x)
        out.hidden = x
        out.hidden_states = tuple(hidden) if need_hidden else None
        return out


@DEPTH.register(
    "fixed",
    description="A stack of N distinct blocks, each applied once",
    paper="Vaswani et al. 2017, Attention Is All You Need",
    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class FixedDepthConfig(DepthConfig):
    """No fields: builds :class:`FixedDepth` with ``backbone.n_layers`` blocks."""

    def build(self, ctx) -> DepthModule:
        return FixedDepth(ctx)
