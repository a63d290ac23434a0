"""Interface of depth schemes: who owns the blocks and runs the loop over them.

A depth kind is a registered config whose ``build(ctx)`` returns a :class:`DepthModule`
that builds its blocks (N distinct ones for ``fixed``; one shared block for ``universal``)
and runs them::

    forward(x (B, T, D), ctx: AttnContext, layer_states: list[LayerState] | None,
            need_hidden: bool, **kw) -> DepthOutput

Adaptive kinds put their extra losses (ponder cost) in ``aux`` and their decisions (ponder
steps, exit layer) in ``metrics``.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rl_tformers.attention.base import deferred_buffer_updates
from rl_tformers.backbone_config import SlotConfig
from rl_tformers.types import AttnContext, BlockOutput, LayerState, TokenIndex, merge_into


@dataclass(frozen=True)
class DepthConfig(SlotConfig):
    """Base class of depth configs (``build(ctx) -> DepthModule``).

    ``block_per_layer`` (class attribute): True for kinds that build a block per layer
    (``BuildContext.at_layer(i)``), so that ``backbone.layers`` may set each layer's kinds;
    False for kinds that run one shared block (``universal``).
    """

    block_per_layer = True

    def build(self, ctx) -> DepthModule:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class DepthOutput:
    """Result of a depth module.

    Attributes:
        hidden: (B, T, D) output of the last layer (before the backbone's final norm).
        layer_inputs: per layer, (B, T, D) input it received (what memories store).
        caches: per layer, updated incremental cache (or None).
        weights: per layer, attention probabilities when computed (or None).
        aux, metrics: merged from all layers plus the scheme's own.
        hidden_states: per-layer outputs when ``need_hidden``.
        extras: per layer, memory-specific returns (kNN keys/values...).
    """

    hidden: Tensor
    layer_inputs: list[Tensor]
    caches: list[Any]
    weights: list[Tensor | None]
    aux: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    hidden_states: tuple[Tensor, ...] | None = None
    extras: list[Any] = field(default_factory=list)


def call_block(block: nn.Module, x: Tensor, ctx: AttnContext, state: LayerState | None,
               queries: TokenIndex | None = None) -> BlockOutput:
    """``block(x, ctx, state)`` (with ``queries`` when given) -> :class:`BlockOutput`.

    A block built with ``backbone.checkpoint`` runs under activation checkpointing while
    gradients are recorded (Chen et al. 2016; the Sparse Transformer's recomputation, Child et
    al. 2019 sec. 5.4): only its inputs are kept, and its forward runs again in the backward
    pass (non-reentrant ``torch.utils.checkpoint``, random state replayed, so dropout draws and
    gradients equal the ordinary pass's). ``ctx`` is copied with its ``layer_idx``, so the
    recomputation sees this layer's index; buffers a training forward updates (the routing
    centroids) are updated by the recomputation only, from the values the first forward used.
    """
    kwargs = {} if queries is None else {"queries": queries}
    if not (getattr(block, "checkpoint", False) and torch.is_grad_enabled()):
        return block(x, ctx, state, **kwargs)
    own = copy.copy(ctx)  # the depth loop sets ctx.layer_idx of the next layer before backward runs
    return checkpoint(lambda h: block(h, own, state, **kwargs), x, use_reentrant=False,
                      context_fn=lambda: (deferred_buffer_updates(), contextlib.nullcontext()))


class DepthModule(nn.Module):
    """Base depth module: ``self.blocks`` is the ModuleList of blocks it runs."""

    blocks: nn.ModuleList
    #: True for depth kinds whose ``forward(..., queries=...)`` (a slice along T or a (B, P) long
    #: tensor of per-row indices, :func:`~rl_tformers.types.take_tokens`) runs the last layer for those
    #: tokens only (hidden (B, T', D)); the backbone checks the blocks and kernels too.
    query_subset = False

    def run_layer(
        self,
        i: int,
        block: nn.Module,
        x: Tensor,
        ctx: AttnContext,
        layer_states: list[LayerState] | None,
        out: DepthOutput,
        queries: TokenIndex | None = None,
    ) -> Tensor:
        """Run block ``i`` on x (B, T, D), recording its input, cache, weights, aux, metrics.
        With ``queries`` (a block with ``query_subset``) only those tokens' outputs (B, T', D)."""
        ctx.layer_idx = i
        x = block.attn.position.embed(x, ctx.pos_q)
        out.layer_inputs.append(x)
        st = None if layer_states is None else layer_states[i]
        bo = call_block(block, x, ctx, st, queries)
        out.caches.append(bo.cache)
        out.weights.append(bo.weights)
        out.extras.append(getattr(bo, "extra", None))
        merge_into(out.aux, bo.aux)
        merge_into(out.metrics, bo.metrics, prefix=f"layer{i}/")
        return bo.hidden
