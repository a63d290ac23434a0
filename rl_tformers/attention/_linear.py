"""Kernelised (linear) attention engine shared by RFA (``rfa``) and Performer (``performer``).

Linear attention replaces ``exp(q . k)`` by a feature inner product ``phi(q) . phi(k)``
(Katharopoulos et al. 2020, eq. 4-6; Peng et al. 2021, eq. 5; Choromanski et al. 2021, eq. 5),
so that::

    out_t = phi(q_t)^T S_t / phi(q_t)^T z_t,   S_t = sum_j phi(k_j) v_j^T,  z_t = sum_j phi(k_j)

costs O(L m Dh) instead of O(L^2 Dh) (m = number of features). Here ``S`` and ``z`` travel
together as one state of width E = Dh + 1 (values augmented with a column of ones), and every
sum is accumulated in **float32** or wider (:func:`acc_dtype`: float32 for bf16/fp16 inputs, also
under bf16 autocast; float64 for a float64 model, whose state and outputs keep float64 precision).

The general recurrence this module evaluates is the gated one of RFA (Peng et al. 2021,
sec. 3.2, eq. 7) with episode resets::

    S_j = a_j S_{j-1} + phi(k_j) [v_j, 1]^T,   a_j = lambda_j * [key j does not start a new episode]

(``lambda_j = 1`` for plain causal attention, ``g_j`` for gated RFA, whose ``(1 - g_j)`` factor is
folded into ``phi(k_j)`` by the caller). A query at key index t reads ``phi(q_t)^T S_t``.

Causal form without a Python loop over tokens (:func:`causal_linear`): the sequence is cut into
chunks of C tokens. Inside a chunk the contribution is a masked C x C product (quadratic in C
only); across chunks, each chunk's summed contribution U_c (m x E) and total decay D_c are
combined by a prefix sum (``cumsum`` when there are neither decays nor resets) or by a
log-depth associative scan (Hillis & Steele 1986) over the n = L / C chunks. Peak memory is
O(L C + (L / C) m E) per head: never L x L.

Masks (see :class:`~rl_tformers.types.AttnContext`): key padding zeroes ``phi(k_j)`` and sets
``a_j = 1`` (a padded key neither adds to nor decays the state); episode ids are honoured as
*runs*: a valid key whose episode id differs from that of the last valid key before it starts a
new run and resets the state (invalid keys never start a run: memories give unfilled slots the id
-1, and the compressive memory keeps such slots after its compressed ones). This is exact when
every episode's valid keys occupy one contiguous run of key indices, which is how the backbone
lays out keys (``[memory; segment]``, ids of valid keys non-decreasing); other layouts raise
``ValueError``. Causality uses key indices (query i sits at key M + i);
``ctx.allowed()`` is never called. A query with no allowed key returns zeros.

Incremental decoding (:class:`LinearCache`): the cache holds the running sums and the episode id
of the last valid key they cover, which is all a later key needs of the earlier ones (the
features of a key depend on its own position only), so a step reads no bookkeeping of cached
keys and memory kind ``none`` drops it (``cache_keeps() == 0``): O(1) per step at any step.

What linear attention cannot do: positional encodings that need the score matrix (ALiBi, Shaw,
Transformer-XL relative, DA-Transformer) are refused at construction; attention dropout and
``need_weights`` are not available (there are no probabilities to drop or return).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.attention.base import AttentionModule
from rl_tformers.backbone_config import ConfigAdviceWarning, IncompatibleConfig
from rl_tformers.position.base import PositionModule
from rl_tformers.types import AttnContext, AttnOutput, state_type

#: positional kinds usable inside linear kernels (no score matrix needed).
LINEAR_POSITIONS = ("none", "sinusoidal", "learned", "rotary")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the features and sums for inputs of ``dtype``: at least float32 (bf16 and fp16
    accumulate in float32), float64 kept (a float64 model is not silently computed in float32)."""
    return torch.promote_types(dtype, torch.float32)


