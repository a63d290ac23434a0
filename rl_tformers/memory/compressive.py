"""Compressive Transformer memory (memory kind ``compressive``).

Rae et al. 2019, "Compressive Transformers for Long-Range Sequence Modelling" (sec. 3,
Algorithm 1). Each layer keeps

- a FIFO memory ``m_m`` of the most recent hidden states that entered the layer (as
  Transformer-XL, sec. 3.2 of Dai et al. 2019), and
- a compressed memory ``m_cm``: when activations leave the FIFO they are compressed at rate
  ``c`` (``c`` old slots -> 1 compressed slot) by ``f_c`` (sec. 3.1) and pushed into a second
  FIFO of ``compressed_len`` slots.

The layer attends over ``[compressed; fifo; segment]`` (``state.layers[i].memory`` is
``[compressed (m_cm); fifo (F)]``), so its temporal range is ``(m_m + c * m_cm) * N`` tokens
for N layers, at an attention cost of ``O(T (m_m + m_cm + T))`` (sec. 3).

Layout and bookkeeping
----------------------
- The compressed part always has ``compressed_len`` slots (unfilled ones invalid). The FIFO
  starts empty and holds between ``mem_len`` and ``mem_len + c - 1`` slots once filled: after a
  segment of T tokens the oldest ``floor((F + T - mem_len) / c) * c`` activations are evicted
  (F + T counted per row, over the slots of its current episode: see below),
  so the groups of ``c`` compressed together are consecutive activations whatever the segment
  lengths (T = 1 in environment rollouts compresses every ``c`` steps, exactly like one pass
  of longer segments would group them).
- A compressed slot summarises one group of ``c`` consecutive activations. Its *position* is
  the position of the newest valid activation of the group (relative encodings see it at the
  distance of that activation; at most ``c - 1`` steps too close for the older ones), its
  *episode id* that activation's, and it is valid iff the group has a valid member. Members
  that are invalid (padding, cleared by a reset) or belong to an earlier episode than the
  newest member are excluded from the compression (masked out of the pooling, zeroed for
  the convolutions), so no information crosses an episode boundary.
- Memories are stored detached (the paper's stop-gradient): the main loss never reaches
  them, and the compressor is trained only by its own losses.

Each row counts its own FIFO: only the slots of the row's current episode (the episode id of
its newest token) belong to it, right-aligned in a shared buffer of ``min(L, m_m + c - 1)``
slots (L: slots seen so far, the most any row can hold; the others are masked). A row reset
while others continue therefore groups, evicts and compresses exactly as a fresh stream of its
new episode would: vectorised evaluation acts the same for every number of environments.
Slots of a row's earlier episode (a training row that crosses an episode start) leave its FIFO at
the next update and are compressed like any evicted memory, in groups of c counted backwards
from the episode start: the compressor trains on them as the paper's does on all evicted
memory, and attention masks them by episode id. Only groups with a valid member enter the
compressed memory (a group of unfilled or cleared slots would push out a real one). An update in
which no row forms such a group (most steps of a one-step rollout) does not run the compressor:
the compressed memory stays as it is and no compression loss is returned.

Compression functions ``f_c`` (sec. 3.1; ``compression``):
``max`` / ``mean`` pooling with kernel and stride c; ``conv``: a 1D convolution with kernel and
stride c (initialised to mean pooling); ``dilated_conv``: a stack of kernel-2 convolutions with
dilations 1, 2, 4, ... (WaveNet-style, linear, initialised to mean pooling for any c) read out at the
newest slot of each group, receptive field ``2^L >= c`` inside the group; ``most_used``: keep
the member of each group that received the most attention on average while it sat in the FIFO
(the paper sorts the whole evicted block by usage; selecting per group keeps one bookkeeping for
all layers). Usage comes from the attention probabilities the kernel returned
(``Backbone.forward(..., need_weights=True)``, exact); without them it is recomputed as
content-based attention with the layer's projections (no positional terms; documented
approximation).

Losses (sec. 3.2), only for the learned compressors (``conv``, ``dilated_conv``), in ``aux``
already weighted by ``loss_weight`` and summed over layers:

- attention reconstruction: ``|| attn(h, old_mem) - attn(h, f_c(old_mem)) ||^2`` with ``h``
  the segment's layer inputs as queries and content-based multi-head attention through the
  layer's own Q/K/V projections;
- auto-encoding: ``|| old_mem - g(f_c(old_mem)) ||^2`` with a learned decoder ``g`` (a
  transposed convolution, kernel and stride c).

Both see only detached activations and detached attention weights, so their gradients reach
only the compressor (and the decoder): "we stop gradients from the compression losses into the
main network" (sec. 3.2). With parameter-free compressors nothing can be trained; the
reconstruction errors are then reported in ``metrics`` only.

The attention-reconstruction loss applies the layer's projections to the raw layer inputs; a
pre-norm block applies its LayerNorm first, so for pre-norm blocks the loss reconstructs
attention read through un-normalised inputs (a faithful objective for "keep what attention
reads", not the exact attention of the block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.attention.base import attention_reference
from rl_tformers.memory.base import MemoryConfig, MemoryModule, SegmentRecord, empty_prefix
from rl_tformers.registry import MEMORY, Capabilities
from rl_tformers.types import BackboneState, LayerState, build_allowed, state_type

COMPRESSIONS = ("max", "mean", "conv", "dilated_conv", "most_used")
LOSSES = ("attention", "autoencoding", "both", "none")


@state_type
@dataclass
class FifoUsage:
    """Attention received by the FIFO slots of one layer (compression ``most_used`` only).

    Attributes:
        usage: (B, F) attention probability mass received, summed over heads and queries.
        seen: (B, F) number of valid queries that came after the slot (the average usage is
            ``usage / (H * seen)``).
    """

    usage: Tensor
    seen: Tensor


def group_bookkeeping(pos: Tensor, valid: Tensor, seg: Tensor, rate: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Bookkeeping of compressed slots made from groups of ``rate`` consecutive slots.

    Args:
        pos, valid, seg: (B, G * c) positions, validity and episode ids of the evicted slots.
        rate: c.
    Returns:
        pos (B, G), valid (B, G), seg (B, G) of the compressed slots and ``include`` (B, G, c)
        bool: the members that enter the compression (valid and in the episode of the group's
        newest valid member, the "anchor"). A group without valid members is invalid, with
        position 0 and episode id -1.
    """
    b, n = pos.shape
    g = n // rate
    vg = valid.view(b, g, rate)  # (B, G, c)
    idx = torch.arange(rate, device=pos.device)
    anchor = torch.where(vg, idx, -1).amax(-1)  # (B, G) index of the newest valid member, -1 if none
    has = anchor >= 0
    a = anchor.clamp_min(0)[..., None]  # (B, G, 1)
    gpos = pos.view(b, g, rate).gather(-1, a)[..., 0]  # (B, G, c) -> (B, G)
    gseg = seg.view(b, g, rate).gather(-1, a)[..., 0]  # (B, G, c) -> (B, G)
    include = vg & (seg.view(b, g, rate) == gseg[..., None]) & has[..., None]  # (B, G, c)
    return gpos * has, has, torch.where(has, gseg, torch.full_like(gseg, -1)), include


