"""A float64 model is exact to float64 rounding: scores, softmax and positional tables run in
float64 for float64 inputs (float32 only for half types). Checked: the reference kernel, the
block-sparse engine and the rotary/sinusoid tables (in float32 their errors are ~5e-8), and the
kNN memory's float64 fill (-inf under a float32 softmax: NaN on an empty store).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.attention.base import attention_reference
from rl_tformers.position.absolute import sinusoid
from rl_tformers.position.rotary import apply_rotary, rotary_angles

D, H, T = 16, 2, 9


def _backbone(attention: dict, position: str = "none", memory: dict | None = None) -> Backbone:
    torch.manual_seed(0)
    cfg = {"d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "max_position": 64,
           "attention": attention, "position": {"kind": position}, "memory": memory or {"kind": "none"}}
    return Backbone(cfg).eval().to(torch.float64)


def _inputs(b: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, T, D, generator=g, dtype=torch.float64)
    mask = torch.ones(b, T, dtype=torch.bool)
    mask[1, :3] = False  # left padding, as the Decision Transformer's windows
    pos = torch.arange(T).expand(b, T)
    return x, pos, mask


def test_reference_kernel_matches_a_float64_formula():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    out, _ = attention_reference(q, k, v, allowed, scale=0.5)
    s = (q @ k.transpose(-1, -2)) * 0.5
    s = s.masked_fill(~allowed, -math.inf)
    want = torch.softmax(s, -1) @ v
    assert out.dtype == torch.float64
    assert (out - want).abs().max().item() < 1e-14


@pytest.mark.parametrize("kind, fields, position", [
    ("sdpa", {}, "rotary"),
    ("sdpa", {}, "shaw"),
    ("sdpa", {}, "xl_relative"),
    ("sdpa", {}, "sinusoidal"),
    ("local", {"block": 16, "memory": 16}, "none"),  # one block covering everything = dense
    ("strided", {"stride": 16}, "none"),
    ("adaptive_span", {"max_span": 16, "ramp": 2, "init": 1.0}, "none"),  # z = S = dense
])
def test_exact_kernels_equal_the_float64_reference_to_float64_rounding(kind, fields, position):
    ref = _backbone({"kind": "reference"}, position)
    other = _backbone({"kind": kind, **fields}, position)
    missing = other.load_state_dict(ref.state_dict(), strict=False)
    assert not missing.unexpected_keys
    x, pos, mask = _inputs()
    with torch.no_grad():
        a = ref(x, positions=pos, mask=mask).hidden
        b = other(x, positions=pos, mask=mask).hidden
    assert a.dtype == b.dtype == torch.float64
    assert (a - b)[mask].abs().max().item() < 1e-12


def test_rotary_and_sinusoid_tables_in_float64():
    pos = torch.tensor([0, 7, 1000, 123457])
    ang = rotary_angles(pos, 8, 10000.0, torch.float64)
    want = pos.double().numpy()[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    assert np.abs(ang.numpy() - want).max() < 1e-9 * 123457
    x = torch.randn(4, 8, dtype=torch.float64)
    y = apply_rotary(x, ang)
    assert y.dtype == torch.float64 and torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-12, rtol=0)
    pe = sinusoid(pos, 8, dtype=torch.float64)
    want_pe = np.stack([np.sin(want), np.cos(want)], -1).reshape(4, 8)
    assert np.abs(pe.numpy() - want_pe).max() < 1e-9


def test_knn_memory_stays_finite_in_float64_from_an_empty_store():
    bb = _backbone({"kind": "sdpa"}, "rotary",
                   memory={"kind": "knn", "mem_len": 3, "store_size": 16, "top_k": 3, "layer": -1, "search": "torch"})
    x, _, _ = _inputs()
    with torch.no_grad():
        st = bb.initial_state(3)
        for t in range(3):  # first step: nothing to retrieve
            o = bb(x[:, t:t + 1], state=st)
            st = o.state
            assert torch.isfinite(o.hidden).all(), t
        assert torch.isfinite(bb(x, state=bb.initial_state(3)).hidden).all()