@state_type
@dataclass
class LinearCache:
    """Incremental-decoding cache of a linear-attention layer.

    Everything the kernel needs of the keys it has summarised, so it reads no bookkeeping
    (``ctx.pos_k``, ``key_valid``, ``seg_k``) of cached keys and memory kind ``none`` may drop
    all of it (:meth:`KernelAttention.cache_keeps` is 0): a decoding step is O(1) in the number
    of tokens so far.

    Attributes:
        state: (B, H, m, Dh + 1) float32 (float64 for a float64 model): ``[S | z]``, the running sums of ``phi(k_j) v_j^T`` and
            ``phi(k_j)`` over the current episode's keys (decayed for gated RFA). Its size does
            not grow with the number of decoded tokens.
        last_seg: (B,) long episode id of the last *valid* key summarised (0 before any), which
            decides whether the next valid key starts a new run (:func:`valid_run_starts`).
        seen: (B,) bool, True once a valid key has been summarised (a key with no valid key
            before it starts no run). ``reset_state`` leaves both as they are: it zeroes the
            sums, and the reset row's next episode id differs from ``last_seg`` anyway.
            ``None`` (a cache saved before these fields existed): derived from the context's
            cached keys, which must then all be at hand.
    """

    state: Tensor
    last_seg: Tensor | None = None
    seen: Tensor | None = None


# ------------------------------------------------------------------------------------------------
# Scans
# ------------------------------------------------------------------------------------------------
def segsum(x: Tensor) -> Tensor:
    """Pairwise segment sums inside a chunk: x (..., C) -> (..., C, C) with
    ``out[..., t, j] = sum_{l=j+1}^{t} x_l`` for j <= t (0 on the diagonal) and -inf for j > t.

    Computed by a masked cumulative sum, not as ``cumsum_t - cumsum_j`` (which would lose
    precision and turn ``-inf - -inf`` into NaN at episode resets).
    """
    c = x.shape[-1]
    xr = x.unsqueeze(-1).expand(*x.shape, c)  # (..., C_l, C_j): xr[..., l, j] = x_l
    lower = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(-1)  # l > j
    out = xr.masked_fill(~lower, 0.0).cumsum(dim=-2)  # (..., C_t, C_j) = sum_{j < l <= t} x_l
    # -inf = log(0): a decay weight that must be exactly 0 after exp (not a score fill)
    return out.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=x.device).tril(), float("-inf"))


def decayed_scan(decay: Tensor, value: Tensor) -> Tensor:
    """Inclusive scan of ``s_c = decay_c * s_{c-1} + value_c`` along axis 2 (s_{-1} = 0).

    Log-depth associative scan (Hillis & Steele 1986) over pairs (decay, value) with
    ``(d1, v1) o (d2, v2) = (d1 d2, d2 v1 + v2)``: ceil(log2 n) vectorised steps, no loop over
    the n elements. Shapes: decay (B, H, n), value (B, H, n, m, E) -> (B, H, n, m, E).
    """
    n = decay.shape[2]
    offset = 1
    while offset < n:
        prev_v = F.pad(value[:, :, :-offset], (0, 0, 0, 0, offset, 0))  # (B, H, n, m, E) shifted right
        prev_d = F.pad(decay[:, :, :-offset], (offset, 0), value=1.0)  # (B, H, n)
        value = value + decay[..., None, None] * prev_v
        decay = decay * prev_d
        offset *= 2
    return value


