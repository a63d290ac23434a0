"""Regressions found by backbone breaker 11 (public ``Backbone`` API, every registered kind)."""

from __future__ import annotations

import warnings

import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.types import BackboneState

D = 16


def _compressive_linear(attention: str, causal: bool = True) -> Backbone:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Backbone({
            "d_model": D, "n_heads": 2, "n_layers": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": causal,
            "attention": {"kind": attention},
            "memory": {"kind": "compressive", "mem_len": 4, "compressed_len": 4, "rate": 2},
        }).eval()


def _with_seg(state: BackboneState, seg: torch.Tensor) -> BackboneState:
    return BackboneState(layers=state.layers, pos=state.pos, valid=state.valid, seg=seg,
                         episode=state.episode, next_pos=state.next_pos)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("attention", ["performer", "rfa"])
def test_linear_kernels_read_a_compressive_memory_whose_unfilled_slots_have_no_episode(attention, causal):
    """The compressive memory keeps ``[compressed; FIFO]`` with unfilled FIFO slots (episode id
    -1) after filled compressed ones. Linear attention took every change of episode id along the
    keys for an episode boundary and refused ids that decrease, so a second or third segment
    raised "episode ids ... must be non-decreasing" (GTrXL with ``performer`` + ``compressive``
    could not run). Invalid slots must not count: the ids they carry change nothing."""
    bb = _compressive_linear(attention, causal)
    torch.manual_seed(1)
    x = torch.randn(2, 12, D)
    with torch.no_grad():
        st = bb.initial_state(2)
        for s in range(0, 12, 3):
            st = bb(x[:, s : s + 3], state=st).state
        assert bool((st.seg[:, 1:] < st.seg[:, :-1]).any())  # the layout that used to be refused
        y = torch.randn(2, 3, D)
        out = bb(y, state=st).hidden
        # the same state with its invalid slots given other ids (none decreasing, or all 99)
        filled = st.seg.masked_fill(~st.valid, -5).cummax(1).values
        for seg in (torch.where(st.valid, st.seg, filled), torch.where(st.valid, st.seg, 99)):
            assert torch.equal(bb(y, state=_with_seg(st, seg)).hidden, out)


@pytest.mark.parametrize("attention", ["performer", "rfa"])
def test_linear_kernels_with_compressive_memory_reset_a_row_to_a_fresh_stream(attention):
    """Resets and episode starts with a compressive memory: the reset row equals a fresh stream,
    the other row is untouched by the reset."""
    bb = _compressive_linear(attention)
    torch.manual_seed(2)
    x = torch.randn(2, 15, D)
    es = torch.zeros(2, 15, dtype=torch.bool)
    es[0, 4] = True
    with torch.no_grad():
        st = bb.initial_state(2)
        for s in range(0, 9, 3):
            st = bb(x[:, s : s + 3], episode_start=es[:, s : s + 3], state=st).state
        a, c = bb.reset_state(st, torch.tensor([False, True])), st
        fresh = bb.initial_state(1)
        for s in range(9, 15, 3):
            oa = bb(x[:, s : s + 3], state=a)
            oc = bb(x[:, s : s + 3], state=c)
            of = bb(x[1:, s : s + 3], state=fresh)
            torch.testing.assert_close(oa.hidden[1], of.hidden[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(oa.hidden[0], oc.hidden[0], atol=1e-5, rtol=0)
            a, c, fresh = oa.state, oc.state, of.state


@pytest.mark.parametrize("fields", [{"kind": "performer"}, {"kind": "rfa"}, {"kind": "rfa", "gate": True}])
def test_linear_kernels_of_a_float64_model_keep_float64_precision(fields):
    """Performer and RFA computed their features, sums and incremental state in float32 whatever
    the model's dtype: a float64 model got float32 results (chunked pass vs one chunk and
    step-by-step decoding vs the full pass differed by ~1e-7) and a float32 cache. They now
    accumulate in at least float32 (bf16 and fp16 still accumulate in float32)."""
    def build(chunk: int) -> Backbone:
        torch.manual_seed(0)
        return Backbone({"d_model": D, "n_heads": 2, "n_layers": 1, "dropout": 0.0, "attn_dropout": 0.0,
                         "attention": {**fields, "chunk_size": chunk}}).double().eval()

    bb, one_chunk = build(4), build(64)
    torch.manual_seed(1)
    x = torch.randn(2, 10, D, dtype=torch.float64)
    with torch.no_grad():
        full = bb(x).hidden
        torch.testing.assert_close(one_chunk(x).hidden, full, atol=1e-12, rtol=0)
        st = bb.initial_state(2)
        assert st.layers[0].cache.state.dtype == torch.float64
        steps = []
        for s in range(10):
            o = bb(x[:, s : s + 1], state=st)
            st = o.state
            steps.append(o.hidden)
        assert st.layers[0].cache.state.dtype == torch.float64
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
    # a bf16 model keeps its float32 accumulators
    torch.manual_seed(0)
    bf = Backbone({"d_model": D, "n_heads": 2, "n_layers": 1, "attention": fields}).to(torch.bfloat16)
    assert bf.initial_state(2).layers[0].cache.state.dtype == torch.float32
