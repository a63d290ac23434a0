"""The dense kernel's XL relative bias over allowed pairs only (``masked_score_bias``) equals the
full ``score_bias`` on every pair the mask allows, with one table per forward shared by layers."""

from __future__ import annotations

import pytest
import torch

from rl_tformers.backbone_config import BackboneConfig, BuildContext
from rl_tformers.types import AttnContext


@pytest.fixture(scope="module")
def module():
    torch.manual_seed(0)
    cfg = BackboneConfig.from_dict({"d_model": 32, "n_heads": 4, "n_layers": 1, "position": {"kind": "xl_relative"}})
    mod = cfg.position.build(BuildContext(cfg).at_layer(0)).double()
    with torch.no_grad():
        mod.v.normal_()
    return mod


B, M, T = 3, 6, 4
POS_Q = torch.tensor([[100, 101, 102, 103], [50, 51, 0, 1], [3, 4, 5, 6]])  # row 1: an episode starts
POS_K = torch.cat([torch.tensor([[94, 95, 96, 97, 98, 99], [44, 45, 46, 47, 48, 49], [0, 0, 0, 0, 1, 2]]), POS_Q], 1)
VALID = torch.cat([torch.tensor([[1] * 6, [1] * 6, [0, 0, 0, 1, 1, 1]]).bool(), torch.ones(B, T, dtype=torch.bool)], 1)
SEG_Q = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]])
SEG_K = torch.cat([torch.zeros(B, M, dtype=torch.long), SEG_Q], 1)
XL = AttnContext(pos_q=POS_Q, pos_k=POS_K, key_valid=VALID, seg_q=SEG_Q, seg_k=SEG_K, causal=True)


@pytest.mark.parametrize("name", ["xl_memory", "no_mask", "far_apart_noncausal", "select_queries", "nothing_allowed"])
def test_masked_bias_equals_full_bias_on_allowed_pairs(module, name):
    ctx = {
        "xl_memory": XL,  # unfilled slots at position 0 read from step 100; an episode start in row 1
        "no_mask": AttnContext(pos_q=POS_Q, pos_k=POS_K, causal=False),
        "far_apart_noncausal": AttnContext(pos_q=POS_Q, pos_k=POS_K, key_valid=VALID, causal=False),
        "select_queries": XL.select_queries(slice(1, None, 2)),
        "nothing_allowed": AttnContext(pos_q=POS_Q, pos_k=POS_K, key_valid=torch.zeros(B, M + T, dtype=torch.bool),
                                       causal=True),
    }[name]
    q = torch.randn(B, 4, ctx.pos_q.shape[1], 8, dtype=torch.float64)
    full = module.score_bias(q, ctx.pos_q, ctx.pos_k)
    got = module.masked_score_bias(q, ctx)
    assert got.shape == full.shape and torch.isfinite(got).all()
    allowed = ctx.allowed().expand_as(full) if ctx.has_mask else torch.ones_like(full, dtype=torch.bool)
    torch.testing.assert_close(got[allowed], full[allowed], atol=1e-12, rtol=0)


def test_causal_memory_table_has_one_row_per_key_slot(module):
    """Causal XL memory: the allowed distances lie in 0..S-1, so the table is arange(S) (no
    torch.unique, whatever the positions' magnitude), built once and shared by every layer."""
    q = torch.randn(B, 4, T, 8, dtype=torch.float64)
    module.masked_score_bias(q, XL)
    tables = [v for v in XL._derived.values() if isinstance(v, tuple)]
    assert len(tables) == 1 and tables[0][0].shape[0] == M + T
