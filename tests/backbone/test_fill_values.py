"""Masked fill values come from torch.finfo(dtype); no NaN under bf16 (or fp16) with padding."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import rl_tformers
from rl_tformers import Backbone
from rl_tformers.attention.base import attention_reference, attention_sdpa
from rl_tformers.registry import POSITION
from rl_tformers.types import neg_inf

PKG = Path(rl_tformers.__file__).resolve().parent


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_fill_value_is_the_most_negative_finite_value(dtype):
    assert neg_inf(dtype) == torch.finfo(dtype).min
    assert torch.isfinite(torch.tensor(neg_inf(dtype), dtype=dtype))


def _masks(t=6):
    allowed = torch.ones(2, 1, t, t, dtype=torch.bool).tril()
    allowed[0, :, :, 4:] = False  # padded keys in row 0
    allowed[1, :, 0] = False  # query 0 of row 1 sees nothing
    return allowed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_kernel_low_precision_masked_probs_are_exact_zeros(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g).to(dtype) * 30 for _ in range(3))  # large logits
    allowed = _masks()
    bias = torch.randn(2, 2, 6, 6, generator=g).to(dtype)
    out, probs = attention_reference(q, k, v, allowed, scale=0.5, bias=bias)
    assert torch.isfinite(out).all() and torch.isfinite(probs).all()
    assert (probs.masked_select(~allowed.expand_as(probs)) == 0).all()
    assert (out[1, :, 0] == 0).all()  # a row with no allowed key returns zeros
    live = allowed.any(-1).expand(2, 2, 6)
    torch.testing.assert_close(probs.float().sum(-1)[live], torch.ones(int(live.sum())), atol=1e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_kernel_low_precision_with_bias_and_padding_is_finite(dtype):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g).to(dtype) for _ in range(3))
    allowed = _masks()
    bias = -torch.arange(6.0).expand(2, 2, 6, 6) * 1e3  # large ALiBi-like penalties
    out = attention_sdpa(q, k, v, allowed, scale=0.5, bias=bias)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), allowed, scale=0.5, bias=bias.double())
    assert torch.isfinite(out).all()
    assert (out[1, :, 0] == 0).all()
    torch.testing.assert_close(out.double(), ref, atol=5e-2, rtol=0)


@pytest.mark.parametrize("position", POSITION.kinds())
@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_bf16_backbone_with_padding_has_no_nan(position, attention):
    torch.manual_seed(0)
    bb = Backbone({"d_model": 16, "n_heads": 2, "n_layers": 2, "attention": {"kind": attention},
                   "position": {"kind": position}}).to(torch.bfloat16).train()
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1, :3] = False  # left padding: causal empty rows
    out = bb(x, mask=mask).hidden
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in bb.parameters())


_MAGIC = re.compile(r"-\s*1e\+?(?:4|5|6|8|9|10|12|15|20|30|38)\b|-\s*10000(?:\.0*)?\b|-\s*65504\b")
_INF_FILL = re.compile(r"masked_fill\([^)]*float\(\s*[\"']-inf[\"']\s*\)")
#: Files of the backbone core, positions and blocks: no -inf fills there either.
_CORE = ["types.py", "backbone.py", "attention/base.py", "attention/sdpa.py", "encoder_decoder.py", "position", "blocks"]


def test_no_magic_number_fill_values_in_the_library():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _MAGIC.search(code):
                bad.append(f"{path.relative_to(PKG)}:{i}: {line.strip()}")
    assert not bad, "use torch.finfo(dtype).min (rl_tformers.types.neg_inf) instead of literals:\n" + "\n".join(bad)


def test_core_masks_never_fill_with_minus_infinity():
    bad = []
    for entry in _CORE:
        p = PKG / entry
        for path in sorted(p.rglob("*.py") if p.is_dir() else [p]):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if _INF_FILL.search(line.split("#", 1)[0]):
                    bad.append(f"{path.relative_to(PKG)}:{i}")
    assert not bad, f"masked_fill with -inf (NaN on fully masked rows): {bad}"
