"""Gathered group attention for content-based sparse kernels (``lsh``, ``routing``).

Content-based kernels choose, per batch row and head, which keys each query sees (hash
buckets, clusters). After that choice, every kernel here reduces to the same computation:
queries gathered into G groups of ``n`` slots, each group with its own ``K`` gathered keys::

    q_g (B, H, ..., G, n, Dh),  k_g, v_g (B, H, ..., G, K, Dh),  allowed (B, H, ..., G, n, K)
    out_g = softmax(q_g k_g^T * scale | allowed) v_g,   lse_g = logsumexp of the allowed scores

costing O(G n K Dh) instead of O(T S Dh). The log-sum-exp lets a query that sits in several
groups (several hash rounds, several clusters) combine its partial results exactly into one
softmax over the union of its key sets (:func:`merge_lse`, :func:`scatter_merge`).

Scores and softmax are float32 (also under bf16 autocast); a slot with no allowed key gets a
zero output and ``lse = -inf``, never NaN. Indices are key indices in ``[0, S)`` (query i
sits at key index M + i); ``ctx.allowed()`` is never called.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.dropout import dropout
from rl_tformers.position.base import PositionModule
from rl_tformers.types import to_acc

#: positional kinds usable with per-head gathered keys (no score hooks on gathered blocks).
GATHERED_POSITIONS = ("none", "sinusoidal", "learned", "rotary")


def require_scoreless_position(ctx, position: PositionModule, why: str) -> None:
    """Raise :class:`IncompatibleConfig` if ``position`` needs scores/probabilities (``why`` says why not)."""
    if position.needs_scores:
        raise IncompatibleConfig(
            f"backbone.position.kind={ctx.config.position.kind!r} cannot be used with "
            f"backbone.attention.kind={ctx.config.attention.kind!r} ({why}); use one of "
            f"{', '.join(GATHERED_POSITIONS)}"
        )


def gather_rows(x: Tensor, idx: Tensor) -> Tensor:
    """Gather along the token axis per (batch, head).

    Args:
        x: (B, H | 1, L, F) or (B, H | 1, L) (ids, flags).
        idx: (B, H, *G) long indices into [0, L).
    Returns:
        (B, H, *G, F) or (B, H, *G).
    """
    b, h = idx.shape[:2]
    flat = idx.flatten(2)  # (B, H, N) (flatten, not reshape(b, h, -1): B = 0 has no -1 to infer)
    if x.dim() == 3:
        return x.expand(b, h, -1).gather(2, flat).view(idx.shape)
    f = x.shape[-1]
    out = x.expand(b, h, -1, f).gather(2, flat[..., None].expand(-1, -1, -1, f))  # (B, H, N, F)
    return out.view(*idx.shape, f)


def group_attention(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, *, scale: float, bias: Tensor | None = None, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Masked softmax attention inside each group.

    Args:
        q: (..., n, Dh); k, v: (..., K, Dh); allowed: (..., n, K) bool (True = may attend).
        bias: optional (..., n, K) float added to the scaled scores (e.g. -log duplicate counts).
    Returns:
        out (..., n, Dh) and lse (..., n) in float32 (float64 for float64 inputs; -inf for rows
        with no allowed key).
    """
    with torch.autocast(q.device.type, enabled=False):  # float32 scores even under bf16 autocast
        scores = (to_acc(q) @ to_acc(k).transpose(-1, -2)) * scale  # (..., n, K)
        if bias is not None:
            scores = scores + to_acc(bias)
        # finite fill (project policy): exp(fill - lse) underflows to exactly 0, and no -inf - -inf
        # reaches the forward or the backward of logsumexp on a row with no allowed key
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        live = allowed.any(dim=-1)  # (..., n) rows with at least one allowed key
        # -inf here is not a fill but the log-sum-exp of an empty key set: merge_lse /
        # scatter_merge give such a partial result weight exactly 0 (they test isfinite)
        lse = torch.where(live, torch.logsumexp(scores, dim=-1), float("-inf"))  # (..., n)
        probs = torch.exp(scores - torch.where(live, lse, 0.0)[..., None])  # exp(min - .) = 0 where masked
        if dropout_p > 0:
            probs = dropout(probs, dropout_p)
        return probs @ to_acc(v).to(probs.dtype), lse


def float32(fn):
    """Run ``fn`` with autocast disabled (its inputs are cast to float32 by the caller)."""

    def wrapped(*args, **kwargs):
        dev = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
        with torch.autocast(dev, enabled=False):
            return fn(*args, **kwargs)

    wrapped.__doc__, wrapped.__name__ = fn.__doc__, fn.__name__
    return wrapped


@float32
def merge_lse(out: Tensor, lse: Tensor, dim: int) -> Tensor:
    """Combine partial softmax results along ``dim`` into one softmax over the union of keys.

    out (..., R, ..., Dh) and lse (..., R, ...) with R at ``dim`` (counted on ``lse``):
    ``sum_r exp(lse_r - logsumexp_r lse) out_r``; all -inf -> 0.
    """
    # lse = -inf marks an empty partial result (log 0), the identity of the log-sum-exp merge
    total = torch.logsumexp(lse, dim=dim, keepdim=True)
    w = torch.exp(lse - torch.where(torch.isfinite(total), total, torch.zeros_like(total)))  # (..., R, ...)
    w = torch.where(torch.isfinite(lse), w, torch.zeros_like(w))
    return (w.unsqueeze(-1) * out).sum(dim=dim)


@float32
def scatter_merge(out: Tensor, lse: Tensor, idx: Tensor, live: Tensor, length: int) -> Tensor:
    """Scatter group results back to tokens, merging a token's several groups by their lse.

    Args:
        out: (B, H, G, n, Dh) group outputs (float32, float64 for a float64 model); lse: (B, H, G, n)
            in the same dtype.
        idx: (B, H, G, n) token index of each slot; live: (B, H, G, n) bool (False = empty slot).
        length: number of tokens L.
    Returns:
        (B, H, L, Dh) in the dtype of ``out`` (float32, or float64 for a float64 model); tokens
        in no live group with an allowed key get zeros.
    """
    b, h = out.shape[:2]
    dh = out.shape[-1]
    # -inf: the log-sum-exp of an empty slot (not a score fill); the scatter below starts from
    # -inf, the identity of amax, so a token in no live slot keeps lse -inf and weight 0
    lse = torch.where(live, lse, torch.full_like(lse, float("-inf")))
    flat_idx = idx.flatten(2)  # (B, H, N) (works for B = 0, unlike reshape(b, h, -1))
    flat_lse = lse.flatten(2)
    acc = out.dtype
    top = torch.full((b, h, length), float("-inf"), device=out.device, dtype=acc).scatter_reduce(
        2, flat_idx, flat_lse, reduce="amax", include_self=True
    )  # (B, H, L) max lse per token
    ref = top.gather(2, flat_idx)  # (B, H, N)
    w = torch.where(torch.isfinite(flat_lse), torch.exp(flat_lse - torch.where(torch.isfinite(ref), ref, 0.0)), 0.0)
    num = torch.zeros(b, h, length, dh, device=out.device, dtype=acc).scatter_add(
        2, flat_idx[..., None].expand(-1, -1, -1, dh), w[..., None] * out.flatten(2, -2)
    )  # (B, H, L, Dh)
    den = torch.zeros(b, h, length, device=out.device, dtype=acc).scatter_add(2, flat_idx, w)  # (B, H, L)
    return num / den.clamp_min(torch.finfo(acc).tiny)[..., None]
