"""Smoke checks of the backbone core that the contract suite generalises."""

import torch

from rl_tformers import Backbone


def _bb(**kw):
    cfg = {"d_model": 32, "n_layers": 2, "n_heads": 4, "dropout": 0.0, "attn_dropout": 0.0}
    cfg.update(kw)
    return Backbone(cfg).eval()


def test_incremental_equals_full_pass():
    bb = _bb(position={"kind": "learned"})
    x = torch.randn(3, 10, 32)
    full = bb(x).hidden
    st = bb.initial_state(3)
    outs = []
    for t in range(10):
        o = bb(x[:, t : t + 1], state=st)
        st = o.state
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


def test_xl_two_segments_equal_one_pass_and_reset_isolates_rows():
    bb = _bb(memory={"kind": "xl", "mem_len": 8})
    x = torch.randn(3, 16, 32)
    full = bb(x).hidden
    o1 = bb(x[:, :8], state=bb.initial_state(3))
    o2 = bb(x[:, 8:], state=o1.state)
    torch.testing.assert_close(torch.cat([o1.hidden, o2.hidden], 1), full, atol=1e-5, rtol=0)
    # memory matters: without it the second segment differs
    assert (o2.hidden - bb(x[:, 8:]).hidden).abs().max() > 1e-2
    reset = bb.reset_state(o1.state, torch.tensor([False, True, False]))
    o3 = bb(x[:, 8:], state=reset)
    torch.testing.assert_close(o3.hidden[[0, 2]], full[[0, 2], 8:], atol=1e-5, rtol=0)
    torch.testing.assert_close(o3.hidden[1], bb(x[1:2, 8:]).hidden[0], atol=1e-5, rtol=0)