def _decayed_chunks(fq: Tensor, fk: Tensor, v: Tensor, scores: Tensor, log_decay: Tensor | None,
                    reset: Tensor | None, state0: Tensor, strict: bool) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`causal_linear` with decay or resets, on chunked inputs ``fq``, ``fk`` (B, H, n, C, m),
    ``v`` (B, H, n, C, E), ``scores`` = fq fk^T (B, H, n, C, C) and ``log_decay`` (B, H, n C) /
    ``reset`` (B, n C) padded to whole chunks: (intra-chunk part (B, H, n, C, E), inter-chunk part
    (B, H, n, C, E), state after each chunk (B, H, n, m, E))."""
    b, h, n, c, _ = fq.shape
    x = fq.new_zeros(b, h, n * c) if log_decay is None else log_decay.to(fq.dtype)
    if reset is not None:
        x = x.masked_fill(reset[:, None, :], float("-inf"))  # log decay of an episode reset: log(0)
    x = x.reshape(b, h, n, c)  # (B, H, n, C) log a_t
    a_in = x.cumsum(dim=-1)  # (B, H, n, C): log decay from the chunk start through t
    w = segsum(x).exp()  # (B, H, n, C, C): prod_{j<l<=t} a_l, 0 above the diagonal
    if strict:
        w = w * (1.0 - torch.eye(c, device=w.device, dtype=w.dtype))
    intra = (scores * w) @ v  # (B, H, n, C, E)
    tail = F.pad(x.flip(-1).cumsum(-1)[..., :-1], (1, 0)).flip(-1)  # sum_{l>j} x_l in the chunk
    u = (fk * tail.exp()[..., None]).transpose(-1, -2) @ v  # (B, H, n, m, E)
    d = a_in[..., -1].exp()  # (B, H, n): decay across a whole chunk
    s_end = decayed_scan(d, u) + d.cumprod(dim=2)[..., None, None] * state0[:, :, None]
    s_prev = torch.cat([state0[:, :, None], s_end[:, :, :-1]], dim=2)  # (B, H, n, m, E)
    inter = (fq * a_in.exp()[..., None]) @ s_prev  # (B, H, n, C, E)
    return intra, inter, s_end


def causal_linear(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    *,
    log_decay: Tensor | None = None,
    reset: Tensor | None = None,
    state0: Tensor | None = None,
    chunk: int = 64,
    strict: bool = False,
) -> tuple[Tensor, Tensor]:
    """Chunked causal linear attention (numerators and normaliser together), in fq's dtype.

    Evaluates ``S_t = a_t S_{t-1} + fk_t v_t^T`` and ``out_t = fq_t^T S_t`` (``strict``:
    ``fq_t^T a_t S_{t-1}``, i.e. key t itself excluded) for all t without a loop over tokens; see
    the module docstring. ``a_t = exp(log_decay_t)`` and ``a_t = 0`` where ``reset_t``.

    Args:
        fq: (B, H, L, m) query features (zero rows for positions that are not queries).
        fk: (B, H, L, m) key features (already multiplied by key validity / key weights).
        v: (B, H, L, E) values (usually ``[v, 1]``).
        log_decay: (B, H, L) log a_t <= 0, or None (no decay).
        reset: (B, L) bool, True where key t starts a new run (state before t dropped), or None.
        state0: (B, H, m, E) state before position 0 (incremental decoding), or None (zeros).
        chunk: chunk length C.
        strict: exclude each position's own key.
    Returns:
        out (B, H, L, E) and the final state (B, H, m, E), both in fq's dtype.
    """
    b, h, n_tok, m = fq.shape
    e = v.shape[-1]
    c = max(1, min(chunk, n_tok))
    pad = (-n_tok) % c
    if pad:
        fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
        if log_decay is not None:
            log_decay = F.pad(log_decay, (0, pad))
        if reset is not None:
            reset = F.pad(reset, (0, pad), value=False)
    n = (n_tok + pad) // c
    fq = fq.reshape(b, h, n, c, m)  # (B, H, n, C, m)
    fk = fk.reshape(b, h, n, c, m)  # (B, H, n, C, m)
    v = v.reshape(b, h, n, c, e)  # (B, H, n, C, E)
    scores = fq @ fk.transpose(-1, -2)  # (B, H, n, C, C)
    if state0 is None:
        state0 = fq.new_zeros(b, h, m, e)

    if log_decay is None and reset is None:
        keep = torch.ones(c, c, dtype=torch.bool, device=fq.device).tril(-1 if strict else 0)
        intra = scores.masked_fill(~keep, 0.0) @ v  # (B, H, n, C, E)
        u = fk.transpose(-1, -2) @ v  # (B, H, n, m, E): each chunk's own sum
        s_end = u.cumsum(dim=2) + state0[:, :, None]  # (B, H, n, m, E): state after chunk c
        s_prev = torch.cat([state0[:, :, None], s_end[:, :, :-1]], dim=2)  # state before chunk c
        inter = fq @ s_prev  # (B, H, n, C, E)
    else:
        intra, inter, s_end = _decayed_chunks(fq, fk, v, scores, log_decay, reset, state0, strict)
    out = (intra + inter).reshape(b, h, n * c, e)[:, :, :n_tok]  # (B, H, L, E)
    return out, s_end[:, :, -1]


def run_starts(seg: Tensor, prev: Tensor | None = None) -> Tensor:
    """(B, L) bool: True where ``seg[:, t]`` differs from the id before it.

    ``prev`` (B,) is the id of the key just before position 0 (cached keys); without it,
    position 0 never starts a run (there is nothing before it).
    Raises ValueError if ids decrease along the keys (an episode split over two runs).
    """
    if seg.shape[1] > 1 and bool((seg[:, 1:] < seg[:, :-1]).any()):
        raise ValueError(
            "linear attention: episode ids (ctx.seg_k) must be non-decreasing along the keys "
            "(each episode one contiguous run), as the backbone lays them out"
        )
    first = torch.zeros_like(seg[:, :1], dtype=torch.bool) if prev is None else (seg[:, :1] != prev[:, None])
    return torch.cat([first, seg[:, 1:] != seg[:, :-1]], dim=1)


def valid_run_starts(
    seg: Tensor, valid: Tensor | None, p: int = 0, prev: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """(B, S - p) bool: True where key ``p + t`` is valid and its episode id differs from that of
    the last *valid* key before it (cached keys ``[:p]`` included).

    Invalid keys (padding, unfilled or cleared memory slots) neither add to nor decay the state, so
    their episode ids must not start runs either: memories mark unfilled slots with id -1 (the
    compressive memory keeps such slots between its compressed part and its FIFO), which is not
    an episode. A valid key with no valid key before it starts no run (the state before it is
    empty). Equals :func:`run_starts` when every key is valid.

    Args:
        seg: (B, S) episode ids of all keys; valid: (B, S) bool or None (all valid).
        p: keys summarised by the cache (only the run starts of keys ``p:`` are returned).
        prev: instead of cached keys at hand (``p`` must be 0), what they come to
            (:class:`LinearCache`'s ``(last_seg, seen)``, (B,) each): the id of the last valid
            key before ``seg[:, 0]`` and whether there is one. Only that key matters, so the
            result equals the one with every earlier key at hand, in O(S) instead of O(P + S).
    Raises:
        ValueError: if the ids of the valid keys decrease (an episode split over two runs).
    """
    if prev is not None:
        if p:
            raise ValueError("valid_run_starts: give either the cached keys (p) or what they come to (prev)")
        last_seg, seen = prev
        v = torch.ones_like(seg, dtype=torch.bool) if valid is None else valid
        # the last valid cached key stands for all of them (an invalid one when there is none)
        return valid_run_starts(torch.cat([last_seg[:, None], seg], 1), torch.cat([seen[:, None], v], 1), 1)
    if valid is None:
        return run_starts(seg[:, p:], seg[:, p - 1] if p > 0 else None)
    b, s = seg.shape
    idx = torch.arange(s, device=seg.device).expand(b, s)
    last = torch.where(valid, idx, -1).cummax(1).values  # (B, S): last valid key at or before j
    before = F.pad(last[:, :-1], (1, 0), value=-1)  # (B, S): last valid key strictly before j
    has = before >= 0
    prev_seg = seg.gather(1, before.clamp_min(0))  # (B, S)
    if bool((valid & has & (seg < prev_seg)).any()):
        raise ValueError(
            "linear attention: episode ids (ctx.seg_k) of the valid keys must be non-decreasing along "
            "the keys (each episode one contiguous run), as the backbone lays them out"
        )
    return (valid & has & (seg != prev_seg))[:, p:]


def last_valid_seg(
    seg: Tensor | None, valid: Tensor, last_seg: Tensor, seen: Tensor
) -> tuple[Tensor, Tensor]:
    """The (last_seg, seen) pair of :class:`LinearCache` after keys with episode ids ``seg`` and
    validity ``valid`` (B, L) follow the keys summarised by ``(last_seg, seen)`` (B,): the id of
    the last valid key and whether there is one. ``seg`` None (no ids: one episode) keeps
    ``last_seg``."""
    any_valid = valid.any(1)  # (B,)
    if seg is None or seg.shape[1] == 0:
        return last_seg, seen | any_valid
    idx = torch.arange(seg.shape[1], device=seg.device).expand_as(seg)
    last = torch.where(valid, idx, -1).amax(1)  # (B,) index of the last valid key, -1 if none
    new = torch.where(any_valid, seg.gather(1, last.clamp_min(0)[:, None])[:, 0], last_seg)
    return new, seen | any_valid


def safe_divide(num: Tensor, den: Tensor, eps: float) -> Tensor:
    """num / den with |den| clamped to >= eps (sign kept; 0 / 0 -> 0). num (..., E), den (..., 1)."""
    den = torch.where(den >= 0, den.clamp_min(eps), den.clamp_max(-eps))
    return num / den


# ------------------------------------------------------------------------------------------------
# Module base
# ------------------------------------------------------------------------------------------------
class KernelAttention(AttentionModule):
    """Base of the linear-attention kernels: projections, positions, masks, both directions, cache.

    Subclasses implement :meth:`features` (the random feature map) and may override
    :meth:`key_decay` (gated RFA). Forward contract as :class:`AttentionModule`:
    x_q (B, T, D), x_kv (B, S_new, D) with ``ctx`` describing S = P + S_new keys, the first P
    of which are summarised by ``cache`` (incremental decoding, causal only). The cache covers
    every earlier key; their bookkeeping in ``ctx`` (P of them, 0 with memory kind ``none``) is
    never read (:meth:`cache_keeps`).

    Args:
        ctx: build context. position: positional module (must not need scores).
        chunk_size: chunk length C of the causal form.
        eps: smallest |normaliser| (rows with no allowed key give 0 / eps = 0).
    """

    #: the random buffers redrawn by :meth:`redraw`; subclasses set this.
    random_buffers: tuple[str, ...] = ()

    def __init__(self, ctx, position: PositionModule, chunk_size: int, eps: float, redraw_every: int = 0,
                 kind: str | None = None) -> None:
        super().__init__(ctx, position)
        if position.needs_scores:
            raise IncompatibleConfig(
                f"backbone.position.kind={ctx.config.position.kind!r} needs the score matrix, which "
                f"backbone.attention.kind={ctx.config.attention.kind!r} never forms; use one of "
                f"{', '.join(LINEAR_POSITIONS)}"
            )
        if ctx.config.attn_dropout > 0 and ctx.layer_idx <= 0:  # once per backbone, not per layer
            warnings.warn(
                f"attention kind {kind or ctx.config.attention.kind!r} forms no attention probabilities, so "
                f"attn_dropout={ctx.config.attn_dropout} is not applied to it (residual and feed-forward "
                f"dropout still are); set attn_dropout=0 to say so and silence this warning",
                ConfigAdviceWarning, stacklevel=2,
            )
        self.causal = ctx.config.causal
        self.chunk_size = chunk_size
        self.eps = eps
        self.redraw_every = redraw_every

    # -- to implement ---------------------------------------------------------------------------
    def features(self, x: Tensor, is_query: bool, valid: Tensor | None) -> Tensor:  # pragma: no cover
        """x (B, H, L, Dh) -> (B, H, L, m) features in ``acc_dtype(x.dtype)``; ``valid`` (B, L) marks real keys."""
        raise NotImplementedError

    def key_decay(self, x_kv: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """(log a_j (B, H, S_new) or None, key weight (B, H, S_new) or None). Default: neither."""
        return None, None

    def redraw(self, generator: torch.Generator | None = None) -> None:  # pragma: no cover
        """Draw new random features (explicit call only; never inside forward)."""
        raise NotImplementedError

    # -- cache -------------------------------------------------------------------------------------
    def init_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> LinearCache:
        """Zero running sums (B, H, m, Dh + 1) in ``acc_dtype(dtype)`` (float32 for bf16); causal only."""
        if not self.causal:
            raise NotImplementedError(f"{type(self).__name__}: incremental decoding needs backbone.causal=true")
        return LinearCache(
            torch.zeros(batch, self.n_heads, self.n_features, self.head_dim + 1, device=device,
                        dtype=acc_dtype(dtype)),
            last_seg=torch.zeros(batch, dtype=torch.long, device=device),
            seen=torch.zeros(batch, dtype=torch.bool, device=device),
        )

    def cache_keeps(self) -> int | None:
        """0 (causal): the cache carries what the kernel needs of the keys it summarises (the
        running sums, and the episode id of the last valid key for run starts), and a key's
        features depend on nothing but its own input and position (rotary rotates each key by
        its own position, sinusoidal / learned positions are added to the inputs, RFA's gate
        reads the key's input); so a step reads the bookkeeping of its new keys only, and
        memory kind ``none`` keeps none of the old slots. Exact in every
        configuration with a cache (memory prefix keys among the new ones included). None when
        bidirectional (no incremental form)."""
        return 0 if self.causal else None

    @property
    def n_features(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- forward -----------------------------------------------------------------------------------
    @staticmethod
    def _cached_run(cache: LinearCache, ctx: AttnContext, p: int, b: int) -> tuple[Tensor, Tensor]:
        """(last_seg, seen) (B,) of the keys ``cache`` summarises: stored with it, or derived from
        the ``p`` cached keys at hand in ``ctx`` for a cache saved without them.

        Raises:
            ValueError: a cache without them and a context that does not hold every cached key.
        """
        if cache.last_seg is not None:
            return cache.last_seg, cache.seen
        if ctx.key_offset:
            raise ValueError("linear attention: a cache without last_seg/seen needs every cached key's bookkeeping")
        old = ctx.pos_k[:, :p]  # (B, P)
        kv0 = torch.ones_like(old, dtype=torch.bool) if ctx.key_valid is None else ctx.key_valid[:, :p]
        seg0 = None if ctx.seg_k is None else ctx.seg_k[:, :p]
        zero = torch.zeros(b, dtype=torch.long, device=old.device)
        return last_valid_seg(seg0, kv0, zero, zero.bool())

    def _bidirectional(self, fq: Tensor, fk: Tensor, v_aug: Tensor, reset: Tensor | None, valid: Tensor | None,
                       seg_k: Tensor | None, p: int, m_new: int) -> Tensor:
        """Non-causal numerators and normaliser (B, H, T, E) of queries ``fq`` (B, H, T, m) over
        keys ``fk`` (B, H, S_new, m), ``v_aug`` (B, H, S_new, E): every key, or with ``reset``
        (B, S_new) every key of the query's run (a causal pass plus a reversed strict one)."""
        if reset is None:
            kv = fk.transpose(-1, -2) @ v_aug  # (B, H, m, E)
            return fq @ kv  # (B, H, T, E)
        fq_full = F.pad(fq, (0, 0, m_new, 0))  # (B, H, S, m)
        fwd, _ = causal_linear(fq_full, fk, v_aug, reset=reset, chunk=self.chunk_size)
        rev_valid = None if valid is None else valid.flip(1)
        rev_reset = valid_run_starts(seg_k[:, p:].flip(1).neg(), rev_valid)  # runs seen right to left
        bwd, _ = causal_linear(
            fq_full.flip(2), fk.flip(2), v_aug.flip(2), reset=rev_reset, chunk=self.chunk_size, strict=True
        )
        return (fwd + bwd.flip(2))[:, :, m_new:]  # (B, H, T, E)

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache: LinearCache | None = None) -> AttnOutput:
        q, k, v = self.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S_new, Dh) x2
        b, _, t, _ = q.shape
        s_new = k.shape[2]
        p = ctx.k_len - s_new  # cached keys whose bookkeeping is at hand (read only for a cache without last_seg)
        if p < 0 or (p > 0 and cache is None):
            raise ValueError(f"attention: {s_new} keys given but the context describes {ctx.k_len} and there is no cache")
        if cache is not None and not ctx.causal:
            raise ValueError("linear attention: a cache (incremental decoding) needs a causal context")
        prev = None if cache is None else self._cached_run(cache, ctx, p, b)  # (last_seg, seen) (B,)
        m_new = s_new - t  # prefix keys among the given ones (memory)
        pos = self.position
        q = pos.rotate(pos.content_query(q), ctx.pos_q)
        k = pos.rotate(k, ctx.pos_k[:, p:])
        with torch.autocast(q.device.type, enabled=False):  # float32+ features and sums (bf16 autocast too)
            valid = None if ctx.key_valid is None else ctx.key_valid[:, p:]  # (B, S_new)
            fq = self.features(q, True, None)  # (B, H, T, m) acc_dtype
            fk = self.features(k, False, valid)  # (B, H, S_new, m) acc_dtype
            if valid is not None:
                fk = fk * valid[:, None, :, None].to(fk.dtype)
            log_decay, weight = self.key_decay(x_kv)
            if log_decay is not None and valid is not None:
                # a padded key is absent: it neither adds to nor decays the state (a_j = 1), so
                # its content (which sets its gate) never changes a valid output
                log_decay = log_decay.masked_fill(~valid[:, None, :], 0.0)
            if weight is not None:
                fk = fk * weight[..., None]
            ones = torch.ones(*v.shape[:-1], 1, device=v.device, dtype=fq.dtype)
            v_aug = torch.cat([v.to(fq.dtype), ones], dim=-1)  # (B, H, S_new, Dh + 1)
            reset = None
            if ctx.seg_k is not None:
                if prev is None:
                    reset = valid_run_starts(ctx.seg_k, ctx.key_valid)  # (B, S_new): no cached key (p = 0)
                else:
                    reset = valid_run_starts(ctx.seg_k[:, p:], valid, prev=prev)  # (B, S_new)
                if not bool(reset.any()):
                    reset = None
            new_cache = None
            if ctx.causal:
                fq_full = F.pad(fq, (0, 0, m_new, 0))  # (B, H, S_new, m): no queries at the prefix
                state0 = None if cache is None else cache.state.to(fq.dtype)
                out, final = causal_linear(
                    fq_full, fk, v_aug, log_decay=log_decay, reset=reset, state0=state0, chunk=self.chunk_size
                )
                out = out[:, :, m_new:]  # (B, H, T, E)
                if cache is not None:
                    v_new = torch.ones_like(ctx.pos_k[:, p:], dtype=torch.bool) if valid is None else valid
                    seg_new = None if ctx.seg_k is None else ctx.seg_k[:, p:]  # (B, S_new)
                    last_seg, seen = last_valid_seg(seg_new, v_new, *prev)
                    new_cache = LinearCache(final, last_seg, seen)
            else:
                if log_decay is not None:
                    raise ValueError(f"{type(self).__name__}: the gated form is causal only")
                out = self._bidirectional(fq, fk, v_aug, reset, valid, ctx.seg_k, p, m_new)
            y = safe_divide(out[..., :-1], out[..., -1:], self.eps).to(q.dtype)  # (B, H, T, Dh)
        return AttnOutput(self.o_proj(self.merge_heads(y)), cache=new_cache)


