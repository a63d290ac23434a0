"""The Universal Transformer's separable-convolution transition function.

Dehghani et al. 2019, "Universal Transformers", sec. 2.1: the transition function after the
self-attention is "either a separable convolution (Chollet, 2016) or a fully-connected neural
network". A depthwise-separable convolution (Chollet 2017, "Xception", sec. 3) is a depthwise
convolution along the sequence (one kernel of width w per channel) followed by a pointwise
(1 x 1) one, a linear map of the channels:

    sepconv(x)_t = W_p (sum_u w_{:, u} * x_{t + o_u}) + b_p

Here two of them with the backbone's activation between them take the feed-forward network's
place and shape (D -> d_ff -> D). Taps o_u: ``-(w - 1) .. 0`` in a causal backbone (a token
reads only itself and earlier ones), ``-(w // 2) .. w - 1 - w // 2`` otherwise. A tap that
falls before the first or after the last token, on a padded token or on a token of another
episode reads zero, so padding and other episodes never change an output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.blocks.base import _ACT
from rl_tformers.dropout import Dropout
from rl_tformers.types import AttnContext


def tap_offsets(width: int, causal: bool) -> list[int]:
    """Sequence offsets o_u of the w taps (causal: -(w-1) .. 0; else centred, -(w//2) .. w-1-w//2)."""
    start = -(width - 1) if causal else -(width // 2)
    return list(range(start, start + width))


def shifted(x: Tensor, offset: int) -> Tensor:
    """y_t = x_{t + offset} along dim 1 of x (B, T, ...), zero where t + offset is outside [0, T)."""
    t = x.shape[1]
    if offset == 0:
        return x
    if abs(offset) >= t:
        return torch.zeros_like(x)
    pad = [0, 0] * (x.dim() - 2)
    if offset > 0:
        return F.pad(x[:, offset:], pad + [0, offset])
    return F.pad(x[:, :offset], pad + [-offset, 0])


def tap_masks(ctx: AttnContext, t: int, width: int, device: torch.device) -> list[tuple[int, Tensor]]:
    """(o_u, (B, T) bool) per tap: True where token t + o_u exists, is real and is of t's episode."""
    b = ctx.pos_q.shape[0]
    valid = ctx.key_valid[:, -t:] if ctx.key_valid is not None else torch.ones(b, t, dtype=torch.bool, device=device)
    out = []
    for o in tap_offsets(width, ctx.causal):  # loop over the w taps (a hyper-parameter), not over tokens
        ok = shifted(valid, o)
        if ctx.seg_q is not None:
            ok = ok & (shifted(ctx.seg_q, o) == ctx.seg_q)
        out.append((o, ok))
    return out


class SeparableConv(nn.Module):
    """Depthwise convolution along the sequence (w taps per channel) then a pointwise linear map
    (Chollet 2017): (B, T, C_in) -> (B, T, C_out), given the taps of :func:`tap_masks`."""

    def __init__(self, c_in: int, c_out: int, width: int) -> None:
        super().__init__()
        self.depthwise = nn.Parameter(torch.randn(c_in, width) / width**0.5)  # (C_in, w)
        self.pointwise = nn.Linear(c_in, c_out)

    def forward(self, x: Tensor, taps: list[tuple[int, Tensor]]) -> Tensor:
        z = torch.zeros_like(x)
        for u, (o, ok) in enumerate(taps):
            z = z + shifted(x, o) * ok[..., None].to(x.dtype) * self.depthwise[:, u]  # (B, T, C_in)
        return self.pointwise(z)


class SepConvTransition(nn.Module):
    """sepconv(D -> d_ff), activation, dropout, sepconv(d_ff -> D) (module docstring).

    ``forward(x (B, T, D), ctx) -> (B, T, D)``; ``ctx`` gives the causal flag, the validity
    (last T of ``key_valid``) and the episode ids (``seg_q``) of the T tokens.

    Raises:
        ValueError: ``x`` does not hold the context's T query tokens (a subset of queries).
    """

    takes_context = True  # BlockModule.transition passes the attention context

    def __init__(self, d_model: int, d_ff: int, width: int, activation: str, dropout: float) -> None:
        super().__init__()
        self.width = width
        self.conv1 = SeparableConv(d_model, d_ff, width)
        self.conv2 = SeparableConv(d_ff, d_model, width)
        self.act = _ACT[activation]
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, ctx: AttnContext) -> Tensor:
        t = x.shape[1]
        if t != ctx.q_len:
            raise ValueError(f"sepconv transition: x holds {t} tokens, the context {ctx.q_len} (a subset of queries)")
        taps = tap_masks(ctx, t, self.width, x.device)
        return self.conv2(self.dropout(self.act(self.conv1(x, taps))), taps)
