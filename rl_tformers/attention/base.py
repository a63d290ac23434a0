"""Interface of attention kernels, the reference kernel and shared helpers.

An attention kind is a registered config whose ``build(ctx, position)`` returns an
:class:`AttentionModule`: the projections, the kernel, and whatever parameters the variant
needs (Linformer's E/F, Performer's features...). The forward signature is the same for all::

    forward(x_q (B, T, D), x_kv (B, S, D), ctx: AttnContext, cache=None) -> AttnOutput

``x_kv`` is ``x_q`` for plain self-attention, ``[memory; x_q]`` with Transformer-XL memory
(queries are the last T keys), and the encoder output for cross-attention. With an
incremental-decoding ``cache`` the keys are ``[cached; new]`` and ``ctx`` describes all of
them (the backbone builds it from the state's bookkeeping).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.backbone_config import SlotConfig
from rl_tformers.dropout import dropout
from rl_tformers.position.base import PositionModule
from rl_tformers.types import AttnContext, AttnOutput, neg_inf, state_type, to_acc

_BUFFER_UPDATES: ContextVar[bool] = ContextVar("rl_tformers_buffer_updates", default=True)


def buffer_updates_enabled() -> bool:
    """Whether a training-mode forward may update a module's buffers (the routing centroids'
    EMA step); False inside :func:`deferred_buffer_updates`."""
    return _BUFFER_UPDATES.get()


@contextmanager
def deferred_buffer_updates() -> Iterator[None]:
    """Forwards inside this context update no buffers: the first forward of a checkpointed block
    (``backbone.checkpoint``), whose recomputation in backward then updates them once, with the
    values the forward used (as a reversible block's recomputation does)."""
    token = _BUFFER_UPDATES.set(False)
    try:
        yield
    finally:
        _BUFFER_UPDATES.reset(token)


@dataclass(frozen=True)
class AttentionConfig(SlotConfig):
    """Base class of attention configs (``build(ctx, position) -> AttentionModule``)."""

    def build(self, ctx, position: PositionModule) -> AttentionModule:  # pragma: no cover - abstract
        raise NotImplementedError


@state_type
@dataclass
class KVCache:
    """Dense incremental-decoding cache: keys and values of every past token of a layer.

    Attributes:
        k: (B, H, P, Dh) keys after positional rotation.
        v: (B, H, P, Dh) values.
    """

    k: Tensor
    v: Tensor


class AttentionModule(nn.Module):
    """Multi-head attention base: Q/K/V/O projections and head reshaping.

    Subclasses implement :meth:`attend` (the kernel on projected heads) and may override
    :meth:`forward` when their structure differs (shared-QK LSH, recurrent linear attention).

    Cannot: take an empty query segment (T = 0) in every kernel (the block-sparse, LSH,
    Sinkhorn and linear kernels fail on it); :class:`~rl_tformers.backbone.Backbone` and
    :class:`~rl_tformers.encoder_decoder.EncoderDecoder` never call a kernel with T = 0 (they
    return the empty output and the unchanged state themselves).

    Args:
        ctx: build context (model width D, heads H, dropout, layer index).
        position: this layer's positional-encoding module.
        shared_qk: use one projection for queries and keys (Reformer).
    """

    #: True for kernels that take the whole mask from ``ctx.allowed()`` and so accept queries
    #: at any key positions (``AttnContext.select_queries``): the backbone then computes only
    #: the requested outputs in its last layer (``Backbone.forward(output_tokens=...)``).
    query_subset = False

    def __init__(self, ctx, position: PositionModule, shared_qk: bool = False) -> None:
        super().__init__()
        cfg = ctx.config
        self.d_model, self.n_heads, self.head_dim = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.layer_idx = ctx.layer_idx
        self.position = position
        self.shared_qk = shared_qk
        self.q_proj = nn.Linear(self.d_model, self.d_model)
        self.k_proj = None if shared_qk else nn.Linear(self.d_model, self.d_model)
        self.v_proj = nn.Linear(self.d_model, self.d_model)
        self.o_proj = nn.Linear(self.d_model, self.d_model)
        self.attn_dropout = cfg.attn_dropout
        self.scale = 1.0 / math.sqrt(self.head_dim)

    # -- reshaping ---------------------------------------------------------------------------
    def split_heads(self, x: Tensor) -> Tensor:
        """(B, L, D) -> (B, H, L, Dh)."""
        b, n, _ = x.shape
        return x.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)

    def merge_heads(self, x: Tensor) -> Tensor:
        """(B, H, L, Dh) -> (B, L, D)."""
        b, _, n, _ = x.shape
        return x.transpose(1, 2).reshape(b, n, self.d_model)

    def project(self, x_q: Tensor, x_kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project to heads: q (B, H, T, Dh), k (B, H, S, Dh), v (B, H, S, Dh)."""
        q = self.split_heads(self.q_proj(x_q))
        k_lin = self.q_proj if self.k_proj is None else self.k_proj
        k = self.split_heads(k_lin(x_kv))
        v = self.split_heads(self.v_proj(x_kv))
        return q, k, v

    # -- ground truth for the contract suite ---------------------------------------------------
    def pattern(self, ctx: AttnContext) -> Tensor | None:
        """Dense bool (B|1, H|1, T, S) of the (query, key) pairs this kernel's sparsity pattern
        admits (True = may attend), or ``None`` when every key is admitted (dense kernels).

        Only for tests at small lengths: the contract suite checks every ``exact`` kind
        against :meth:`reference_forward`, i.e. dense attention restricted to
        ``ctx.allowed() & pattern(ctx)``. Sparse kernels (local, strided, blockwise...)
        override it; content-based patterns (LSH, routing) may depend on the inputs only
        through what the module stores from its last forward, so they usually declare
        ``exact=False`` instead.
        """
        return None

    def reference_forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext) -> AttnOutput:
        """Dense masked softmax attention with this module's projections, positional hooks and
        :meth:`pattern`: the ground truth an ``exact`` kind must match (and an ``approximate``
        kind converge to). No cache, no dropout.

        Shapes: x_q (B, T, D), x_kv (B, S, D) -> AttnOutput(out (B, T, D), weights (B, H, T, S)).
        Kernels whose score differs from q.k/sqrt(Dh) by design (e.g. shared-QK LSH with
        normalised keys) override this to state what they are exact to.
        """
        q, k, v = self.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S, Dh), (B, H, S, Dh)
        pos = self.position
        bias = pos.score_bias(q, ctx.pos_q, ctx.pos_k) if pos.additive_bias else None
        q_c = pos.rotate(pos.content_query(q), ctx.pos_q)
        k = pos.rotate(k, ctx.pos_k)
        allowed = ctx.allowed()  # (B|1, 1, T, S)
        pat = self.pattern(ctx)
        if pat is not None:
            allowed = allowed & pat
        out, probs = attention_reference(
            q_c, k, v, allowed, scale=self.scale, bias=bias,
            transform=(lambda s: pos.transform_scores(s, ctx.pos_q, ctx.pos_k)) if pos.transforms_scores else None,
            value_term=(lambda p: pos.value_term(p, ctx.pos_q, ctx.pos_k)) if pos.value_bias else None,
        )
        return AttnOutput(self.o_proj(self.merge_heads(out)), weights=probs)

    # -- incremental decoding --------------------------------------------------------------------
    def init_cache(self, batch: int, device: torch.device, dtype: torch.dtype):
        """Empty cache for step-by-step decoding; raises if the kernel has no incremental form."""
        raise NotImplementedError(f"attention kind {type(self).__name__} has no incremental (cached) form")

    def cache_keeps(self) -> int | None:
        """How many trailing keys of the state's key bookkeeping (``BackboneState.pos``,
        ``valid``, ``seg``: one slot per cached key) this kernel's incremental cache still reads.

        ``None`` (the default): all of them; the bookkeeping grows by T slots per call (dense
        key/value caches, patterns that reach back to the start). An int w: the cache holds at
        most the last w keys, or summarises the earlier ones itself (the linear kernels' running
        sums: w = 0), and the kernel reads the bookkeeping of no earlier key, so memory kind
        ``none`` may drop the older slots; the kernel must then count absolute key indices from
        ``ctx.key_offset`` (the number of dropped keys), as the block-sparse engine does.
        """
        return None

    @property
    def dropout_p(self) -> float:
        return self.attn_dropout if self.training else 0.0


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    *,
    scale: float,
    bias: Tensor | None = None,
    transform=None,
    value_term=None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Plain masked softmax attention, the ground truth of the test suite.

    softmax(q k^T * scale + bias, masked) v  (Vaswani et al. 2017, eq. 1).

    Args:
        q: (B, H, ..., T, Dh); k, v: (B, H, ..., S, Dh).
        allowed: bool mask broadcastable to (B, H, ..., T, S), True = may attend; None = all.
        scale: score scale (1/sqrt(Dh) usually).
        bias: additive score term broadcastable to the scores, or None.
        transform: ``scores -> scores`` applied after the bias and before masking (DA).
        value_term: ``probs -> (B, H, ..., T, Dh)`` added to the output (Shaw values).
        dropout_p: dropout on probabilities.
    Returns:
        out (B, H, ..., T, Dh) and probabilities (B, H, ..., T, S). A query row with no allowed
        key returns zeros (and zero probabilities), never NaN.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    if transform is not None:
        scores = transform(scores)
    scores = to_acc(scores)  # float32, or float64 for a float64 model
    if allowed is not None:
        scores = scores.masked_fill(~allowed, neg_inf(scores.dtype))
    probs = torch.softmax(scores, dim=-1)
    if allowed is not None:
        probs = probs * allowed.any(dim=-1, keepdim=True)  # rows with no key -> 0
    probs = probs.to(q.dtype)
    p = dropout(probs, dropout_p) if dropout_p > 0 else probs
    out = torch.matmul(p, v)
    if value_term is not None:
        extra = value_term(p)
        if extra is not None:
            out = out + extra
    return out, probs


def attention_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    *,
    scale: float,
    bias: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    additive: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Masked attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Same semantics as :func:`attention_reference` (True = may attend; a row with no allowed
    key returns zeros) but fused. Shapes: q (B, H, T, Dh), k/v (B, H, S, Dh), allowed
    broadcastable to (B, H, T, S). ``is_causal`` may only be set when T == S and there is no
    other mask or bias (top-left aligned causal mask). ``additive``: ``allowed`` already as
    ``AttnContext.additive_mask(q.dtype)`` (computed once per forward instead of per layer;
    ``allowed`` is then ignored, and ``bias`` is added to it: adding 0 or ``finfo.min`` to a
    bias of ordinary magnitude gives exactly the masked bias, in one pass).

    On the CPU with ``dropout_p > 0`` (fp32, bf16, fp16): PyTorch has no fused CPU kernel with
    dropout, and its math fallback scales q and k separately and converts the mask on every
    call; the same computation runs here as one ``baddbmm`` (scale and additive mask in the
    GEMM), softmax, the backbone library's dropout (:mod:`rl_tformers.dropout`) and ``bmm``,
    in float32 (:func:`_attention_dropout_cpu`).
    """
    if is_causal:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale)
    if additive is not None:
        mask, row_ok = additive
        if bias is not None:
            mask = bias.to(q.dtype) + mask  # (B|1, H|1, T, S)
        out = _attention_dropout_cpu(q, k, v, mask, scale, dropout_p) if _explicit_path(q, dropout_p) else (
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale))
        return out * row_ok
    row_ok = None
    mask = None
    if allowed is not None:
        row_ok = allowed.any(dim=-1, keepdim=True)  # (B|1, 1|H, T, 1)
        allowed = allowed | ~row_ok  # let empty rows attend everything, zero them below
        mask = allowed
    if bias is not None:
        fill = neg_inf(q.dtype)
        mask = bias.to(q.dtype) if mask is None else bias.to(q.dtype).masked_fill(~mask, fill)
    if _explicit_path(q, dropout_p):
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, neg_inf(q.dtype))
        out = _attention_dropout_cpu(q, k, v, mask, scale, dropout_p)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    if row_ok is not None:
        out = out * row_ok.to(out.dtype)
    return out


