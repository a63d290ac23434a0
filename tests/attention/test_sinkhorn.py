"""Sparse Sinkhorn attention's SortCut (Tay et al. 2020, sec. 3.5) against a reference written
from the paper: Y = softmax(Q psi_S(K)[:n]^T / sqrt(d)) psi_S(V)[:n], psi_S the soft sort of the
blocks by the Sinkhorn-balanced SortNet matrix P, cut after its first n_c blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_tformers import Backbone
from rl_tformers.backbone_config import BackboneConfig, BuildContext, IncompatibleConfig
from rl_tformers.registry import RegistryError
from rl_tformers.types import AttnContext

D, H, BLOCK = 16, 2, 4


def sinkhorn_module(**fields):
    cfg = BackboneConfig.from_dict(
        {"d_model": D, "n_layers": 1, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "causal": False,
         "attention": {"kind": "sinkhorn", "block_size": BLOCK, "max_len": 64, **fields}}
    )
    ctx = BuildContext(cfg).at_layer(0)
    torch.manual_seed(2)
    return cfg.attention.build(ctx, cfg.position.build(ctx)).double().eval()


def sortcut_reference(mod, x: torch.Tensor, valid: torch.Tensor, cut: int) -> torch.Tensor:
    """Per row and head, with python loops over blocks: sorted block i = sum_j P_ij K_j over the
    valid keys (renormalised by their mass w_i, whose log enters the score: exact masking for a
    hard P), the first ``cut`` sorted blocks as the keys of every query. (B, S, D) after o_proj."""
    b, s, _ = x.shape
    n = -(-s // BLOCK)
    pad = n * BLOCK - s
    q, k, v = mod.project(x, x)  # (B, H, S, Dh)
    valid_p = F.pad(valid, (0, pad), value=False)
    p_mat = mod.sort_matrix(F.pad(x, (0, 0, 0, pad)), valid_p, False)  # (B, H, N, N): SortNet + Sinkhorn
    k, v = F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
    y = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(H):
            keys, vals, logw = [], [], []
            for i in range(min(cut, n)):
                for slot in range(BLOCK):
                    idx = [j * BLOCK + slot for j in range(n)]
                    weight = torch.stack([p_mat[bi, hi, i, j] * valid_p[bi, idx[j]] for j in range(n)])  # (N,)
                    mass = weight.sum()
                    keys.append((weight[:, None] * k[bi, hi, idx]).sum(0) / mass)
                    vals.append((weight[:, None] * v[bi, hi, idx]).sum(0) / mass)
                    logw.append(mass.log())
            scores = q[bi, hi] @ torch.stack(keys).T * mod.scale + torch.stack(logw)  # (S, n_c b)
            y[bi, hi] = torch.softmax(scores, -1) @ torch.stack(vals)
    return mod.o_proj(mod.merge_heads(y))


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_sortcut_equals_the_truncated_soft_sort_reference(cut):
    mod = sinkhorn_module(sortcut=cut)
    s = 14  # 4 blocks, the last one half padding
    x = torch.randn(2, s, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[0, -3:] = False  # padding
    pos = torch.arange(s).expand(2, s)
    with torch.no_grad():
        got = mod(x, x, AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=False)).out
        want = sortcut_reference(mod, x, valid, cut)
    torch.testing.assert_close(got[valid], want[valid], atol=1e-12, rtol=0)


def test_sortcut_in_a_causal_backbone_is_refused_naming_the_field():
    with pytest.raises(IncompatibleConfig) as err:
        Backbone({"d_model": D, "n_heads": H, "causal": True, "attention": {"kind": "sinkhorn", "sortcut": 2}})
    assert str(err.value).startswith("backbone.attention.sortcut=2 has no causal form")
    assert "\n" not in str(err.value)
    with pytest.raises(RegistryError, match=r"^backbone.attention: attention.sortcut must be >= 0"):
        BackboneConfig.from_dict({"attention": {"kind": "sinkhorn", "sortcut": -1}})


def test_sortcut_zero_keeps_the_local_and_sorted_blocks():
    """sortcut = 0 is the default: the local block plus the sorted block (other outputs than a cut)."""
    x = torch.randn(1, 16, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    pos = torch.arange(16)[None]
    ctx = AttnContext(pos_q=pos, pos_k=pos, causal=False)
    with torch.no_grad():
        a = sinkhorn_module()(x, x, ctx).out
        b = sinkhorn_module(sortcut=4)(x, x, ctx).out
    assert (a - b).abs().max() > 1e-3


def test_sortcut_runs_an_empty_batch_and_a_row_without_valid_keys():
    bb = Backbone({"d_model": D, "n_heads": H, "causal": False,
                   "attention": {"kind": "sinkhorn", "sortcut": 2, "block_size": BLOCK, "max_len": 64}})
    assert bb(torch.randn(0, 7, D)).hidden.shape == (0, 7, D)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0] = False
    out = bb(torch.randn(2, 9, D), mask=mask).hidden
    assert out.shape == (2, 9, D) and torch.isfinite(out).all()
