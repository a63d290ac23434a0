"""Memory kind ``none``: no memory between calls; with a state, exact incremental decoding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rl_tformers.memory.base import MemoryConfig, MemoryModule, SegmentRecord, new_state
from rl_tformers.registry import MEMORY, Capabilities
from rl_tformers.types import BackboneState, LayerState


def keys_kept(blocks: Sequence[nn.Module]) -> int | None:
    """Trailing key slots of the state's bookkeeping that the layers' caches still read: the
    largest ``attn.cache_keeps()`` of the blocks, or None (keep all) when a layer needs every
    slot (a dense cache) or there are no blocks."""
    keeps = []
    for b in blocks:
        attn = getattr(b, "attn", None)
        keep = None if attn is None else attn.cache_keeps()
        if keep is None:
            return None
        keeps.append(keep)
    return max(keeps) if keeps else None


class NoMemory(MemoryModule):
    """Stateless by default. ``initial_state`` gives each layer its kernel's incremental
    cache (dense: keys/values of every past token), so feeding tokens one at a time with the
    returned state equals one full forward pass.

    The state's key bookkeeping (``pos``, ``valid``, ``seg``: (B, P)) grows by T slots per
    call, except when every layer's kernel has a bounded cache (``attn.cache_keeps()`` an int:
    sliding-window and local kernels, and the linear kernels ``performer`` / ``rfa``, whose
    running sums need no slot): then only the last w = max over layers of those slots
    are kept, P <= w, and ``state.key_offset`` counts the dropped ones, so a step costs
    O(w), not O(steps so far), with the same outputs.
    """

    def initial_state(self, blocks, batch, device, dtype) -> BackboneState:
        """Per layer, ``b.attn.init_cache(batch, device, dtype)``; no prefix slot (P = 0).

        Raises:
            NotImplementedError: a layer's kernel has no incremental (cached) form.
        """
        layers = [LayerState(cache=b.attn.init_cache(batch, device, dtype)) for b in blocks]
        return new_state(layers, batch, 0, device)

    def update(self, state: BackboneState, rec: SegmentRecord):
        """Keep the kernels' new caches and append the segment's T slots to the bookkeeping
        (trimmed to :func:`keys_kept` slots when bounded); returns (state, {}, {})."""
        layers = [LayerState(cache=c) for c in rec.caches]
        pos = torch.cat([state.pos, rec.pos], 1)  # (B, P + T)
        valid = torch.cat([state.valid, rec.valid], 1)
        seg = torch.cat([state.seg, rec.seg], 1)
        offset = state.key_offset
        keep = keys_kept(rec.blocks)
        if keep is not None and pos.shape[1] > keep:  # bounded caches: drop the slots none reads
            drop = pos.shape[1] - keep
            pos, valid, seg = pos[:, drop:], valid[:, drop:], seg[:, drop:]  # (B, keep)
            offset += drop
        st = BackboneState(
            layers=layers,
            pos=pos,
            valid=valid,
            seg=seg,
            episode=state.episode,
            next_pos=state.next_pos,
            key_offset=offset,
        )
        return st, {}, {}


@MEMORY.register(
    "none",
    description="No memory across calls; with a state, a key/value cache for exact incremental decoding",
    paper="-",
    capabilities=Capabilities(incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class NoMemoryConfig(MemoryConfig):
    """No fields: builds :class:`NoMemory`."""

    def build(self, ctx) -> MemoryModule:
        return NoMemory()
