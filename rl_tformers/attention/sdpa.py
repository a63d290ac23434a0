"""Dense multi-head attention (``sdpa``) and the plain reference kernel (``reference``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.attention.base import (
    AttentionConfig,
    AttentionModule,
    KVCache,
    attention_reference,
    attention_sdpa,
)
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext, AttnOutput


class DenseAttention(AttentionModule):
    """Full softmax attention over all allowed keys (Vaswani et al. 2017).

    Uses fused SDPA whenever the positional encoding only adds a score bias or rotates q/k,
    and the explicit reference computation when it needs scores or probabilities (Shaw value
    terms, DA-Transformer) or when weights are requested. ``force_reference`` always uses the
    explicit path (the test suite's ground truth).

    Cost: O(T S) time and memory per head.
    """

    query_subset = True  # every path masks with ctx.allowed() (or plain causal, T == S only)

    def __init__(self, ctx, position, force_reference: bool = False) -> None:
        super().__init__(ctx, position)
        self.force_reference = force_reference

    def init_cache(self, batch: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        empty = torch.zeros(batch, self.n_heads, 0, self.head_dim, device=device, dtype=dtype)
        return KVCache(empty, empty.clone())

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache: KVCache | None = None) -> AttnOutput:
        q, k, v = self.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S_new, Dh)
        pos = self.position
        n_new = k.shape[2]
        pos_k_new = ctx.pos_k[:, ctx.k_len - n_new :]
        bias = None
        if pos.additive_bias:
            # every path below masks with ctx, so a kind may skip the masked pairs (XL relative: one distance
            # table per forward, masked_score_bias); the reference kernel (the tests' ground truth) takes all
            masked_bias = None if self.force_reference else getattr(pos, "masked_score_bias", None)
            bias = pos.score_bias(q, ctx.pos_q, ctx.pos_k) if masked_bias is None else masked_bias(q, ctx)
        q_c = pos.content_query(q)
        q_c = pos.rotate(q_c, ctx.pos_q)
        k = pos.rotate(k, pos_k_new)
        if cache is not None:
            k = torch.cat([cache.k, k], dim=2)  # (B, H, P + T, Dh)
            v = torch.cat([cache.v, v], dim=2)
            cache = KVCache(k, v)
        if k.shape[2] != ctx.k_len:
            raise ValueError(f"attention: {k.shape[2]} keys but the context describes {ctx.k_len}")
        weights = None
        if self.force_reference or pos.needs_probs or ctx.need_weights:
            out, weights = attention_reference(
                q_c, k, v, ctx.allowed() if ctx.has_mask else None,
                scale=self.scale, bias=bias,
                transform=(lambda s: pos.transform_scores(s, ctx.pos_q, ctx.pos_k)) if pos.transforms_scores else None,
                value_term=(lambda p: pos.value_term(p, ctx.pos_q, ctx.pos_k)) if pos.value_bias else None,
                dropout_p=self.dropout_p,
            )
        else:
            plain = ctx.is_plain_causal and bias is None
            masked = ctx.has_mask and not plain
            out = attention_sdpa(
                q_c, k, v, ctx.allowed() if masked else None,
                scale=self.scale, bias=bias, is_causal=plain, dropout_p=self.dropout_p,
                additive=ctx.additive_mask(q_c.dtype) if masked else None,
            )
        return AttnOutput(self.o_proj(self.merge_heads(out)), cache=cache, weights=weights)


@ATTENTION.register(
    "sdpa",
    description="Dense multi-head attention through PyTorch's fused scaled_dot_product_attention",
    paper="Vaswani et al. 2017, Attention Is All You Need",
    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class SDPAConfig(AttentionConfig):
    def build(self, ctx, position) -> AttentionModule:
        return DenseAttention(ctx, position)


@ATTENTION.register(
    "reference",
    description="Dense attention computed explicitly (softmax(QK^T/sqrt(d))V); ground truth for tests",
    paper="Vaswani et al. 2017, Attention Is All You Need (eq. 1)",
    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class ReferenceConfig(AttentionConfig):
    def build(self, ctx, position) -> AttentionModule:
        return DenseAttention(ctx, position, force_reference=True)
