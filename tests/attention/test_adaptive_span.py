"""Dynamic adaptive span (rl_tformers.attention.adaptive_span)."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone

D = 16


def _dynamic_span_backbone() -> Backbone:
    torch.manual_seed(0)
    cfg = {"d_model": D, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
           "attention": {"kind": "adaptive_span", "max_span": 6, "ramp": 2, "init": 0.5, "dynamic": True},
           "position": {"kind": "alibi"}, "memory": {"kind": "none"}}
    return Backbone(cfg).eval().to(torch.float64)


@pytest.mark.parametrize("need_weights", [False, True])
def test_dynamic_adaptive_span_runs_an_empty_batch_with_and_without_a_state(need_weights):
    bb = _dynamic_span_backbone()
    with torch.no_grad():
        out = bb(torch.randn(0, 5, D, dtype=torch.float64), need_weights=need_weights)
        assert out.hidden.shape == (0, 5, D)
        # step-by-step decoding of B = 0 streams, past the span (the state is trimmed)
        st = bb.initial_state(0)
        for t in (3, 1, 4, 2):
            o = bb(torch.randn(0, t, D, dtype=torch.float64), state=st, need_weights=need_weights)
            assert o.hidden.shape == (0, t, D)
            st = o.state
        assert st.batch_size == 0 and st.key_offset == 10 - 5 and st.pos.shape == (0, 5)
        st = bb.reset_state(st, torch.zeros(0, dtype=torch.bool))
        assert bb(torch.randn(0, 1, D, dtype=torch.float64), state=st).hidden.shape == (0, 1, D)


def test_dynamic_adaptive_span_empty_batch_leaves_nonempty_batches_unchanged():
    """The empty-batch width does not touch a real batch: decoding still equals the full pass."""
    bb = _dynamic_span_backbone()
    x = torch.randn(2, 13, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = bb(x).hidden
        st = bb.initial_state(2)
        outs = []
        for t, e in ((0, 1), (1, 4), (4, 5), (5, 11), (11, 13)):
            o = bb(x[:, t:e], state=st)
            st = o.state
            outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=1e-10)
    assert st.pos.shape == (2, 5) and st.key_offset == 8
