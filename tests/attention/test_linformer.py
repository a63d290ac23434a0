"""Linformer's general projections (Wang et al. 2020, sec. 4: "one can choose mean/max pooling,
or convolution where the kernel and stride is set to n/k") against references written from
that sentence: max pooling over k contiguous segments of the keys and values, and a learned
convolution along the sequence with kernel = stride = n/k; then softmax(Q K_proj^T / sqrt(d)) V_proj."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.backbone_config import BackboneConfig, BuildContext
from rl_tformers.registry import RegistryError
from rl_tformers.types import AttnContext

D, H = 16, 2


def linformer_module(layer: int = 0, n_layers: int = 1, **fields):
    cfg = BackboneConfig.from_dict(
        {"d_model": D, "n_layers": n_layers, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "causal": False,
         "attention": {"kind": "linformer", **fields}}
    )
    ctx = BuildContext(cfg).at_layer(layer)
    torch.manual_seed(7)
    return cfg.attention.build(ctx, cfg.position.build(ctx)).double().eval()


def inputs(s: int = 13):
    x = torch.randn(2, s, D, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[0, -4:] = False  # right padding
    valid[1, :2] = False  # left padding
    pos = torch.arange(s).expand(2, s)
    return x, valid, AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=False)


def attend(mod, q, pk, pv):
    """softmax(q pk^T / sqrt(Dh)) pv for one row and head; (T, Dh)."""
    return torch.softmax(q @ pk.T * mod.scale, -1) @ pv


def max_pool_reference(mod, x, valid, k):
    q, keys, vals = mod.project(x, x)  # (B, H, S, Dh)
    s = x.shape[1]
    y = torch.zeros_like(q)
    for bi in range(2):
        for hi in range(H):
            pk, pv = [], []
            for r in range(k):  # segment r: keys j with floor(j k / S) = r
                members = [j for j in range(s) if j * k // s == r and valid[bi, j]]
                if members:
                    pk.append(keys[bi, hi, members].amax(0))
                    pv.append(vals[bi, hi, members].amax(0))
            y[bi, hi] = attend(mod, q[bi, hi], torch.stack(pk), torch.stack(pv))
    return mod.o_proj(mod.merge_heads(y))


def conv_reference(mod, x, valid, k, max_len):
    q, keys, vals = mod.project(x, x)
    s = x.shape[1]
    kw = -(-max_len // k)
    w_k = mod.e_proj if mod.e_proj.dim() == 3 else None
    y = torch.zeros_like(q)
    for bi in range(2):
        for hi in range(H):
            wk = w_k if w_k is not None else mod.e_proj[hi]  # (Dh_out, Dh_in, kw)
            wv = mod.f_proj if mod.f_proj is not None and mod.f_proj.dim() == 3 else (
                mod.f_proj[hi] if mod.f_proj is not None else wk)
            pk, pv = [], []
            for r in range(k):  # row r: sum over the taps u of W[:, :, u] x_{r kw + u} (x_j = 0 past S, padding 0)
                rk, rv = torch.zeros(mod.head_dim, dtype=x.dtype), torch.zeros(mod.head_dim, dtype=x.dtype)
                for u in range(kw):
                    j = r * kw + u
                    if j < s and valid[bi, j]:
                        rk = rk + wk[:, :, u] @ keys[bi, hi, j]
                        rv = rv + wv[:, :, u] @ vals[bi, hi, j]
                pk.append(rk)
                pv.append(rv)
            y[bi, hi] = attend(mod, q[bi, hi], torch.stack(pk), torch.stack(pv))
    return mod.o_proj(mod.merge_heads(y))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_max_pool_equals_the_segment_maximum_reference(k):
    mod = linformer_module(projection="max_pool", k=k)
    x, valid, ctx = inputs()
    with torch.no_grad():
        got, want = mod(x, x, ctx).out, max_pool_reference(mod, x, valid, k)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-12, rtol=0)


def test_max_pool_with_one_key_per_segment_is_dense_attention():
    mod = linformer_module(projection="max_pool", k=13)
    x, valid, ctx = inputs()
    with torch.no_grad():
        got, want = mod(x, x, ctx).out, mod.reference_forward(x, x, ctx).out
    torch.testing.assert_close(got[valid], want[valid], atol=1e-12, rtol=0)


@pytest.mark.parametrize("sharing", ["none", "headwise", "kv", "layerwise"])
@pytest.mark.parametrize(("k", "max_len"), [(4, 16), (3, 16)])  # kernel 4, and ceil(16 / 3) = 6
def test_conv_equals_the_strided_convolution_reference(sharing, k, max_len):
    mod = linformer_module(projection="conv", k=k, max_len=max_len, sharing=sharing)
    x, valid, ctx = inputs()
    with torch.no_grad():
        got, want = mod(x, x, ctx).out, conv_reference(mod, x, valid, k, max_len)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-12, rtol=0)


def test_conv_parameters_follow_the_sharing_option():
    shapes = {s: tuple(p.shape for p in (linformer_module(projection="conv", k=4, max_len=16, sharing=s).e_proj,))
              for s in ("none", "headwise")}
    assert shapes == {"none": ((H, D // H, D // H, 4),), "headwise": ((D // H, D // H, 4),)}
    assert linformer_module(projection="conv", k=4, max_len=16, sharing="kv").f_proj is None
    bb = Backbone({"d_model": D, "n_heads": H, "n_layers": 2, "causal": False,
                   "attention": {"kind": "linformer", "projection": "conv", "k": 4, "max_len": 16, "sharing": "layerwise"}})
    assert bb.blocks[0].attn.e_proj is bb.blocks[1].attn.e_proj


def test_conv_refuses_more_keys_than_max_len_and_projection_names_the_choices():
    mod = linformer_module(projection="conv", k=4, max_len=8)
    x, _, ctx = inputs()
    with pytest.raises(ValueError, match=r"13 keys exceed attention.max_len=8"):
        mod(x, x, ctx)
    with pytest.raises(RegistryError, match=r"attention.projection must be one of linear, pool, max_pool, conv"):
        BackboneConfig.from_dict({"causal": False, "attention": {"kind": "linformer", "projection": "avg"}})


def test_padding_content_never_changes_valid_outputs():
    for fields in ({"projection": "max_pool", "k": 3}, {"projection": "conv", "k": 4, "max_len": 16}):
        mod = linformer_module(**fields)
        x, valid, ctx = inputs()
        garbage = x.clone()
        garbage[~valid] = 1e3
        with torch.no_grad():
            a, b = mod(x, x, ctx).out, mod(garbage, garbage, ctx).out
        torch.testing.assert_close(a[valid], b[valid], atol=1e-12, rtol=0)


@pytest.mark.parametrize("fields", [{"projection": "max_pool", "k": 3},
                                    {"projection": "conv", "k": 4, "max_len": 16, "sharing": "none"},
                                    {"projection": "conv", "k": 4, "max_len": 16}])
def test_an_empty_batch_and_a_row_without_valid_keys_run(fields):
    bb = Backbone({"d_model": D, "n_heads": H, "causal": False, "attention": {"kind": "linformer", **fields}})
    assert bb(torch.randn(0, 7, D)).hidden.shape == (0, 7, D)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0] = False  # every key of row 0 padded
    out = bb(torch.randn(2, 9, D), mask=mask).hidden
    assert out.shape == (2, 9, D) and torch.isfinite(out).all()
