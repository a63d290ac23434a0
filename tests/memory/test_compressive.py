"""Compressive Transformer memory (memory kind ``compressive``)."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone
from rl_tformers.memory.compressive import Compressor, group_bookkeeping
from rl_tformers.types import sum_aux

D = 16


def _bb(compression="conv", loss="attention", mem_len=4, compressed_len=5, rate=2, **kw):
    cfg = {
        "d_model": D, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
        "memory": {
            "kind": "compressive", "mem_len": mem_len, "compressed_len": compressed_len, "rate": rate,
            "compression": compression, "loss": loss,
        },
    }
    cfg.update(kw)
    return Backbone(cfg).eval()


@pytest.mark.parametrize("seg_len", [1, 3, 4])
def test_compressed_length_after_n_segments(seg_len):
    m_m, m_cm, c = 4, 5, 2
    bb = _bb(mem_len=m_m, compressed_len=m_cm, rate=c)
    st = bb.initial_state(2)
    for n in range(1, 13):
        st = bb(torch.randn(2, seg_len, D), state=st).state
        seen = n * seg_len
        made = max(0, seen - m_m) // c  # groups of c evicted so far
        assert bb.memory.compressed_count(st).tolist() == [min(m_cm, made)] * 2
        assert bb.memory.fifo_count(st).tolist() == [seen - c * made] * 2
        assert m_m <= st.pos.shape[1] - m_cm <= m_m + c - 1 or seen < m_m
        assert all(ls.memory.shape[1] == st.pos.shape[1] for ls in st.layers)


def test_groups_do_not_depend_on_segment_lengths():
    """The same stream in steps of 1 or segments of 3 compresses the same groups (positions)."""
    bb = _bb(mem_len=4, compressed_len=5, rate=2)
    x = torch.randn(1, 15, D)
    a = bb.initial_state(1)
    for t in range(15):
        a = bb(x[:, t : t + 1], state=a).state
    b = bb.initial_state(1)
    for t in range(0, 15, 3):
        b = bb(x[:, t : t + 3], state=b).state
    assert torch.equal(a.pos, b.pos) and torch.equal(a.valid, b.valid)
    # compressed slot positions: the newest member of each group (1, 3, 5, 7, 9)
    assert a.pos[0, :5].tolist() == [1, 3, 5, 7, 9]


def test_temporal_range_metric():
    bb = _bb(mem_len=4, compressed_len=5, rate=2)
    out = bb(torch.randn(1, 3, D), state=bb.initial_state(1))
    assert out.metrics["memory/temporal_range"] == (4 + 2 * 5) * 2
    assert bb.memory.temporal_range == 28


@pytest.mark.parametrize("compression", ["conv", "dilated_conv"])
@pytest.mark.parametrize("loss", ["attention", "autoencoding", "both"])
def test_aux_losses_finite_and_reach_only_the_compressor(compression, loss):
    bb = _bb(compression, loss)
    st = bb.initial_state(2)
    st = bb(torch.randn(2, 4, D), state=st).state  # fill the FIFO
    out = bb(torch.randn(2, 4, D), state=st)  # evicts 4 -> 2 compressed slots per layer
    keys = {"attention": ["compressive/attention_reconstruction"], "autoencoding": ["compressive/autoencoding"]}
    keys["both"] = keys["attention"] + keys["autoencoding"]
    assert sorted(out.aux) == sorted(keys[loss])
    total = sum_aux(out.aux)
    assert torch.isfinite(total) and total > 0
    names, params = zip(*bb.named_parameters())
    grads = torch.autograd.grad(total, params, allow_unused=True)
    reached = {n for n, g in zip(names, grads) if g is not None and g.abs().sum() > 0}
    assert reached, "the losses must train something"
    assert all(n.startswith("memory.compressors.") for n in reached), sorted(reached)
    assert any(n.startswith("memory.compressors.0.") for n in reached) and any(n.startswith("memory.compressors.1.") for n in reached)
    # stored memories carry no graph: the main loss never reaches the compressor
    assert all(not ls.memory.requires_grad for ls in out.state.layers)


@pytest.mark.parametrize("compression", ["conv", "dilated_conv"])
def test_losses_decrease_when_trained_alone(compression):
    torch.manual_seed(0)
    bb = _bb(compression, "both", rate=3, mem_len=3)
    for n, p in bb.named_parameters():
        p.requires_grad_(n.startswith("memory.compressors."))
    opt = torch.optim.Adam([p for p in bb.parameters() if p.requires_grad], lr=2e-2)
    with torch.no_grad():
        st = bb(torch.randn(4, 6, D), state=bb.initial_state(4)).state  # FIFO holds 6 activations
    x = torch.randn(4, 6, D)  # the next segment evicts 9 -> 3 compressed slots per row and layer

    def loss():
        return sum_aux(bb(x, state=st).aux)

    first = float(loss().detach())
    for _ in range(20):
        opt.zero_grad()
        loss().backward()
        opt.step()
    last = float(loss().detach())
    assert last < 0.5 * first, (first, last)


def test_pooling_kinds_have_no_aux_but_report_metrics():
    bb = _bb("max", "both")
    st = bb(torch.randn(2, 4, D), state=bb.initial_state(2)).state
    out = bb(torch.randn(2, 4, D), state=st)
    assert out.aux == {}
    assert "memory/attention_reconstruction" in out.metrics and "memory/autoencoding" in out.metrics
    assert not list(bb.memory.parameters())


def test_compressor_functions_exact():
    x = torch.randn(2, 3, 4, D)  # B=2, G=3 groups of c=4
    inc = torch.ones(2, 3, 4, dtype=torch.bool)
    inc[0, 1, :2] = False  # two members excluded
    inc[1, 2] = False  # empty group
    mx = Compressor("max", D, 4, False)(x, inc)
    mean = Compressor("mean", D, 4, False)(x, inc)
    torch.testing.assert_close(mx[0, 0], x[0, 0].amax(0))
    torch.testing.assert_close(mx[0, 1], x[0, 1, 2:].amax(0))
    torch.testing.assert_close(mean[0, 1], x[0, 1, 2:].mean(0))
    assert torch.count_nonzero(mx[1, 2]) == 0 and torch.count_nonzero(mean[1, 2]) == 0
    # conv and dilated conv start as mean pooling (dilated: receptive field 4 = c)
    conv = Compressor("conv", D, 4, False)(x, torch.ones_like(inc))
    dil = Compressor("dilated_conv", D, 4, False)(x, torch.ones_like(inc))
    torch.testing.assert_close(conv, x.mean(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(dil, x.mean(2), atol=1e-6, rtol=0)
    # excluded members never matter
    x2 = x.clone()
    x2[0, 1, :2] = 100.0
    for kind in ("max", "mean", "conv", "dilated_conv"):
        comp = Compressor(kind, D, 4, False)
        torch.testing.assert_close(comp(x, inc), comp(x2, inc))
    # most used: the member with the highest usage among the included ones
    usage = torch.rand(2, 3, 4)
    usage[0, 1, 0] = 10.0  # excluded, must be ignored
    mu = Compressor("most_used", D, 4, False)(x, inc, usage)
    pick = usage.masked_fill(~inc, -1).argmax(-1)
    torch.testing.assert_close(mu[0, 1], x[0, 1, pick[0, 1]])
    assert pick[0, 1] >= 2


def test_group_bookkeeping_never_mixes_episodes():
    pos = torch.arange(8)[None]  # one row, groups of 4: [0..3], [4..7]
    valid = torch.tensor([[False, True, True, True, True, True, False, False]])
    seg = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    gpos, gval, gseg, inc = group_bookkeeping(pos, valid, seg, 4)
    assert gpos.tolist() == [[3, 5]] and gval.tolist() == [[True, True]] and gseg.tolist() == [[1, 1]]
    assert inc.tolist() == [[[False, False, True, True], [True, True, False, False]]]
    _, gval, gseg, _ = group_bookkeeping(pos, torch.zeros_like(valid), seg, 4)
    assert gval.tolist() == [[False, False]] and gseg.tolist() == [[-1, -1]]


@pytest.mark.parametrize("need_weights", [True, False])
def test_most_used_keeps_one_member_of_each_group(need_weights):
    bb = _bb("most_used", mem_len=2, compressed_len=4, rate=2)
    st = bb.initial_state(1)
    inputs = []
    for _ in range(5):
        x = torch.randn(1, 2, D)
        out = bb(x, state=st, need_weights=need_weights, output_hidden_states=True)
        inputs.append(torch.cat([x] + [h for h in out.hidden_states[:-1]], 0))  # (layers, 2, D) layer inputs
        st = out.state
    stream = torch.cat(inputs, 1)  # (layers, 10, D): every layer's inputs in order
    n_valid = int(bb.memory.compressed_count(st)[0])
    assert n_valid == 4
    for layer, ls in enumerate(st.layers):
        for j in range(4):
            slot = ls.memory[0, j]
            group = stream[layer, 2 * j : 2 * j + 2]  # compressed slots 0..3 <- groups 0..3
            assert min((slot - g).abs().max().item() for g in group) < 1e-6


def test_reset_clears_only_that_row_and_usage():
    bb = _bb("most_used")
    st = bb.initial_state(3)
    for _ in range(4):
        st = bb(torch.randn(3, 3, D), state=st).state
    new = bb.reset_state(st, torch.tensor([False, True, False]))
    assert bb.memory.compressed_count(new).tolist()[1] == 0 and bb.memory.fifo_count(new).tolist()[1] == 0
    assert bb.memory.compressed_count(new).tolist()[0] == bb.memory.compressed_count(st).tolist()[0] > 0
    for ls in new.layers:
        assert torch.count_nonzero(ls.memory[1]) == 0 and torch.count_nonzero(ls.extra.usage[1]) == 0
    # a reset row behaves like a fresh stream
    x = torch.randn(3, 3, D)
    torch.testing.assert_close(bb(x, state=new).hidden[1:2], bb(x[1:2], state=bb.initial_state(1)).hidden, atol=1e-6, rtol=0)


def test_compressed_memory_is_attended():
    """Outputs depend on the compressed slots (not only on the FIFO)."""
    bb = _bb("mean", mem_len=2, compressed_len=4, rate=2)
    st = bb.initial_state(1)
    for _ in range(3):
        st = bb(torch.randn(1, 2, D), state=st).state
    x = torch.randn(1, 2, D)
    base = bb(x, state=st).hidden
    st2 = bb.reset_state(st, torch.tensor([False]))
    for ls in st2.layers:
        ls.memory = ls.memory.clone()
        ls.memory[:, :4] += 3.0 * torch.randn(1, 4, D)  # perturb only the compressed part (not a shift: LN removes those)
    assert (bb(x, state=st2).hidden - base).abs().max() > 1e-3


def test_invalid_configs_are_refused():
    for bad in ({"rate": 0}, {"compression": "zip"}, {"loss": "l1"}, {"mem_len": 0}):
        with pytest.raises(Exception, match="memory"):
            _bb(**{**{"compression": "conv", "loss": "attention"}, **bad})


@pytest.mark.parametrize("compression", ["max", "mean", "conv", "dilated_conv", "most_used"])
@pytest.mark.parametrize(("seg_len", "reset_after"), [(1, 7), (1, 8), (3, 3), (2, 5)])
def test_a_row_reset_mid_stream_equals_a_fresh_stream(compression, seg_len, reset_after):
    """Vector evaluation: row 1 starts a new episode while rows 0 and 2 go on. Its outputs and
    its compressed slots must be those of a fresh stream of the same episode, whatever the other
    rows' FIFO fill (before, a row reset at FIFO length F grouped its first c - F mod c steps
    with cleared slots: different groups, different outputs)."""
    torch.manual_seed(0)
    m_m, m_cm, c = 4, 3, 3
    bb = _bb(compression, mem_len=m_m, compressed_len=m_cm, rate=c)
    st = bb.initial_state(3)
    for _ in range(reset_after):  # the other rows' FIFO is part-filled and not group-aligned
        st = bb(torch.randn(3, seg_len, D), state=st).state
    st = bb.reset_state(st, torch.tensor([False, True, False]))
    fresh = bb.initial_state(1)
    made = 0
    for _ in range(20 // seg_len):  # 20 steps: the compressed memory fills and rolls over
        x = torch.randn(3, seg_len, D)
        out, ref = bb(x, state=st), bb(x[1:2], state=fresh)
        torch.testing.assert_close(out.hidden[1:2], ref.hidden, atol=1e-5, rtol=0)
        st, fresh = out.state, ref.state
        assert bb.memory.compressed_count(st)[1] == bb.memory.compressed_count(fresh)[0]
        assert bb.memory.fifo_count(st)[1] == bb.memory.fifo_count(fresh)[0]
        made = int(bb.memory.compressed_count(fresh)[0])
    assert made == m_cm
    cval = st.valid[1, :m_cm]
    assert torch.equal(st.pos[1, :m_cm][cval], fresh.pos[0, :m_cm][fresh.valid[0, :m_cm]])


def test_a_reset_row_keeps_no_slot_of_its_old_episode():
    """After the reset row's first new segment, its FIFO holds only the new episode's slots."""
    bb = _bb("mean", mem_len=4, compressed_len=3, rate=3)
    st = bb.initial_state(2)
    for _ in range(5):
        st = bb(torch.randn(2, 1, D), state=st).state
    st = bb.reset_state(st, torch.tensor([True, False]))
    st = bb(torch.randn(2, 1, D), state=st).state
    fifo_seg, fifo_valid = st.seg[0, 3:], st.valid[0, 3:]
    assert fifo_valid.sum() == 1 and fifo_seg[fifo_valid].tolist() == [1]
    assert (fifo_seg[~fifo_valid] == -1).all()


def test_an_episode_boundary_inside_a_segment_compresses_the_earlier_episode():
    """Training rows cross episode boundaries. The earlier episode's slots leave the row's FIFO at
    the boundary and are compressed like any evicted memory (the compressor trains on them; they
    are masked from attention by their episode id), grouped backwards from the boundary; the new
    episode's groups start at its first step."""
    bb = _bb("mean", mem_len=4, compressed_len=6, rate=2).train()
    x = torch.randn(1, 11, D)
    start = torch.zeros(1, 11, dtype=torch.bool)
    start[0, 5] = True  # steps 0-4: episode 0, steps 5-10: episode 1
    out = bb(x, state=bb.initial_state(1), episode_start=start)
    st = out.state
    cval, cseg, cpos = st.valid[0, :6], st.seg[0, :6], st.pos[0, :6]
    # episode 0 (5 slots) -> groups [-1, 0] (one member), [1, 2], [3, 4] aligned to end at the boundary;
    # episode 1 (6 slots, 4 kept) -> one group [5, 6]; the FIFO keeps steps 7-10
    assert cval.tolist() == [False, False, True, True, True, True]
    assert cseg[cval].tolist() == [0, 0, 0, 1] and cpos[cval].tolist() == [0, 2, 4, 6]
    assert st.pos[0, 6:][st.valid[0, 6:]].tolist() == [7, 8, 9, 10]
    assert "compressive/attention_reconstruction" not in out.aux  # mean pooling: nothing to train
    assert out.metrics["memory/attention_reconstruction"] > 0  # ... but the groups were scored


