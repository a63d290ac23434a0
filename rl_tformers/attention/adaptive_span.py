"""Adaptive attention span (``adaptive_span``; Sukhbaatar et al. 2019).

Sukhbaatar, Grave, Bojanowski & Joulin 2019, "Adaptive Attention Span in Transformers",
sec. 3; survey "The Transformer Family v2.0", "Adaptive Attention Span". Each head attends at
most S (``max_span``) keys back, softly masked by a learned span z in [0, S]:

    m_z(x) = clip((R + z - x) / R, 0, 1)                 (x = query-key distance, R = ramp)
    a_ij   = m_z(i - j) exp(s_ij) / sum_r m_z(i - r) exp(s_ir)

- static: one z per head (z = S * p_h, p_h a parameter clamped to [0, 1]); the loss gets the
  L1 penalty ``loss_coef * sum_h z_h`` (in ``aux``, already weighted);
- dynamic (sec. 3, "dynamic attention span"): z_t = S sigmoid(v . x_t + b) per head and
  query token, penalised by ``loss_coef * sum_h mean_t z_t``.

Only keys with m_z > 0 (distance < z + R) are computed: the kernel is a band of width
min(S, ceil(max z) + R) gathered in blocks, so the cost falls as spans shrink (the paper's
FLOP saving). The soft mask enters the gathered scores as the additive term log m_z (equal to
multiplying exp(s) by m_z and renormalising).

The paper is autoregressive (x = i - j >= 0). The bidirectional form used without a causal
mask applies the same mask to |i - j|. Distances are in absolute key indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rl_tformers.attention._blocksparse import (
    BlockSparseAttention,
    HeadGroup,
    Heads,
    attend_groups,
    band_piece,
    take,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule, KVCache, attention_reference
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext, AttnOutput, to_acc


def soft_mask(dist: Tensor, z: Tensor, ramp: float) -> Tensor:
    """m_z(x) = clip((R + z - x) / R, 0, 1) (Sukhbaatar et al. 2019, sec. 3.1).

    dist and z broadcast against each other (z per head or per head and query); in z's dtype
    (float32, float64 for a float64 model: :meth:`AdaptiveSpanAttention.spans`).
    """
    return ((ramp + z - dist) / ramp).clamp(0.0, 1.0)


def clamp_st(x: Tensor, lo: float, hi: float) -> Tensor:
    """Clamp the value to [lo, hi] but pass the gradient through unchanged.

    The paper clamps the span parameter in place after each optimiser step; clamping in the
    forward pass with a straight-through gradient gives the same values without touching the
    optimiser, and a span pushed below 0 by the L1 penalty can still be pulled back by the task.
    """
    return x + (x.clamp(lo, hi) - x).detach()


class AdaptiveSpanAttention(BlockSparseAttention):
    """Multi-head attention with a learned soft span per head (static) or per token (dynamic).

    Shapes: z is (H,) static or (B, H, T) dynamic; one band piece of width
    w = min(S, ceil(max z) + R) distances: scores, soft mask (B, H, N, bq, bq + w - 1),
    O(T w) time and memory.

    Cannot: dense weights. Incremental decoding keeps the last ``max_span - 1`` keys.
    """

    incremental = True

    def __init__(self, ctx, position, max_span: int, ramp: int, init: float, dynamic: bool, loss_coef: float, block: int) -> None:
        super().__init__(ctx, position)
        self.max_span, self.ramp, self.dynamic, self.loss_coef, self.block = max_span, ramp, dynamic, loss_coef, block
        if dynamic:
            self.span_proj = nn.Linear(self.d_model, self.n_heads)  # v (H, D) and b (H,)
            nn.init.zeros_(self.span_proj.weight)
            p = min(max(init, 1e-3), 1 - 1e-3)
            nn.init.constant_(self.span_proj.bias, math.log(p / (1 - p)))  # sigmoid(b) = init
        else:
            self.span = nn.Parameter(torch.full((self.n_heads,), float(init)))  # p_h, z_h = S p_h

    def lookback(self) -> int:
        return self.max_span - 1

    def spans(self, x_q: Tensor) -> Tensor:
        """z: (H,) static, or (B, H, T) dynamic from the queries' inputs x_q (B, T, D); float32
        (float64 for a float64 model, so its soft mask is exact to float64 rounding)."""
        if self.dynamic:
            return self.max_span * torch.sigmoid(to_acc(self.span_proj(x_q))).transpose(1, 2)  # (B, H, T)
        return self.max_span * clamp_st(to_acc(self.span), 0.0, 1.0)  # (H,)

    def width(self, z: Tensor) -> int:
        """Distances computed: min(S, ceil(max z) + R) (one host sync per call). Dynamic spans
        of no query (an empty batch, B = 0) give min(S, R): there is nothing to attend."""
        if z.numel() == 0:
            return min(self.max_span, self.ramp)
        return int(min(self.max_span, math.ceil(float(z.detach().max()) + self.ramp)))

    def groups(self, h: Heads, x_q: Tensor, z: Tensor | None = None) -> list[HeadGroup]:
        z = self.spans(x_q) if z is None else z
        w = self.width(z)
        lo, hi = (0, w - 1) if h.ctx.causal else (-(w - 1), w - 1)
        bq = self.block if self.block > 0 else max(16, min(128, w))
        piece = band_piece(h.q0, h.n_k, lo, hi, 1, bq, h.q.device)
        # |a - j| of a band depends only on the slot offsets: (1, bq, K) for every block
        dist = (piece.q_idx[:1, :, None] - piece.k_idx[:1, None, :]).abs().to(z.dtype)  # (1, bq, K)
        if self.dynamic:
            zq = take(z, 2, (piece.q_idx - h.q0).clamp(0, max(h.n_q - 1, 0)))  # (B, H, N, bq)
            m = soft_mask(dist, zq[..., None], self.ramp)  # (B, H, N, bq, K)
        else:
            m = soft_mask(dist, z.view(1, -1, 1, 1, 1), self.ramp)  # (1, H, 1, bq, K)
        piece.keep = piece.keep & (m > 0)
        piece.bias = torch.where(m > 0, m.clamp_min(torch.finfo(m.dtype).tiny).log(), torch.zeros_like(m))
        return [HeadGroup(None, [piece])]

    def penalty(self, z: Tensor, ctx: AttnContext) -> tuple[dict[str, Tensor], dict[str, object]]:
        """L1 span penalty (aux, weighted) and span metrics (mean, max; tokens)."""
        if self.dynamic:  # z (B, H, T): mean over real query tokens
            valid = ctx.key_valid[:, ctx.prefix_len :] if ctx.key_valid is not None else None
            w = torch.ones_like(z[:, 0]) if valid is None else valid.to(z.dtype)  # (B, T)
            per_head = (z * w[:, None]).sum((0, 2)) / w.sum().clamp_min(1)  # (H,)
        else:
            per_head = z
        aux = {"span_l1": self.loss_coef * per_head.sum()} if self.loss_coef > 0 else {}
        metrics = {"span": per_head.detach().mean(), "span_max": per_head.detach().max()}
        return aux, metrics

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache: KVCache | None = None) -> AttnOutput:
        h, new_cache = self.prepare(x_q, x_kv, ctx, cache)
        z = self.spans(x_q)
        out = attend_groups(h, self.groups(h, x_q, z), self.position, scale=self.scale, dropout_p=self.dropout_p)
        aux, metrics = self.penalty(z, ctx)
        return AttnOutput(self.o_proj(self.merge_heads(out)), cache=new_cache, aux=aux, metrics=metrics)

    # -- ground truth for tests ------------------------------------------------------------------
    def soft_pattern(self, x_q: Tensor, ctx: AttnContext) -> tuple[Tensor, Tensor]:
        """Dense (B|1, H, T, S) support (m_z > 0 within the span) and log m_z (0 outside)."""
        dev = ctx.pos_q.device
        a = torch.arange(ctx.q_len, device=dev)[:, None] + ctx.prefix_len  # (T, 1)
        j = torch.arange(ctx.k_len, device=dev)[None, :]  # (1, S)
        z = self.spans(x_q)
        dist = (a - j).abs().to(z.dtype)  # (T, S)
        zz = z[..., None] if self.dynamic else z.view(1, -1, 1, 1)  # (B, H, T, 1) or (1, H, 1, 1)
        m = soft_mask(dist, zz, self.ramp)  # (B|1, H, T, S)
        support = (m > 0) & (dist < self.max_span)
        return support, torch.where(support, m.clamp_min(torch.finfo(m.dtype).tiny).log(), torch.zeros_like(m))

    def pattern(self, ctx: AttnContext) -> Tensor:
        """Hard support (1, H|1, T, S): distance < S and, for static spans, m_z > 0. The soft
        weights themselves are in :meth:`reference_forward`, the ground truth of this kind."""
        dev = ctx.pos_q.device
        a = torch.arange(ctx.q_len, device=dev)[:, None] + ctx.prefix_len  # (T, 1)
        j = torch.arange(ctx.k_len, device=dev)[None, :]  # (1, S)
        dist = (a - j).abs().float()[None, None]  # (1, 1, T, S)
        band = dist < self.max_span
        if self.dynamic:
            return band
        return band & (soft_mask(dist, self.spans(ctx.pos_q).view(1, -1, 1, 1), self.ramp) > 0)

    def reference_forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext) -> AttnOutput:
        """Dense attention with the soft mask m_z as log-weights over all keys: the ground truth
        this kernel equals (no cache, no dropout). x_q (B, T, D), x_kv (B, S, D)."""
        q, k, v = self.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S, Dh), (B, H, S, Dh)
        pos = self.position
        bias = pos.score_bias(q, ctx.pos_q, ctx.pos_k) if pos.additive_bias else None
        q_c = pos.rotate(pos.content_query(q), ctx.pos_q)
        k = pos.rotate(k, ctx.pos_k)
        support, log_m = self.soft_pattern(x_q, ctx)
        allowed = ctx.allowed() & support
        # the soft mask weighs the softmax terms: log m_z goes after any score transform
        transform = None
        if pos.transforms_scores:

            def transform(s: Tensor) -> Tensor:
                return to_acc(pos.transform_scores(s, ctx.pos_q, ctx.pos_k)) + log_m

        else:
            bias = log_m if bias is None else to_acc(bias) + log_m
        out, probs = attention_reference(
            q_c, k, v, allowed, scale=self.scale, bias=bias, transform=transform,
            value_term=(lambda p: pos.value_term(p, ctx.pos_q, ctx.pos_k)) if pos.value_bias else None,
        )
        return AttnOutput(self.o_proj(self.merge_heads(out)), weights=probs)


@ATTENTION.register(
    "adaptive_span",
    description="Adaptive attention span: soft mask m_z with ramp R, learned span per head (or per token), L1 span penalty",
    paper="Sukhbaatar et al. 2019, Adaptive Attention Span in Transformers (sec. 3)",
    capabilities=Capabilities(
        causal=True, bidirectional=True, key_padding=True, memory=True, incremental=True, exact=True, subquadratic=True,
        # its pattern is on key indices with query i at key S - T + i (the last T keys): as cross-attention
        # with more queries than keys the first ones would see no key at all (a silent zero output)
        cross_attention=False,
    ),
)
@dataclass(frozen=True)
class AdaptiveSpanConfig(AttentionConfig):
    """``max_span``: S, the largest span (keys at distance >= S are never attended);
    ``ramp``: R, softness of the mask; ``init``: initial z / S (the paper starts at 0);
    ``dynamic``: z_t = S sigmoid(v . x_t + b) per token instead of one z per head;
    ``loss_coef``: weight of the L1 span penalty (2e-6 in the paper's character LMs);
    ``block``: query block length of the band (0 = automatic)."""

    max_span: int = 128
    ramp: int = 16
    init: float = 0.0
    dynamic: bool = False
    loss_coef: float = 2e-6
    block: int = 0

    def __post_init__(self) -> None:
        if self.max_span < 1 or self.ramp < 1:
            raise ValueError(f"attention.max_span and attention.ramp must be >= 1, got {self.max_span}, {self.ramp}")
        if not 0.0 <= self.init <= 1.0:
            raise ValueError(f"attention.init is z / max_span and must lie in [0, 1], got {self.init}")
        if self.loss_coef < 0 or self.block < 0:
            raise ValueError(f"attention.loss_coef and attention.block must be >= 0, got {self.loss_coef}, {self.block}")

    @classmethod
    def bench_config(cls, length: int) -> dict:
        """Benchmark values: S = 512, R = 32, spans at 128 (a trained model's typical short spans):
        160 keys per query."""
        return {"max_span": 512, "ramp": 32, "init": 0.25}

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Test values: spans shorter than the sequence, with part of the ramp in range."""
        return {"max_span": 8, "ramp": 2, "init": 0.5} if seq_len < 256 else {"max_span": 128, "ramp": 16, "init": 0.5}

    def build(self, ctx, position) -> AttentionModule:
        return AdaptiveSpanAttention(
            ctx, position, self.max_span, self.ramp, self.init, self.dynamic, self.loss_coef, self.block
        )