class Compressor(nn.Module):
    """The compression function ``f_c`` of one layer (Rae et al. 2019, sec. 3.1) and, for the
    auto-encoding loss, its decoder ``g``.

    ``forward(x (B, G, c, D), include (B, G, c) bool, usage (B, G, c) | None) -> (B, G, D)``:
    one compressed slot per group of ``c`` consecutive activations (oldest first). Excluded
    members never influence the result. A group with no included member gives zeros.

    Raises:
        ValueError: ``kind`` is not one of :data:`COMPRESSIONS` (at construction); ``forward``
            of ``most_used`` without ``usage``.
    """

    def __init__(self, kind: str, d_model: int, rate: int, decoder: bool) -> None:
        super().__init__()
        if kind not in COMPRESSIONS:
            raise ValueError(f"memory.compression={kind!r}; choose one of {', '.join(COMPRESSIONS)}")
        self.kind, self.d, self.rate = kind, d_model, rate
        if kind == "conv":
            # Conv1d(D, D, kernel=c, stride=c) written as a Linear over a flattened group.
            self.conv = nn.Linear(rate * d_model, d_model)
            with torch.no_grad():  # start as mean pooling
                self.conv.weight.copy_(torch.eye(d_model).repeat(1, rate) / rate)
                self.conv.bias.zero_()
        elif kind == "dilated_conv":
            n_layers = max(1, math.ceil(math.log2(rate)))
            self.dilations = [2**i for i in range(n_layers)]
            self.taps = nn.ParameterList()
            self.biases = nn.ParameterList()
            # taps (2, D_out, D_in): [older, newer], both t I with t = c^(-1/L): the readout at the
            # group's newest slot sums every slot of the receptive field 2^L >= c with weight t^L = 1/c,
            # and the 2^L - c slots before the group are zero padding, so the stack starts as mean
            # pooling for any c (t = 1/2 only when c = 2^L)
            tap = float(rate) ** (-1.0 / n_layers)
            for _ in self.dilations:
                self.taps.append(nn.Parameter(torch.eye(d_model).repeat(2, 1, 1) * tap))
                self.biases.append(nn.Parameter(torch.zeros(d_model)))
        self.decoder = nn.Linear(d_model, rate * d_model) if decoder and self.learned else None

    @property
    def learned(self) -> bool:
        """True for the compressors with parameters (``conv``, ``dilated_conv``)."""
        return self.kind in ("conv", "dilated_conv")

    def forward(self, x: Tensor, include: Tensor, usage: Tensor | None = None) -> Tensor:
        """(B, G, c, D) members, (B, G, c) bool ``include``, (B, G, c) average usage (for
        ``most_used``) -> (B, G, D); see the class docstring."""
        b, g, c, d = x.shape
        inc = include[..., None]  # (B, G, c, 1)
        has = include.any(-1, keepdim=True)  # (B, G, 1)
        if self.kind == "max":
            out = x.masked_fill(~inc, torch.finfo(x.dtype).min).amax(2)
        elif self.kind == "mean":
            out = (x * inc).sum(2) / include.sum(-1, keepdim=True).clamp_min(1).to(x.dtype)
        elif self.kind == "most_used":
            if usage is None:
                raise ValueError("compression 'most_used' needs the usage of every member")
            pick = usage.masked_fill(~include, float("-inf")).argmax(-1)  # (B, G)
            out = x.gather(2, pick[:, :, None, None].expand(b, g, 1, d))[:, :, 0]
        elif self.kind == "conv":
            out = self.conv((x * inc).reshape(b, g, c * d))  # (B, G, c*D) -> (B, G, D)
        else:
            out = self._dilated((x * inc).reshape(b * g, c, d)).view(b, g, d)  # (B*G, c, D) -> (B, G, D)
        return out * has.to(out.dtype)

    def _dilated(self, h: Tensor) -> Tensor:
        """(N, c, D) -> (N, D): causal dilated stack, read out at the newest slot."""
        for dil, taps, bias in zip(self.dilations, self.taps, self.biases):
            older = F.pad(h, (0, 0, dil, 0))[:, : h.shape[1]]  # (N, c, D): h shifted by `dil` (zeros before)
            h = older @ taps[0].t() + h @ taps[1].t() + bias
        return h[:, -1]

    def decode(self, z: Tensor) -> Tensor:
        """g: (B, G, D) -> (B, G, c, D) reconstruction of the members (auto-encoding loss)."""
        b, g, d = z.shape
        return self.decoder(z).view(b, g, self.rate, d)  # (B, G, c*D) -> (B, G, c, D)


