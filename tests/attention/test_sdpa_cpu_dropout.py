"""Dense attention on CPU with dropout (``attention_sdpa``'s explicit fp32 path) and the per-context
additive mask: the same values as PyTorch's SDPA with the dropout mask of
:func:`rl_tformers.dropout.keep_mask` drawn under the same seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_tformers.attention.base import attention_reference, attention_sdpa
from rl_tformers.dropout import keep_mask, quantised_p
from rl_tformers.types import AttnContext


def _qkv(b=3, h=2, t=7, s=7, dh=4):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, h, n, dh, generator=g) for n in (t, s, s))


def _ctx(b=3, t=7):
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :3] = False  # left padding: query rows 0..2 of row 1 have no allowed key
    pos = torch.arange(t).expand(b, t)
    return AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=True)


@pytest.mark.parametrize("with_bias", [False, True])
def test_explicit_cpu_path_is_torch_sdpa_with_the_dropout_module_draws(with_bias):
    q, k, v = _qkv()
    ctx = _ctx()
    allowed = ctx.allowed()
    bias = torch.randn(1, 2, 7, 7) if with_bias else None
    torch.manual_seed(3)
    ours = attention_sdpa(q, k, v, allowed, scale=0.5, bias=bias, dropout_p=0.3)
    # PyTorch's attention without dropout, its probabilities times the keep mask of the same seed
    row_ok = allowed.any(-1, keepdim=True)
    mask = allowed | ~row_ok
    if bias is not None:
        mask = bias.masked_fill(~mask, torch.finfo(torch.float32).min)
    torch.manual_seed(3)
    keep = keep_mask((3, 2, 7, 7), 0.3)
    identity = torch.eye(7).expand(3, 2, 7, 7)  # SDPA's probabilities: attention over the identity as values
    probs = F.scaled_dot_product_attention(q, k, identity, attn_mask=mask, scale=0.5)
    ref = (probs * keep / (1 - quantised_p(0.3))) @ v * row_ok
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert (ours[1, :, :3] == 0).all()  # rows without an allowed key return zeros
    if not with_bias:
        torch.manual_seed(3)
        cached = attention_sdpa(q, k, v, None, scale=0.5, dropout_p=0.3, additive=ctx.additive_mask(q.dtype))
        torch.testing.assert_close(cached, ref, rtol=1e-5, atol=1e-6)


def test_no_dropout_matches_the_reference_kernel():
    q, k, v = _qkv()
    ctx = _ctx()
    ref, _ = attention_reference(q, k, v, ctx.allowed(), scale=0.5)
    out = attention_sdpa(q, k, v, None, scale=0.5, additive=ctx.additive_mask(q.dtype))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_additive_mask_is_cached_per_context_and_dtype():
    ctx = _ctx()
    mask, row_ok = ctx.additive_mask(torch.float32)
    assert ctx.additive_mask(torch.float32)[0] is mask
    allowed = ctx.allowed()
    assert mask.shape == allowed.shape and row_ok.shape == (3, 1, 7, 1)
    assert row_ok[1, 0, :3].eq(0).all() and row_ok[1, 0, 3:].eq(1).all() and row_ok[0].eq(1).all()
    assert (mask[allowed] == 0).all() and (mask[1, 0, :3] == 0).all()  # empty rows left open
    assert (mask[~allowed & row_ok.bool().expand_as(allowed)] == torch.finfo(torch.float32).min).all()
    assert ctx.additive_mask(torch.bfloat16)[0].dtype == torch.bfloat16
    # contexts derived from it get a fresh cache (their masks differ)
    sub = ctx.select_queries(slice(1, None, 3))
    assert sub.additive_mask(torch.float32)[0].shape == (3, 1, 2, 7)
    assert ctx.select(0, 2).additive_mask(torch.float32)[0].shape == (3, 1, 2, 7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cpu_attention_with_dropout_is_the_float32_path_cast_back(dtype):
    q, k, v = (x.to(dtype) for x in _qkv())
    allowed = _ctx().allowed()
    torch.manual_seed(3)
    low = attention_sdpa(q, k, v, allowed, scale=0.5, dropout_p=0.3)
    torch.manual_seed(3)
    ref = attention_sdpa(q.float(), k.float(), v.float(), allowed, scale=0.5, dropout_p=0.3)
    assert low.dtype == dtype and torch.equal(low, ref.to(dtype))  # the same draws, float32 inside


def test_the_bf16_path_runs_in_float32_under_autocast_and_passes_gradients():
    q, k, v = (x.bfloat16().requires_grad_() for x in _qkv())
    allowed = _ctx().allowed()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(3)
        out = attention_sdpa(q, k, v, allowed, scale=0.5, dropout_p=0.3)
    torch.manual_seed(3)
    ref = attention_sdpa(q.detach().float(), k.detach().float(), v.detach().float(), allowed, scale=0.5, dropout_p=0.3)
    assert torch.equal(out, ref.bfloat16())  # autocast does not send the float32 products back to bf16
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 and x.grad.isfinite().all() for x in (q, k, v))
