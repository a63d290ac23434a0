"""Shared data types of the backbone library.

Axis names used in every docstring: B batch, T tokens of the current segment (queries),
M memory/prefix slots, S = M + T keys, H heads, Dh head dim, D model dim.

Mask polarity is one and the same everywhere: **True = may attend** (or: is a real token).
Fill values for disallowed scores come from ``torch.finfo(dtype).min``, never a literal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax and score arithmetic run in: float32 for half types (fp16, bf16) and
    float32 itself, float64 for float64 (so a float64 model is exact to float64 rounding)."""
    return torch.promote_types(dtype, torch.float32)


def to_acc(x: torch.Tensor) -> torch.Tensor:
    """``x`` in :func:`acc_dtype` of its dtype (a no-op for float32 and float64)."""
    return x.to(acc_dtype(x.dtype))


def state_type(cls: type) -> type:
    """Class decorator for the dataclasses a :class:`BackboneState` may hold (layer states,
    caches, memory stores): allows them in ``torch.load(weights_only=True)`` (PyTorch's default
    since 2.6) through ``torch.serialization.add_safe_globals``, so a state saved with
    ``torch.save`` loads back without ``weights_only=False``. They hold only tensors, numbers and
    other state types: unpickling them runs no code of the file's choosing."""
    torch.serialization.add_safe_globals([cls])
    return cls


#: tokens chosen along T: a slice (the same for every row) or a (B, P) long tensor of per-row indices
TokenIndex = slice | Tensor


def take_tokens(x: Tensor, index: TokenIndex, dim: int = 1) -> Tensor:
    """The tokens ``index`` of ``x`` along its token axis ``dim`` (batch axis 0).

    Args:
        x: (B|1, ..., T, ...) with T at ``dim``; a batch axis of 1 is broadcast to B.
        index: a slice along T (``x[:, ..., index]``, a view), or a (B, P) long tensor of
            per-row token indices in [0, T) (gathered: row b keeps tokens ``index[b]``).

    Returns:
        ``x`` with P (or the slice's length) tokens at ``dim``.

    The index is not checked here: :meth:`rl_tformers.backbone.Backbone.forward` refuses a bad
    ``output_tokens`` (shape, dtype, range) with a ValueError before any layer calls this; an
    unchecked out-of-range index raises torch's RuntimeError from ``gather``.
    """
    if isinstance(index, slice):
        return x[(slice(None),) * dim + (index,)]
    b, p = index.shape
    shape = list(x.shape)
    shape[0] = b
    idx_shape = [b] + [1] * (x.dim() - 1)
    idx_shape[dim] = p
    shape[dim] = p
    return x.expand(b, *x.shape[1:]).gather(dim, index.reshape(idx_shape).expand(shape))


def neg_inf(dtype: torch.dtype) -> float:
    """Most negative finite value of ``dtype``: the fill for disallowed attention scores."""
    return torch.finfo(dtype).min