def _linear(lin: nn.Linear, x: Tensor) -> Tensor:
    """``lin(x)`` with detached parameters: gradients reach x only."""
    return F.linear(x, lin.weight.detach(), None if lin.bias is None else lin.bias.detach())


def content_attention(attn: nn.Module, h: Tensor, mem: Tensor, mem_valid: Tensor, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Content-based multi-head attention of queries ``h`` over ``mem`` with the projections of
    a layer's attention module, its parameters detached (Rae et al. 2019, sec. 3.2).

    Args:
        attn: an :class:`~rl_tformers.attention.base.AttentionModule` (q/k/v projections).
        h: (B, T, D) queries (layer inputs).
        mem: (B, M, D) memories (keys and values).
        mem_valid: (B, M) bool.
        allowed: optional (B, 1, T, M) bool mask replacing the key-validity mask.
    Returns:
        out (B, H, T, Dh) and probabilities (B, H, T, M); rows with no valid key are zeros.
    """
    base = getattr(attn, "base", attn)  # kNN-wrapped layers keep their projections on .base
    k_lin = base.q_proj if base.k_proj is None else base.k_proj
    q = base.split_heads(_linear(base.q_proj, h))  # (B, H, T, Dh)
    k = base.split_heads(_linear(k_lin, mem))  # (B, H, M, Dh)
    v = base.split_heads(_linear(base.v_proj, mem))
    mask = mem_valid[:, None, None, :] if allowed is None else allowed
    return attention_reference(q, k, v, mask, scale=base.scale)


@dataclass
class _Eviction:
    """One segment's update of the slot bookkeeping (:meth:`CompressiveMemory._evict`), shared by
    every layer: L = ``n_all`` slots of ``[fifo; segment]``, G = ``g`` groups of c.

    Attributes:
        gidx: (B, G*c) long, the slot of ``[fifo; segment]`` of each group member.
        include: (B, G, c) bool, the members the compressor pools.
        gval: (B, G) bool, groups with a valid member (they enter the compressed memory).
        order: (B, G) long, valid groups first, oldest first.
        push: (B, m_cm) long, the compressed slots kept from ``[compressed; ordered groups]``.
        kept: (B, keep_len) bool, the kept FIFO slots (each row's last ones, right-aligned).
        pos, valid, seg: (B, m_cm + keep_len) the next state's positions, validity and episodes.
    """

    n_all: int
    g: int
    keep_len: int
    gidx: Tensor
    include: Tensor
    gval: Tensor
    order: Tensor
    push: Tensor
    kept: Tensor
    pos: Tensor
    valid: Tensor
    seg: Tensor


class CompressiveMemory(MemoryModule):
    """Per layer: ``[compressed (m_cm); FIFO (>= m_m)]`` memory; see the module docstring.

    Args:
        mem_len: m_m, FIFO length.
        compressed_len: m_cm, compressed-memory length.
        rate: c, compression rate (old slots per compressed slot).
        compression: one of ``max``, ``mean``, ``conv``, ``dilated_conv``, ``most_used``.
        loss: ``attention`` (the paper's best), ``autoencoding``, ``both`` or ``none``.
        loss_weight: weight of the compression losses in ``aux``.
        d_model, n_layers, causal: from the backbone config.
    """

    def __init__(
        self, mem_len: int, compressed_len: int, rate: int, compression: str, loss: str,
        loss_weight: float, d_model: int, n_layers: int, causal: bool,
    ) -> None:
        super().__init__()
        self.m_m, self.m_cm, self.rate = mem_len, compressed_len, rate
        self.compression, self.loss, self.loss_weight = compression, loss, loss_weight
        self.d_model, self.n_layers, self.causal = d_model, n_layers, causal
        ae = loss in ("autoencoding", "both")
        self.compressors = nn.ModuleList(Compressor(compression, d_model, rate, ae) for _ in range(n_layers))

    @property
    def temporal_range(self) -> int:
        """(m_m + c * m_cm) * N: the furthest token any output can depend on (sec. 3)."""
        return (self.m_m + self.rate * self.m_cm) * self.n_layers

    # -- state -----------------------------------------------------------------------------------
    def initial_state(self, blocks, batch, device, dtype) -> BackboneState:
        """Per layer a zero (B, m_cm, D) memory in ``dtype`` (every compressed slot invalid,
        the FIFO empty) and, for ``most_used``, an empty :class:`FifoUsage`."""
        n = len(blocks)
        layers = [
            LayerState(
                memory=torch.zeros(batch, self.m_cm, self.d_model, device=device, dtype=dtype),
                extra=self._empty_usage(batch, 0, device) if self.compression == "most_used" else None,
            )
            for _ in range(n)
        ]
        pos, valid, seg = empty_prefix(batch, self.m_cm, device)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return BackboneState(layers=layers, pos=pos, valid=valid, seg=seg, episode=zeros, next_pos=zeros.clone())

    @staticmethod
    def _empty_usage(batch: int, n: int, device) -> FifoUsage:
        z = torch.zeros(batch, n, device=device)
        return FifoUsage(z, z.clone())

    def compressed_count(self, state: BackboneState) -> Tensor:
        """(B,) number of valid compressed slots per row."""
        return state.valid[:, : self.m_cm].sum(1)

    def fifo_count(self, state: BackboneState) -> Tensor:
        """(B,) number of valid FIFO slots per row."""
        return state.valid[:, self.m_cm :].sum(1)

    # -- update ----------------------------------------------------------------------------------
    def update(self, state: BackboneState, rec: SegmentRecord):
        """Append the segment to each layer's FIFO, compress what leaves it (Algorithm 1).

        Each row counts its own FIFO: only the slots of its current episode (the episode of its
        newest token) are in it, so a row whose episode started at any time groups and evicts
        exactly as a fresh stream of that episode would, whatever the other rows do.

        Returns (next state, aux {"compressive/attention_reconstruction",
        "compressive/autoencoding"} weighted and summed over layers when computed, metrics).
        """
        ev = self._evict(state, rec)
        aux_ar: list[Tensor] = []
        aux_ae: list[Tensor] = []
        layers = []
        any_group = bool(ev.gval.any())  # some row made a group (one sync per segment)
        for i, (ls, h) in enumerate(zip(state.layers, rec.layer_inputs)):
            layer, ar, ae = self._update_layer(i, ls, h.detach(), state, rec, ev, any_group)
            layers.append(layer)
            aux_ar += [ar] if ar is not None else []
            aux_ae += [ae] if ae is not None else []
        new_state = BackboneState(
            layers=layers, pos=ev.pos, valid=ev.valid, seg=ev.seg, episode=state.episode, next_pos=state.next_pos,
        )
        aux: dict[str, Tensor] = {}
        metrics: dict[str, object] = {
            "memory/temporal_range": float(self.temporal_range),
            "memory/compressed_fill": ev.valid[:, : self.m_cm].float().mean().detach(),
        }
        learned = self.compressors[0].learned
        for name, vals in (("attention_reconstruction", aux_ar), ("autoencoding", aux_ae)):
            if vals:
                total = torch.stack(vals).sum()
                metrics[f"memory/{name}"] = total.detach()
                if learned:
                    aux[f"compressive/{name}"] = self.loss_weight * total
        return new_state, aux, metrics

    def _evict(self, state: BackboneState, rec: SegmentRecord) -> _Eviction:
        """Where each slot of ``[fifo; segment]`` goes (the same for every layer): the groups of c
        evicted slots, which of them enter the compressed memory, the kept FIFO, and the next
        state's positions, validity and episodes."""
        mc, c = self.m_cm, self.rate
        dev = rec.pos.device
        n_all = state.pos.shape[1] - mc + rec.pos.shape[1]  # L = F + T slots of [fifo; segment]
        fpos = torch.cat([state.pos[:, mc:], rec.pos], 1)  # (B, L)
        fval = torch.cat([state.valid[:, mc:], rec.valid], 1)
        fseg = torch.cat([state.seg[:, mc:], rec.seg], 1)
        # per row: m_b slots of the current episode (a suffix: episode ids only grow along a row),
        # e_b of them evicted (a multiple of c), r_b kept; the slots before the current episode
        # (earlier episodes, cleared or unfilled slots) all leave the FIFO now
        n_row = (fseg == fseg[:, -1:]).sum(1)  # (B,)
        n_ev = (n_row - self.m_m).clamp_min(0) // c * c  # (B,)
        n_keep = n_row - n_ev
        first = n_all - n_row  # (B,) index of the row's oldest slot of its current episode
        # groups of c with a boundary at `first`: ceil(first / c) groups before it (the earlier
        # episodes' slots, compressed too: the compressor trains on them as on any evicted memory,
        # and attention masks them by episode), n_ev / c after it
        n_before = (first + c - 1) // c  # (B,)
        made = n_before + n_ev // c  # (B,) groups formed by each row
        g = (n_all + c - 1) // c  # G >= every row's groups: static shapes, no sync
        keep_len = min(n_all, self.m_m + c - 1)  # >= every row's r_b
        cpos, cval, cseg = state.pos[:, :mc], state.valid[:, :mc], state.seg[:, :mc]
        raw = (first - n_before * c)[:, None] + torch.arange(g * c, device=dev)  # (B, G*c), may start < 0
        real = (raw >= 0) & (torch.arange(g, device=dev) < made[:, None]).repeat_interleave(c, 1)  # (B, G*c)
        gidx = raw.clamp(0, n_all - 1)
        gpos, gval, gseg, include = group_bookkeeping(
            fpos.gather(1, gidx), fval.gather(1, gidx) & real, fseg.gather(1, gidx), c,
        )
        # only groups with a valid member enter the compressed memory (oldest first): a group of
        # unfilled or cleared slots would push out a real compressed slot
        ar_g = torch.arange(g, device=dev)
        order = torch.where(gval, ar_g, ar_g + g).argsort(1)  # (B, G): valid groups first, in order
        n_push = gval.sum(1)  # (B,)
        push = n_push[:, None] + torch.arange(mc, device=dev)  # (B, m_cm): last m_cm of [cm; valid new]
        cpos = torch.cat([cpos, gpos.gather(1, order)], 1).gather(1, push)
        cval = torch.cat([cval, gval.gather(1, order)], 1).gather(1, push)
        cseg = torch.cat([cseg, gseg.gather(1, order)], 1).gather(1, push)
        # the kept FIFO: each row's last r_b slots, right-aligned in keep_len slots
        kept = torch.arange(keep_len, device=dev) >= (keep_len - n_keep)[:, None]  # (B, keep_len)
        fpos = fpos[:, n_all - keep_len :] * kept
        fval = fval[:, n_all - keep_len :] & kept
        fseg = torch.where(kept, fseg[:, n_all - keep_len :], -1)
        return _Eviction(n_all=n_all, g=g, keep_len=keep_len, gidx=gidx, include=include, gval=gval, order=order,
                         push=push, kept=kept, pos=torch.cat([cpos, fpos], 1), valid=torch.cat([cval, fval], 1),
                         seg=torch.cat([cseg, fseg], 1))

    def _update_layer(self, i: int, ls: LayerState, h: Tensor, state: BackboneState, rec: SegmentRecord,
                      ev: _Eviction, any_group: bool) -> tuple[LayerState, Tensor | None, Tensor | None]:
        """Layer ``i``'s next memory ``[compressed; kept FIFO]`` from its state ``ls`` and the
        segment's detached layer inputs ``h`` (B, T, D), with its unweighted losses (attention
        reconstruction, auto-encoding; None when not computed)."""
        b, mc, c, d = h.shape[0], self.m_cm, self.rate, self.d_model
        mem = ls.memory.to(h.dtype)
        cm, fifo = mem[:, :mc], mem[:, mc:]
        allf = torch.cat([fifo, h], 1)  # (B, L, D)
        usage = self._accumulate_usage(i, ls, state, rec, h) if self.compression == "most_used" else None
        ar = ae = None
        # without a group with a valid member (most steps of one-step rollouts) nothing is
        # compressed and the compressed memory stays as it is
        if any_group:
            old = allf.gather(1, ev.gidx[..., None].expand(b, ev.g * c, d)).view(b, ev.g, c, d)  # (B, G, c, D)
            avg = None
            if usage is not None:
                avg = (usage.usage / usage.seen.clamp_min(1)).gather(1, ev.gidx).view(b, ev.g, c)  # (B, G, c)
            comp = self.compressors[i]
            new = comp(old, ev.include, avg)  # (B, G, D)
            ar, ae = self._losses(comp, rec.blocks[i] if rec.blocks else None, h, rec.valid, old, ev.include, new,
                                  ev.gval)
            new = new.detach().to(cm.dtype).gather(1, ev.order[..., None].expand(b, ev.g, d))
            cm = torch.cat([cm, new], 1).gather(1, ev.push[..., None].expand(b, mc, d))
        cut = ev.n_all - ev.keep_len
        extra = None
        if usage is not None:
            extra = FifoUsage(usage.usage[:, cut:] * ev.kept, usage.seen[:, cut:] * ev.kept)
        fifo = allf[:, cut:] * ev.kept[..., None].to(allf.dtype)
        return LayerState(memory=torch.cat([cm, fifo.to(cm.dtype)], 1), extra=extra), ar, ae

    def _losses(self, comp: Compressor, block, h, h_valid, old, include, new, new_valid):
        """Attention-reconstruction and auto-encoding losses of one layer (sec. 3.2).

        old (B, G, c, D) detached, include (B, G, c), new (B, G, D) = f_c(old), new_valid (B, G).
        Returns (attention loss or None, auto-encoding loss or None), unweighted.
        """
        b, g, c, d = old.shape
        ar = ae = None
        if self.loss in ("attention", "both") and block is not None:
            a_old, _ = content_attention(block.attn, h, old.reshape(b, g * c, d), include.reshape(b, g * c))  # (B, H, T, Dh)
            a_new, _ = content_attention(block.attn, h, new, new_valid)
            # valid queries of the rows that made a group: (B, 1, T, 1)
            qv = (h_valid & new_valid.any(1, keepdim=True))[:, None, :, None].to(a_old.dtype)
            n = (qv.sum() * a_old.shape[1] * a_old.shape[-1]).clamp_min(1)
            ar = (((a_old - a_new) ** 2) * qv).sum() / n
        if self.loss in ("autoencoding", "both") and comp.decoder is not None:
            rec = comp.decode(new)  # (B, G, c, D)
            m = include[..., None].to(rec.dtype)
            ae = (((rec - old) ** 2) * m).sum() / (m.sum() * d).clamp_min(1)
        elif self.loss in ("autoencoding", "both") and not comp.learned:
            rec = new[:, :, None].expand_as(old)  # parameter-free: report how much was lost
            m = include[..., None].to(rec.dtype)
            ae = (((rec - old) ** 2) * m).sum() / (m.sum() * d).clamp_min(1)
        return ar, ae

    def _accumulate_usage(self, i: int, ls: LayerState, state: BackboneState, rec: SegmentRecord, h: Tensor) -> FifoUsage:
        """Usage of the FIFO slots and the segment's tokens after this segment's attention.

        Returns FifoUsage over the (B, F + T) slots of ``[fifo; segment]``.
        """
        mc = self.m_cm
        b, t = rec.pos.shape
        prev = ls.extra if isinstance(ls.extra, FifoUsage) else self._empty_usage(b, state.pos.shape[1] - mc, h.device)
        w = rec.weights[i] if i < len(rec.weights) else None
        if w is None:  # recompute content-based probabilities with the layer's projections
            keys = torch.cat([ls.memory.to(h.dtype), h], 1)  # (B, S, D)
            allowed = build_allowed(
                t, keys.shape[1], torch.cat([state.valid, rec.valid], 1), rec.seg,
                torch.cat([state.seg, rec.seg], 1), self.causal, device=h.device, batch=b,
            )
            with torch.no_grad():
                _, w = content_attention(rec.blocks[i].attn, h, keys, torch.ones_like(keys[..., 0], dtype=torch.bool), allowed)
        w = w.detach().float()[..., mc:]  # (B, H, T, F + T): mass received by fifo and segment slots
        w = w * rec.valid[:, None, :, None]
        got = w.sum((1, 2))  # (B, F + T)
        nq = rec.valid.sum(1, keepdim=True).float()  # (B, 1)
        if self.causal:  # segment token j is seen by the valid queries at j and after
            after = rec.valid.flip(1).float().cumsum(1).flip(1)  # (B, T)
        else:
            after = nq.expand(b, t)
        seen_add = torch.cat([nq.expand(b, prev.seen.shape[1]), after], 1) * w.shape[1]
        usage = torch.cat([prev.usage, torch.zeros(b, t, device=h.device)], 1) + got
        seen = torch.cat([prev.seen, torch.zeros(b, t, device=h.device)], 1) + seen_add
        return FifoUsage(usage, seen)


@MEMORY.register(
    "compressive",
    description="Transformer-XL FIFO memory plus a compressed memory of older activations (rate c)",
    paper="Rae et al. 2019, Compressive Transformers for Long-Range Sequence Modelling (sec. 3, Alg. 1)",
    capabilities=Capabilities(stateful=True, memory=True),
)
@dataclass(frozen=True)
class CompressiveMemoryConfig(MemoryConfig):
    """Compressive memory.

    Attributes:
        mem_len: m_m, FIFO slots per layer (the Transformer-XL part).
        compressed_len: m_cm, compressed slots per layer.
        rate: c, activations per compressed slot.
        compression: ``max``, ``mean``, ``conv`` (default; best in the paper with ``dilated_conv``),
            ``dilated_conv`` or ``most_used``.
        loss: compression losses: ``attention`` (attention reconstruction, the paper's best),
            ``autoencoding``, ``both`` or ``none``.
        loss_weight: weight of the compression losses in ``aux``.

    Raises:
        ValueError: ``mem_len``, ``compressed_len`` or ``rate`` < 1, ``compression`` or ``loss``
            not one of the kinds above, ``loss_weight`` < 0.
    """

    mem_len: int = 32
    compressed_len: int = 32
    rate: int = 3
    compression: str = "conv"
    loss: str = "attention"
    loss_weight: float = 1.0

    #: compressor parameters are trained only by the compression losses (and only after an
    #: eviction), so a single forward pass may leave them without a gradient.
    contract_no_grad = ("memory.compressors.*",)

    def __post_init__(self) -> None:
        if self.mem_len < 1 or self.compressed_len < 1:
            raise ValueError(
                f"memory.mem_len and memory.compressed_len must be >= 1, got {self.mem_len}, {self.compressed_len}"
            )
        if self.rate < 1:
            raise ValueError(f"memory.rate must be >= 1, got {self.rate}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"memory.compression={self.compression!r}; choose one of {', '.join(COMPRESSIONS)}")
        if self.loss not in LOSSES:
            raise ValueError(f"memory.loss={self.loss!r}; choose one of {', '.join(LOSSES)}")
        if self.loss_weight < 0:
            raise ValueError(f"memory.loss_weight must be >= 0, got {self.loss_weight}")

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Small field values for the contract tests with segments of ``seq_len`` tokens."""
        return {"mem_len": max(2, seq_len // 2), "compressed_len": 4, "rate": 2}

    def build(self, ctx) -> MemoryModule:
        cfg = ctx.config
        return CompressiveMemory(
            self.mem_len, self.compressed_len, self.rate, self.compression, self.loss,
            self.loss_weight, cfg.d_model, cfg.n_layers, cfg.causal,
        )
