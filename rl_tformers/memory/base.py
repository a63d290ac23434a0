"""Interface of memory kinds: how a backbone's state is created, updated and reset.

A memory kind is a registered config whose ``build(ctx)`` returns a :class:`MemoryModule`
built once per backbone. The state it manages is a :class:`~rl_tformers.types.BackboneState`
that the caller passes in and gets back; modules never keep it.

Lifecycle, for B independent streams (episodes / vector environments):

1. ``initial_state(blocks, batch, device, dtype)``: empty state (every slot invalid).
2. ``Backbone.forward(..., state=s)`` reads ``s.layers[i]`` (memory prefix or cache) and
   calls ``update(s, rec)`` with a :class:`SegmentRecord` of the segment (the layer inputs,
   positions, caches...) to produce the next state.
3. ``reset(s, episode_start (B,) bool)``: rows whose episode ended lose all their memory
   (slots invalidated and zeroed, episode id advanced); other rows are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from rl_tformers.backbone_config import SlotConfig
from rl_tformers.types import BackboneState, LayerState, _map


@dataclass(frozen=True)
class MemoryConfig(SlotConfig):
    """Base class of memory configs (``build(ctx) -> MemoryModule``)."""

    def build(self, ctx) -> MemoryModule:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class SegmentRecord:
    """What one forward pass hands to :meth:`MemoryModule.update`.

    Attributes:
        layer_inputs: per layer, the (B, T, D) hidden states the layer received.
        pos: (B, T) positions of the segment's tokens.
        valid: (B, T) bool, False for padding.
        seg: (B, T) long episode id of each token.
        caches: per layer, the attention kernel's updated incremental cache (or None).
        weights: per layer, attention probabilities (B, H, T, S) when they were computed.
        extras: per layer, anything a layer returned for its memory (kNN keys/values...).
        blocks: per layer, the block modules that ran (read-only: for memory losses that reuse
            a layer's projections, e.g. the compressive attention-reconstruction loss).
        readout: what the memory's :meth:`MemoryModule.read` returned for its update (memories
            that read at the output, ``reads_output``; None otherwise).
    """

    layer_inputs: list[Tensor]
    pos: Tensor
    valid: Tensor
    seg: Tensor
    caches: list[Any]
    weights: list[Tensor | None] = field(default_factory=list)
    extras: list[Any] = field(default_factory=list)
    blocks: list[nn.Module] = field(default_factory=list)
    readout: Any = None


class MemoryModule(nn.Module):
    """Base memory: stateless (no state unless the caller asks for incremental decoding)."""

    #: True for memories that also act on the backbone's output (:meth:`read`, memory kind
    #: ``spalm``): the backbone then computes every token's output, never a subset.
    reads_output = False

    def read(self, h: Tensor, x: Tensor, valid: Tensor, seg: Tensor, state: BackboneState | None
             ) -> tuple[Tensor, Any, dict[str, Tensor]]:
        """Act on the backbone's output ``h`` (B, T, D, after the final norm), given its input
        ``x`` (B, T, D), validity and episode ids (B, T) and the state the segment runs with
        (None without one). Returns the new output (B, T, D), what :meth:`update` receives as
        ``SegmentRecord.readout``, and metrics. Called only when :attr:`reads_output`; the base
        returns ``h`` unchanged."""
        return h, None, {}

    def initial_state(self, blocks, batch: int, device: torch.device, dtype: torch.dtype) -> BackboneState:
        """Empty state for ``batch`` streams (B) over the layers ``blocks``: every prefix slot
        invalid, episode ids and ``next_pos`` 0; memory / cache tensors in ``dtype``.

        Raises:
            NotImplementedError: in this base class; kind ``none`` raises it too when a
                layer's kernel has no incremental cache.
        """
        raise NotImplementedError

    def update(self, state: BackboneState, rec: SegmentRecord) -> tuple[BackboneState, dict[str, Tensor], dict[str, Any]]:
        """Next state after a segment; returns (state, aux losses, metrics)."""
        raise NotImplementedError

    def reset(self, state: BackboneState, episode_start: Tensor) -> BackboneState:
        """Clear exactly the rows where ``episode_start`` (B,) is True (see module docstring).

        Raises:
            ValueError: ``episode_start`` does not have shape (B,) (B = ``state.batch_size``).
        """
        start = episode_start.to(device=state.valid.device, dtype=torch.bool)
        if start.shape != (state.batch_size,):
            raise ValueError(f"reset: episode_start must have shape ({state.batch_size},), got {tuple(start.shape)}")
        keep = ~start
        layers = [_zero_rows(ls, keep) for ls in state.layers]
        return BackboneState(
            layers=layers,
            pos=state.pos * keep[:, None],
            valid=state.valid & keep[:, None],
            seg=state.seg,
            episode=state.episode + start.long(),
            next_pos=state.next_pos * keep,
            key_offset=state.key_offset,
        )


def _zero_rows(obj: Any, keep: Tensor) -> Any:
    """Zero the rows (batch axis 0) of every floating tensor inside ``obj`` where keep is False."""

    def fn(t: Tensor) -> Tensor:
        if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == keep.shape[0]:
            return t * keep.view(-1, *([1] * (t.dim() - 1))).to(t.dtype)
        return t

    return _map(obj, fn)


def empty_prefix(batch: int, length: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Bookkeeping of ``length`` unfilled slots: pos 0, valid False, seg -1 -> (B, length) each."""
    pos = torch.zeros(batch, length, dtype=torch.long, device=device)
    valid = torch.zeros(batch, length, dtype=torch.bool, device=device)
    seg = torch.full((batch, length), -1, dtype=torch.long, device=device)
    return pos, valid, seg


def new_state(layers: list[LayerState], batch: int, length: int, device: torch.device) -> BackboneState:
    """A :class:`BackboneState` over ``layers`` with ``length`` unfilled prefix slots
    (:func:`empty_prefix`: pos, valid, seg (B, length)), ``episode`` and ``next_pos`` (B,) 0,
    ``key_offset`` 0."""
    pos, valid, seg = empty_prefix(batch, length, device)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    return BackboneState(layers=layers, pos=pos, valid=valid, seg=seg, episode=zeros, next_pos=zeros.clone())
