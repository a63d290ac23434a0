"""Transformer-XL memory (memory kind ``xl``): chunking parity, episode isolation, stop-gradient."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone

D = 32


def _bb(position: str = "none", block: str = "pre_norm", **mem):
    cfg = {
        "d_model": D, "n_layers": 2, "n_heads": 4, "dropout": 0.0, "attn_dropout": 0.0,
        "position": {"kind": position}, "block": {"kind": block},
        "memory": {"kind": "xl", "mem_len": 8, **mem},
    }
    return Backbone(cfg).eval()


@pytest.mark.parametrize("position", ["none", "rotary", "xl_relative", "alibi"])
@pytest.mark.parametrize("block", ["pre_norm", "post_norm"])
def test_sixteen_tokens_equal_two_segments_of_eight(position, block):
    bb = _bb(position, block)
    x = torch.randn(3, 16, D)
    full = bb(x).hidden  # one pass, no state: positions 0..15
    o1 = bb(x[:, :8], state=bb.initial_state(3))
    o2 = bb(x[:, 8:], state=o1.state)
    torch.testing.assert_close(torch.cat([o1.hidden, o2.hidden], 1), full, atol=1e-5, rtol=0)
    # the memory is used: the second segment alone is different
    assert (o2.hidden - bb(x[:, 8:], positions=torch.arange(8, 16).expand(3, 8)).hidden).abs().max() > 1e-3


def test_previous_episode_cannot_change_outputs_after_reset_bit_for_bit():
    bb = _bb("rotary")
    x_old, x_old2, x_new = torch.randn(2, 12, D), torch.randn(2, 12, D) * 5, torch.randn(2, 6, D)
    outs = []
    for old in (x_old, x_old2):
        st = bb.initial_state(2)
        st = bb(old[:, :6], state=st).state
        st = bb(old[:, 6:], state=st).state
        st = bb.reset_state(st, torch.tensor([True, True]))
        outs.append(bb(x_new, state=st).hidden)
    assert torch.equal(outs[0], outs[1])


def test_episode_start_inside_a_segment_isolates_bit_for_bit():
    """A new episode starting mid-segment never reads the tokens (or memory) before it."""
    bb = _bb("rotary")
    start = torch.zeros(2, 10, dtype=torch.bool)
    start[:, 4] = True
    outs = []
    for scale in (1.0, 7.0):
        torch.manual_seed(3)
        prev = torch.randn(2, 8, D) * scale
        x = torch.randn(2, 10, D)
        x[:, :4] = torch.randn(2, 4, D) * scale  # previous-episode tokens of this segment
        st = bb(prev, state=bb.initial_state(2)).state
        torch.manual_seed(4)
        x[:, 4:] = torch.randn(2, 6, D)
        outs.append(bb(x, state=st, episode_start=start).hidden[:, 4:])
    assert torch.equal(outs[0], outs[1])


def test_no_gradient_reaches_detached_memory():
    bb = _bb()
    x1 = torch.randn(2, 8, D, requires_grad=True)
    x2 = torch.randn(2, 8, D, requires_grad=True)
    o1 = bb(x1, state=bb.initial_state(2))
    assert all(not ls.memory.requires_grad for ls in o1.state.layers)
    bb(x2, state=o1.state).hidden.sum().backward()
    assert x1.grad is None
    assert x2.grad is not None and x2.grad.abs().sum() > 0


def test_without_detach_gradient_flows_into_memory():
    bb = _bb(detach=False)
    x1 = torch.randn(2, 8, D, requires_grad=True)
    o1 = bb(x1, state=bb.initial_state(2))
    bb(torch.randn(2, 8, D), state=o1.state).hidden.sum().backward()
    assert x1.grad is not None and x1.grad.abs().sum() > 0


def test_done_resets_only_that_row():
    bb = _bb()
    st = bb(torch.randn(3, 8, D), state=bb.initial_state(3)).state
    st = bb(torch.randn(3, 5, D), state=st).state
    new = bb.reset_state(st, torch.tensor([False, True, False]))
    for a, b in zip(st.layers, new.layers):
        assert torch.equal(a.memory[[0, 2]], b.memory[[0, 2]])
        assert torch.count_nonzero(b.memory[1]) == 0
    assert torch.equal(new.valid[[0, 2]], st.valid[[0, 2]]) and st.valid[[0, 2]].all()
    assert not new.valid[1].any()
    assert new.episode.tolist() == [st.episode[0].item(), st.episode[1].item() + 1, st.episode[2].item()]
    assert new.next_pos.tolist() == [13, 0, 13]
    # after the reset, row 1 behaves like a fresh stream; rows 0 and 2 continue theirs
    x = torch.randn(3, 4, D)
    out = bb(x, state=new).hidden
    fresh = bb(x[1:2], state=bb.initial_state(1)).hidden
    torch.testing.assert_close(out[1:2], fresh, atol=1e-6, rtol=0)
    cont = bb(x, state=st).hidden
    torch.testing.assert_close(out[[0, 2]], cont[[0, 2]], atol=1e-6, rtol=0)


def test_memory_keeps_the_last_mem_len_inputs():
    bb = _bb()
    st = bb.initial_state(1)
    xs = torch.randn(1, 11, D)
    out = bb(xs[:, :5], state=st, output_hidden_states=True)
    out2 = bb(xs[:, 5:], state=out.state, output_hidden_states=True)
    # layer 0's memory holds the last 8 inputs of the stream; positions follow
    torch.testing.assert_close(out2.state.layers[0].memory, xs[:, 3:], atol=0, rtol=0)
    assert out2.state.pos.tolist() == [list(range(3, 11))]
    torch.testing.assert_close(out2.state.layers[1].memory[:, -6:], out2.hidden_states[0], atol=0, rtol=0)
