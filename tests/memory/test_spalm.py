"""Memory kind ``spalm`` (Yogatama et al. 2021): the gate against the paper's equations on a
hand-computed example, the store's retrieval against brute force, per-row resets, and a
segmented forward against the equations written out token by token."""

from __future__ import annotations

import math

import pytest
import torch
from rl_tformers.agents.common.knn_memory import Neighbours, SpalmGate
from torch import nn

from rl_tformers import Backbone
from rl_tformers.memory.spalm import SpalmMemory, SpalmMemoryConfig, SpalmStore, spalm_combine
from rl_tformers.registry import MEMORY

D = 8


def _gate(w: list[float], b: float) -> nn.Linear:
    g = nn.Linear(len(w), 1).double()
    with torch.no_grad():
        g.weight.copy_(torch.tensor([w], dtype=torch.float64))
        g.bias.fill_(b)
    return g


def test_gate_and_read_equal_the_paper_s_equations_on_a_hand_computed_example():
    # h = (1, 0); neighbours y1 = (1, 0), y2 = (0, 2); a third slot is not a neighbour (garbage)
    h = torch.tensor([1.0, 0.0], dtype=torch.float64)
    y = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1e6, -1e6]], dtype=torch.float64)
    ok = torch.tensor([True, True, False])
    z, g = spalm_combine(h, y, ok, _gate([0.5, -1.0], 0.25))
    # (1) y.h = (1, 0): softmax = (e, 1) / (e + 1); m = (e / (e + 1), 2 / (e + 1))
    e = math.e
    m = (e / (e + 1), 2 / (e + 1))
    # (2) g = sigmoid(0.5 * 1 - 1 * 0 + 0.25) = sigmoid(0.75)
    gv = 1 / (1 + math.exp(-0.75))
    # (3) z = (1 - g) m + g h
    want = torch.tensor([(1 - gv) * m[0] + gv * 1.0, (1 - gv) * m[1]], dtype=torch.float64)
    assert g.item() == pytest.approx(gv, abs=1e-15)
    torch.testing.assert_close(z, want, atol=1e-15, rtol=0)
    # no neighbour: g = 1 and z = h
    z0, g0 = spalm_combine(h, y, torch.zeros(3, dtype=torch.bool), _gate([0.5, -1.0], 0.25))
    assert g0.item() == 1.0 and torch.equal(z0, h)


def test_the_policy_level_spalm_gate_is_the_same_combination():
    """``SpalmGate`` (actions embedded as values) computes ``spalm_combine`` on its embeddings."""
    torch.manual_seed(0)
    gate = SpalmGate(D, n_actions=5).double()
    with torch.no_grad():
        gate.gate.weight.normal_()
    h = torch.randn(3, D, dtype=torch.float64)
    acts = torch.tensor([[0, 4, 2], [1, 1, 3], [2, 0, 0]])
    valid = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    nb = Neighbours(dist=torch.zeros(3, 3), index=torch.zeros(3, 3, dtype=torch.long), actions=acts, valid=valid)
    z, g = gate(h, nb)
    z_ref, g_ref = spalm_combine(h, gate.embed(acts), valid, gate.gate)
    torch.testing.assert_close(z, z_ref, atol=1e-15, rtol=0)
    torch.testing.assert_close(g, g_ref, atol=1e-15, rtol=0)


def _store(b: int, n: int, seed: int = 0) -> SpalmStore:
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(b, n, generator=g) > 0.2
    seg = torch.randint(0, 2, (b, n), generator=g)
    return SpalmStore(keys=torch.randn(b, n, D, generator=g, dtype=torch.float64),
                      inputs=torch.randn(b, n, D, generator=g, dtype=torch.float64),
                      pos=torch.arange(n).repeat(b, 1), valid=valid, seg=seg)


