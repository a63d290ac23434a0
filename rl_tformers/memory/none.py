"""Memory kind ``none``: no memory between calls; with a state, exact incremental decoding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_tformers.memory.base import MemoryConfig, MemoryModule, SegmentRecord, new_state
from rl_tformers.registry import MEMORY, Capabilities
from rl_tformers.types import BackboneState, LayerState


class NoMemory(MemoryModule):
    """Stateless by default. ``initial_state`` gives each layer its kernel's incremental
    cache (dense: keys/values of every past token), so feeding tokens one at a time with the
    returned state equals one full forward pass. The cache grows by T slots per call.
    """

    def initial_state(self, blocks, batch, device, dtype) -> BackboneState:
        layers = [LayerState(cache=b.attn.init_cache(batch, device, dtype)) for b in blocks]
        return new_state(layers, batch, 0, device)

    def update(self, state: BackboneState, rec: SegmentRecord):
        layers = [LayerState(cache=c) for c in rec.caches]
        st = BackboneState(
            layers=layers,
            pos=torch.cat([state.pos, rec.pos], 1),
            valid=torch.cat([state.valid, rec.valid], 1),
            seg=torch.cat([state.seg, rec.seg], 1),
            episode=state.episode,
            next_pos=state.next_pos,
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
    def build(self, ctx) -> MemoryModule:
        return NoMemory()