@dataclass
class AttnContext:
    """Everything an attention kernel needs for one call, besides its inputs.

    Self-attention layout: the T queries are the *last* T of the S keys (keys are
    ``[prefix (M); segment (T)]``), so query i sits at key index ``M + i``.

    Attributes:
        pos_q: (B, T) positions of the queries (caller's units: steps or token indices).
        pos_k: (B, S) positions of the keys.
        key_valid: (B, S) bool, True = real key, False = padding/unfilled memory. ``None``: all real.
        seg_q: (B, T) long episode id of each query, or ``None`` (one episode).
        seg_k: (B, S) long episode id of each key; a query attends only to keys of its episode.
        causal: query i may attend key j only if ``j <= M + i``.
        need_weights: kernels that can return attention probabilities put them in the output
            (used for metrics such as attention entropy and by most-used compression).
        layer_idx: index of the layer being run (for per-layer patterns).
        key_offset: absolute key index of key 0 (``pos_k[:, 0]``): the number of earlier keys a
            bounded incremental cache dropped (:attr:`BackboneState.key_offset`), 0 otherwise.
            Kernels whose pattern is defined on key indices (block alignment, see
            :meth:`~rl_tformers.attention.base.AttentionModule.cache_keeps`) count from the first
            key ever fed: key ``j`` of this context has absolute index ``key_offset + j``. Masks,
            causality and :attr:`prefix_len` are unaffected (they are on this context's keys).
    """

    pos_q: Tensor
    pos_k: Tensor
    key_valid: Tensor | None = None
    seg_q: Tensor | None = None
    seg_k: Tensor | None = None
    causal: bool = True
    need_weights: bool = False
    layer_idx: int = 0
    key_offset: int = 0
    _allowed: Tensor | None = field(default=None, repr=False)
    # per-context cache of tensors derived from the mask and positions, shared by every layer
    # of one forward: additive_mask's (mask, row_ok) keyed by dtype, and the XL-relative
    # distance tables (sinusoids of the allowed distances + each pair's row) keyed by
    # ("xl_relative", d_model, base, dtype). Not an init field, so every dataclasses.replace
    # (select, select_queries...) starts a fresh cache: nothing derived from other queries or keys
    # is ever reused
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def q_len(self) -> int:
        """T: number of queries (``pos_q.shape[1]``)."""
        return self.pos_q.shape[1]

    @property
    def k_len(self) -> int:
        """S: number of keys (``pos_k.shape[1]``), memory/prefix slots included."""
        return self.pos_k.shape[1]

    @property
    def prefix_len(self) -> int:
        """M: number of keys before the first query's own key."""
        return self.k_len - self.q_len

    @property
    def is_plain_causal(self) -> bool:
        """True when the mask is exactly the lower-triangular causal mask (fast SDPA path)."""
        return self.causal and self.key_valid is None and self.seg_q is None and self.prefix_len == 0

    @property
    def has_mask(self) -> bool:
        """False when every query may attend every key (no causality, padding or episodes)."""
        return self.causal or self.key_valid is not None or self.seg_q is not None

    def allowed(self) -> Tensor:
        """Dense (B|1, 1, T, S) bool mask, True = query may attend key (cached per context);
        the batch axis is 1 when neither ``key_valid`` nor episode ids are given.

        Combines causality (with the prefix offset), key padding and episode ids.
        """
        if self._allowed is None:
            self._allowed = build_allowed(
                self.q_len, self.k_len, self.key_valid, self.seg_q, self.seg_k, self.causal,
                device=self.pos_q.device, batch=self.pos_q.shape[0],
            )
        return self._allowed

    def additive_mask(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """:meth:`allowed` as an additive score mask, computed once per context and dtype.

        Returns:
            mask (B|1, 1, T, S) ``dtype``: 0 where the query may attend, ``finfo(dtype).min``
            elsewhere, except in rows with no allowed key, left open (all 0) so they stay finite;
            row_ok (B|1, 1, T, 1) ``dtype``: 1 for rows with an allowed key, 0 for the others
            (multiply the output by it: such rows return zeros).
        """
        hit = self._derived.get(dtype)
        if hit is None:
            allowed = self.allowed()
            row_ok = allowed.any(dim=-1, keepdim=True)  # (B|1, 1, T, 1)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask.masked_fill_(~(allowed | ~row_ok), neg_inf(dtype))
            hit = self._derived[dtype] = (mask, row_ok.to(dtype))
        return hit

    def select(self, start: int, end: int) -> AttnContext:
        """Context restricted to queries ``start:end`` (keys unchanged)."""
        return dataclasses.replace(
            self,
            pos_q=self.pos_q[:, start:end],
            seg_q=None if self.seg_q is None else self.seg_q[:, start:end],
            _allowed=None if self._allowed is None else self._allowed[:, :, start:end],
        )

    def select_queries(self, index: TokenIndex) -> AttnContext:
        """Context of the queries ``index`` (any slice along T, e.g. ``slice(1, None, 3)``, or
        a (B, P) long tensor of per-row query indices, :func:`take_tokens`) over the same keys,
        carrying their rows of the dense mask: (B|1, 1, T', S), (B, 1, P, S) for a tensor.

        The selected queries are no longer the last T' keys, so only kernels that read the
        mask from :meth:`allowed` (dense attention: ``query_subset = True``) may use it.
        """
        return dataclasses.replace(
            self,
            pos_q=take_tokens(self.pos_q, index),
            seg_q=None if self.seg_q is None else take_tokens(self.seg_q, index),
            _allowed=take_tokens(self.allowed(), index, dim=2),
        )


def build_allowed(
    t: int,
    s: int,
    key_valid: Tensor | None,
    seg_q: Tensor | None,
    seg_k: Tensor | None,
    causal: bool,
    *,
    device: torch.device,
    batch: int,
) -> Tensor:
    """(B or 1, 1, T, S) bool: True = may attend. See :class:`AttnContext` for the layout."""
    allowed = torch.ones(1, 1, t, s, dtype=torch.bool, device=device)
    if causal:
        q_idx = torch.arange(t, device=device)[:, None] + (s - t)
        k_idx = torch.arange(s, device=device)[None, :]
        allowed = allowed & (k_idx <= q_idx)[None, None]
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :]
    if seg_q is not None and seg_k is not None:
        allowed = allowed & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
    return allowed