def _explicit_path(q: Tensor, dropout_p: float) -> bool:
    """CPU attention with dropout in fp32, bf16 or fp16: PyTorch's SDPA would take its unfused
    math path (float64 keeps SDPA's)."""
    return dropout_p > 0 and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _attention_dropout_cpu(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                           dropout_p: float) -> Tensor:
    """softmax(scale q k^T + mask) with dropout (:func:`rl_tformers.dropout.dropout`), times v:
    SDPA's math path in fewer passes.

    Shapes: q (B, H, T, Dh), k/v (B, H, S, Dh), mask additive, broadcastable to (B, H, T, S)
    -> (B, H, T, Dh), in q's dtype. bf16 and fp16 inputs are computed in float32, autocast off
    (closer to a float32 reference than SDPA's math path in bf16, and faster on the CPU at the
    DT's 60 x 60 scores), and the output cast back.
    """
    if q.dtype != torch.float32:
        with torch.autocast("cpu", enabled=False):
            out = _attention_dropout_cpu(q.float(), k.float(), v.float(), None if mask is None else mask.float(),
                                         scale, dropout_p)
        return out.to(q.dtype)
    b, h, t, dh = q.shape
    s = k.shape[2]
    qf = q.reshape(b * h, t, dh)  # (BH, T, Dh)
    kt = k.reshape(b * h, s, dh).transpose(1, 2)  # (BH, Dh, S)
    if mask is None:
        scores = torch.bmm(qf, kt) * scale  # (BH, T, S)
    else:
        scores = torch.baddbmm(mask.expand(b, h, t, s).reshape(b * h, t, s), qf, kt, alpha=scale)  # (BH, T, S)
    p = dropout(torch.softmax(scores, dim=-1), dropout_p)
    return torch.bmm(p, v.reshape(b * h, s, dh)).view(b, h, t, dh)  # (B, H, T, Dh)


def attention_entropy(probs: Tensor) -> Tensor:
    """Mean entropy (nats) of attention rows: probs (B, H, T, S) -> 0-d tensor (empty rows skipped)."""
    p = probs.float()
    ent = -(p * torch.log(p.clamp_min(1e-12))).sum(-1)  # (B, H, T)
    live = p.sum(-1) > 0
    return (ent * live).sum() / live.sum().clamp_min(1)