# ------------------------------------------------------- dilated-convolution compressor at init
@pytest.mark.parametrize("rate", [1, 2, 3, 4, 5, 6, 8])
def test_dilated_conv_compressor_starts_as_mean_pooling_for_every_rate(rate):
    """Rae et al. 2019, sec. 3.1 (f_c = dilated convolution) and the module's own contract
    ("initialised to averaging", like ``conv``). Every kernel-2 layer started at taps (1/2, 1/2),
    so the readout was sum(members) / 2^L with 2^L = the receptive field: the mean only when
    c = 2^L. With the default rate 3 each compressed slot was 3/4 of the mean, with rate 1 half
    the activation. Taps c^(-1/L) make the L-layer stack read exactly the mean of the c members."""
    torch.manual_seed(0)
    d = 8
    x = torch.randn(2, 3, rate, d)  # (B, G, c, D)
    comp = Compressor("dilated_conv", d, rate, False)
    out = comp(x, torch.ones(2, 3, rate, dtype=torch.bool))
    torch.testing.assert_close(out, x.mean(2), atol=1e-6, rtol=0)  # float32 taps: rounding only


def test_dilated_conv_compressor_with_excluded_members_matches_conv():
    """Excluded members are zeroed before both learned compressors: at init both give
    sum(included) / c (the same value; the pooling kinds divide by the number included)."""
    torch.manual_seed(1)
    d, rate = 8, 3
    x = torch.randn(1, 2, rate, d)
    inc = torch.tensor([[[True, True, True], [False, True, True]]])
    conv = Compressor("conv", d, rate, False)(x, inc)
    dil = Compressor("dilated_conv", d, rate, False)(x, inc)
    torch.testing.assert_close(dil, conv, atol=1e-6, rtol=0)
    torch.testing.assert_close(dil[0, 1], x[0, 1, 1:].sum(0) / rate, atol=1e-6, rtol=0)