@dataclass
class AttnOutput:
    """Result of one attention call.

    Attributes:
        out: (B, T, D) attended values after the output projection.
        cache: updated incremental-decoding cache (kernel-specific) or ``None``.
        aux: weighted scalar losses the agent adds to its loss (e.g. span L1 penalty).
        metrics: values to log (floats or 0-d tensors), e.g. span, entropy.
        weights: (B, H, T, S) attention probabilities when requested and available.
    """

    out: Tensor
    cache: Any = None
    aux: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    weights: Tensor | None = None


@state_type
@dataclass
class LayerState:
    """Per-layer state carried between calls; owned by the caller, never by the module.

    Attributes:
        memory: (B, M, D) hidden states prepended to the layer's keys/values
            (Transformer-XL memory; compressive memory puts ``[compressed; fifo]`` here).
        cache: kernel-specific incremental-decoding cache (dense: keys/values; linear
            attention: running sums), used when the memory kind is ``none``.
        extra: memory-kind specific content (compressive FIFO parts, kNN store, ...).
    """

    memory: Tensor | None = None
    cache: Any = None
    extra: Any = None


@state_type
@dataclass
class BackboneState:
    """State of a whole backbone for a batch of B independent streams (episodes/envs).

    The prefix bookkeeping (positions, validity, episode id of each slot) is shared by all
    layers; the content is per layer in ``layers``.

    Attributes:
        layers: one :class:`LayerState` per layer.
        pos: (B, P) long positions of the prefix slots.
        valid: (B, P) bool, False for unfilled slots and slots cleared by a reset.
        seg: (B, P) long episode id of each prefix slot.
        episode: (B,) long current episode id of each row (incremented by resets).
        next_pos: (B,) long default position of the next token.
        key_offset: number of keys dropped from the front of the prefix: slot ``p`` is key
            ``key_offset + p`` of the stream. Memory kind ``none`` drops the slots no layer's
            bounded incremental cache still needs (sliding-window / local kernels; all of them
            with the linear kernels), so a step costs O(window), not O(steps so far); 0 for
            every other memory kind.
    """

    layers: list[LayerState]
    pos: Tensor
    valid: Tensor
    seg: Tensor
    episode: Tensor
    next_pos: Tensor
    key_offset: int = 0

    @property
    def batch_size(self) -> int:
        """B: number of independent streams (rows of ``episode``)."""
        return self.episode.shape[0]

    def map_tensors(self, fn) -> BackboneState:
        """Apply ``fn`` to every tensor (detach, to(device), index_select...)."""
        return _map(self, fn)

    def detach(self) -> BackboneState:
        """Copy with every tensor detached from the graph (truncated BPTT between segments)."""
        return self.map_tensors(lambda t: t.detach())


def _map(obj: Any, fn) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, list):
        return [_map(o, fn) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


@dataclass
class BlockOutput:
    """Result of one block: new hidden (B, T, D), cache, aux losses, metrics, weights."""

    hidden: Tensor
    cache: Any = None
    aux: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    weights: Tensor | None = None


@dataclass
class BackboneOutput:
    """Result of :meth:`rl_tformers.backbone.Backbone.forward`.

    Attributes:
        hidden: (B, T, D) final hidden states (after the final norm, if any).
        state: updated :class:`BackboneState` (``None`` when called without state).
        aux: weighted scalar losses to add to the agent's loss (ponder cost, span penalty,
            compression losses...). Sum them with :func:`sum_aux`.
        metrics: values to log: floats or 0-d tensors (ponder steps, exit layer, gates...).
        hidden_states: per-layer outputs, tuple of (B, T, D), when requested.
        attentions: with ``need_weights=True``, the attention probabilities of every layer run
            (in the order the depth kind ran them), each (B, H, T, S) over the S = M + T keys
            (memory or cache first), or ``None`` for a layer whose kernel forms no probabilities
            (linear and block-sparse kernels); every token's row, also with ``output_tokens``.
            ``None`` without ``need_weights``.
    """

    hidden: Tensor
    state: BackboneState | None = None
    aux: dict[str, Tensor] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor | None, ...] | None = None


def sum_aux(aux: dict[str, Tensor]) -> Tensor | float:
    """Sum of the weighted auxiliary losses (0.0 when there are none)."""
    total: Tensor | float = 0.0
    for v in aux.values():
        total = total + v
    return total


def merge_into(dst: dict[str, Any], src: dict[str, Any], prefix: str = "") -> None:
    """Add ``src`` into ``dst`` (summing tensors/floats under the same key)."""
    for k, v in src.items():
        key = prefix + k
        if key in dst and isinstance(v, (Tensor, float, int)) and isinstance(dst[key], (Tensor, float, int)):
            dst[key] = dst[key] + v
        else:
            dst[key] = v