def test_retrieval_equals_brute_force_top_k_over_the_allowed_pairs():
    mem = SpalmMemory(mem_len=2, store_len=9, knn_k=3, min_age=2, d_model=D, gate_init=0.0).double()
    b, n, t = 3, 12, 4
    st = _store(b, n + t)  # records: N stored then the T of the segment
    seg_q = st.seg[:, n:]
    allowed = mem.allowed(st.valid, st.seg, seg_q, n)
    h = torch.randn(b, t, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    idx, ok, y = mem.retrieve(h, st.keys[:, :-1], st.inputs[:, 1:], allowed)
    for r in range(b):
        for i in range(t):
            cands = [c for c in range(n + t - 1)
                     if st.valid[r, c] and st.valid[r, c + 1] and st.seg[r, c] == st.seg[r, c + 1] == seg_q[r, i]
                     and 2 <= n + i - c <= 9]
            assert [c for c in range(n + t - 1) if allowed[r, i, c]] == cands
            d2 = sorted((float(((h[r, i] - st.keys[r, c]) ** 2).sum()), c) for c in cands)
            want = [c for _, c in d2[:3]]
            got = [int(c) for c, o in zip(idx[r, i], ok[r, i]) if o]
            assert got == want
            for j, c in enumerate(want):
                assert torch.equal(y[r, i, j], st.inputs[r, c + 1])


def _backbone(**mem) -> Backbone:
    cfg = {"d_model": D, "n_layers": 2, "n_heads": 2, "d_ff": 16, "dropout": 0.0, "attn_dropout": 0.0,
           "attention": {"kind": "sdpa"}, "position": {"kind": "xl_relative"},
           "block": {"kind": "gated", "gate": "gru", "gate_bias": 2.0}, "final_norm": True,
           "memory": {"kind": "spalm", "mem_len": 3, "store_len": 6, "knn_k": 2, **mem}}
    torch.manual_seed(0)
    bb = Backbone(cfg).eval().double()
    with torch.no_grad():
        bb.memory.gate.weight.normal_()
    return bb


def test_episode_start_resets_only_that_environment_s_store():
    bb = _backbone()
    x = torch.randn(3, 5, D, dtype=torch.float64)
    with torch.no_grad():
        st = bb(x, state=bb.initial_state(3)).state
    before = bb.memory.store(st)
    after = bb.memory.store(bb.reset_state(st, torch.tensor([False, True, False])))
    for r in (0, 2):
        for f in ("keys", "inputs", "pos", "valid", "seg"):
            assert torch.equal(getattr(after, f)[r], getattr(before, f)[r])
    assert before.valid[1, -5:].all() and not after.valid[1].any()
    assert (after.seg[1] == -1).all() and not after.keys[1].any() and not after.inputs[1].any()


def _reference(bb: Backbone, h: torch.Tensor, x: torch.Tensor, ep: torch.Tensor) -> torch.Tensor:
    """SPALM's read written out per token (one row): eq. (1)-(3) over the keys of its episode
    aged min_age..store_len tokens, values the next token's input, K nearest by squared L2."""
    mem, t = bb.memory, h.shape[0]
    out = []
    for i in range(t):
        cands = [j for j in range(i) if ep[j] == ep[j + 1] == ep[i] and mem.min_age <= i - j <= mem.store_len]
        near = sorted(cands, key=lambda j: float(((h[i] - h[j]) ** 2).sum()))[: mem.knn_k]
        if not near:
            out.append(h[i])
            continue
        ys = torch.stack([x[j + 1] for j in near])
        a = torch.softmax(ys @ h[i], 0)
        m = (a[:, None] * ys).sum(0)
        g = torch.sigmoid(mem.gate.weight[0] @ h[i] + mem.gate.bias[0])
        out.append((1 - g) * m + g * h[i])
    return torch.stack(out)


def test_segment_by_segment_forward_equals_the_equations():
    """Three segments (5, 1, 6 tokens) of two rows, row 1 starting a new episode at token 7:
    every output equals eq. (1)-(3) applied to the backbone's own pre-read output, with keys
    from the earlier segments (carried in the store) and the segment's earlier tokens."""
    bb = _backbone(min_age=2)
    t = 12
    x = torch.randn(2, t, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    starts = torch.zeros(2, t, dtype=torch.bool)
    starts[1, 7] = True
    st, outs, pre, i = bb.initial_state(2), [], [], 0
    with torch.no_grad():
        for c in (5, 1, 6):
            o = bb(x[:, i:i + c], state=st, episode_start=starts[:, i:i + c], output_hidden_states=True)
            pre.append(bb.final_norm(o.hidden_states[-1]))
            outs.append(o.hidden)
            st, i = o.state, i + c
        hit = o.metrics["memory/spalm_hit_rate"]
        h = torch.cat(pre, 1)
        ep = starts.long().cumsum(1)
        for r in range(2):
            torch.testing.assert_close(torch.cat(outs, 1)[r], _reference(bb, h[r], x[r], ep[r]), atol=1e-12, rtol=0)
    assert 0 < hit <= 1


@pytest.mark.parametrize("split", [[1] * 10, [4, 6], [3, 3, 4]])
def test_any_split_equals_one_pass_when_xl_memory_covers_the_segment(split):
    bb = _backbone(mem_len=10, store_len=8, min_age=1)
    x = torch.randn(2, 10, D, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = bb(x).hidden
        st, outs, i = bb.initial_state(2), [], 0
        for c in split:
            o = bb(x[:, i:i + c], state=st)
            st, i = o.state, i + c
            outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=0)


def test_registered_with_its_config_and_capabilities():
    entry = MEMORY.get("spalm")
    assert entry.config_cls is SpalmMemoryConfig
    assert entry.capabilities.stateful and entry.capabilities.exact_chunking
    assert SpalmMemoryConfig(mem_len=4).age_min == 5 and SpalmMemoryConfig(mem_len=4, min_age=2).age_min == 2


@pytest.mark.parametrize(("fields", "message"), [
    ({"min_age": 0}, r"memory\.min_age must be >= 1"),
    ({"mem_len": 8, "store_len": 8}, r"memory\.store_len=8 < memory\.min_age=9 \(mem_len \+ 1\)"),
    ({"knn_k": 0}, r"memory\.store_len and memory\.knn_k must be >= 1"),
    ({"mem_len": -1}, r"memory\.mem_len must be >= 0"),
])
def test_config_refuses_fields_that_read_nothing(fields, message):
    with pytest.raises(ValueError, match=message):
        SpalmMemoryConfig(**fields)
