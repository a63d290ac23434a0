"""Transformer-XL segment-level recurrence (memory kind ``xl``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_tformers.memory.base import MemoryConfig, MemoryModule, SegmentRecord, new_state
from rl_tformers.registry import MEMORY, Capabilities
from rl_tformers.types import BackboneState, LayerState


class XLMemory(MemoryModule):
    """Per layer, a FIFO of the last ``mem_len`` hidden states that entered the layer.

    Dai et al. 2019, Transformer-XL, sec. 3.2: h~_{tau+1}^{n-1} = [SG(m_tau^{n-1}) ; h_{tau+1}^{n-1}];
    keys/values are computed over the concatenation, queries over the segment only.
    ``state.layers[i].memory`` is (B, M, D); its positions/validity/episode ids are the state's
    shared bookkeeping, so a slot from another episode or never filled is masked out.

    With ``detach`` (the paper's stop-gradient, default) no gradient reaches the memory.
    """

    def __init__(self, mem_len: int, d_model: int, detach: bool) -> None:
        super().__init__()
        self.mem_len, self.d_model, self.detach = mem_len, d_model, detach

    def initial_state(self, blocks, batch, device, dtype) -> BackboneState:
        """Per layer a zero (B, M, D) memory in ``dtype``, M = ``mem_len``; every slot invalid."""
        layers = [
            LayerState(memory=torch.zeros(batch, self.mem_len, self.d_model, device=device, dtype=dtype))
            for _ in blocks
        ]
        return new_state(layers, batch, self.mem_len, device)

    def update(self, state: BackboneState, rec: SegmentRecord):
        """Append each layer's (B, T, D) input to its memory and keep the last M slots (FIFO),
        detached when ``detach``; returns (state, {}, {})."""
        m = self.mem_len
        layers = []
        for ls, h in zip(state.layers, rec.layer_inputs):
            h = h.detach() if self.detach else h
            mem = torch.cat([ls.memory.to(h.dtype), h], dim=1)[:, -m:]  # (B, M, D)
            layers.append(LayerState(memory=mem))
        st = BackboneState(
            layers=layers,
            pos=torch.cat([state.pos, rec.pos], 1)[:, -m:],
            valid=torch.cat([state.valid, rec.valid], 1)[:, -m:],
            seg=torch.cat([state.seg, rec.seg], 1)[:, -m:],
            episode=state.episode,
            next_pos=state.next_pos,
        )
        return st, {}, {}


@MEMORY.register(
    "xl",
    description="Segment recurrence: each layer attends over cached hidden states of previous segments",
    paper="Dai et al. 2019, Transformer-XL (sec. 3.2)",
    capabilities=Capabilities(stateful=True, memory=True, exact_chunking=True),
)
@dataclass(frozen=True)
class XLMemoryConfig(MemoryConfig):
    """``mem_len``: memory length M (slots per layer, i.e. tokens); ``detach``: stop gradients
    into memory.

    Raises:
        ValueError: ``mem_len`` < 1.
    """

    mem_len: int = 64
    detach: bool = True

    def __post_init__(self) -> None:
        if self.mem_len < 1:
            raise ValueError(f"memory.mem_len must be >= 1, got {self.mem_len}")

    def build(self, ctx) -> MemoryModule:
        return XLMemory(self.mem_len, ctx.d_model, self.detach)