def orthogonal_gaussian(rows: int, dim: int, generator: torch.Generator | None = None, device=None) -> Tensor:
    """(rows, dim) random matrix with orthogonal rows in blocks of ``dim`` and Gaussian row norms.

    Choromanski et al. 2021, sec. 2.4 (orthogonal random features): stack Q factors of QR
    decompositions of Gaussian (dim x dim) matrices and rescale each row by the norm of an
    independent N(0, I_dim) vector, so every row is marginally N(0, I_dim) while rows inside a
    block are exactly orthogonal (lower estimator variance, their Theorem 2).

    The Q factor is made Haar-distributed by flipping each column by the sign of R's diagonal
    (Mezzadri 2007, "How to generate random matrices from the classical compact groups",
    sec. 5): LAPACK's Householder QR returns R with a diagonal of fixed sign pattern, so the raw
    Q is not uniform (e.g. the first column always has a non-positive first entry), its rows are
    not isotropic, and E[exp(w . x)] != exp(|x|^2 / 2): a biased FAVOR+ estimate.
    """
    blocks = []
    for _ in range(-(-rows // dim)):  # ceil(rows / dim) blocks: loop over blocks, not tokens
        g = torch.randn(dim, dim, generator=generator, device=device)
        qmat, rmat = torch.linalg.qr(g)
        sign = torch.where(torch.diagonal(rmat) < 0, -1.0, 1.0).to(qmat.dtype)  # (dim,)
        qmat = qmat * sign[None, :]  # Haar: column k times sign(R_kk)
        blocks.append(qmat.T)  # rows orthonormal
    mat = torch.cat(blocks, 0)[:rows]  # (rows, dim)
    norms = torch.randn(rows, dim, generator=generator, device=device).norm(dim=1, keepdim=True)
    return mat * norms


def random_feature_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` with random features/rotations (a ``redraw`` method and
    ``random_buffers``: ``performer``, ``rfa``, ``lsh``), in ``model.modules()`` order."""
    return [mod for mod in model.modules() if callable(getattr(mod, "redraw", None)) and getattr(mod, "random_buffers", ())]


_random_feature_modules = random_feature_modules  # the old private name


def redraw_random_features(model: nn.Module, generator: torch.Generator | None = None) -> int:
    """Redraw the random features/rotations of every kernel in ``model`` that has some.

    The redraw policy of this library: random features are **buffers** (saved in checkpoints)
    and change only through this explicit call (or :func:`maybe_redraw_random_features` on the
    trainer's schedule), never inside ``forward``; so a rollout and the update that uses its data
    see the same function. Returns the number of modules redrawn.
    """
    n = 0
    for mod in random_feature_modules(model):
        mod.redraw(generator)
        n += 1
    return n


def maybe_redraw_random_features(
    model: nn.Module, update_step: int, generator: torch.Generator | None = None, *, since: int | None = None
) -> int:
    """Redraw the kernels whose schedule is due; call between updates, never inside one.

    The schedule of Choromanski et al. 2021 (feature redrawing, sec. 4.2) driven by the trainer
    (:class:`rl_tformers.runtime.trainer.Trainer` calls it before each update's batch). A module
    with ``redraw_every = n > 0`` is due when a multiple of n lies in ``(since, update_step]``
    (``since`` defaults to ``update_step - 1``: ``update_step % n == 0``, ``update_step > 0``).
    A caller that may only redraw at coarser boundaries (an on-policy agent, between rollouts
    of U updates) passes ``since = update_step - U`` at those boundaries, so no scheduled redraw
    is lost. Modules draw one after another from ``generator`` (None: the global RNG).
    Returns the number of modules redrawn.
    """
    since = update_step - 1 if since is None else since
    n = 0
    for mod in random_feature_modules(model):
        every = getattr(mod, "redraw_every", 0)
        if every and update_step > 0 and update_step // every > max(since, 0) // every:
            mod.redraw(generator)
            n += 1
    return n
