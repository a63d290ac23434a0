"""Universal Transformer depth (``universal``): ACT halting, coordinate embedding, fixed steps."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone, IncompatibleConfig
from rl_tformers.depth.universal import ACTState, act_step, coordinate_embedding
from rl_tformers.position.absolute import sinusoid
from rl_tformers.types import AttnContext

D = 16


def _bb(**depth):
    cfg = {"d_model": D, "n_layers": 4, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "depth": {"kind": "universal", **depth}}
    return Backbone(cfg).eval()


def _ctx(b, t, valid=None):
    pos = torch.arange(t).expand(b, t)
    return AttnContext(pos_q=pos, pos_k=pos, key_valid=valid)


def test_act_step_weights_sum_to_one():
    torch.manual_seed(0)
    for max_steps in (1, 3, 8):
        p = torch.rand(max_steps, 5, 7) ** 3  # many small probabilities: some reach the limit
        st = ACTState.start(p[0], torch.ones(5, 7, dtype=torch.bool))
        ws = []
        for n in range(max_steps):
            w, st = act_step(p[n], st, 0.99, last=n == max_steps - 1)
            ws.append(w)
        w = torch.stack(ws)
        torch.testing.assert_close(w.sum(0), torch.ones(5, 7))
        assert not st.running.any()
        # N = index of the halting step; R = 1 - sum of earlier p; weights are p before it
        n_steps = st.n_updates.long()
        for i in range(5):
            for j in range(7):
                n = n_steps[i, j].item()
                torch.testing.assert_close(w[: n - 1, i, j], p[: n - 1, i, j])
                torch.testing.assert_close(st.remainders[i, j], 1 - p[: n - 1, i, j].sum())
                assert (w[n:, i, j] == 0).all()
                if n < max_steps:  # halted by the threshold, not the limit
                    assert p[:n, i, j].sum() >= 0.99 and p[: n - 1, i, j].sum() < 0.99


def test_halting_weights_per_position_sum_to_one():
    bb = _bb(max_steps=6)
    with torch.no_grad():
        bb.depth.halt.bias.fill_(-1.0)  # p ~ 0.27: a few steps each
        bb.depth.halt.weight.normal_(0, 1)
    res = bb.depth.run(torch.randn(3, 7, D), _ctx(3, 7))
    torch.testing.assert_close(res.weights.sum(-1), torch.ones(3, 7))
    assert res.steps > 1 and res.n_updates.min() >= 1 and res.n_updates.max() <= 6
    assert len(set(res.n_updates.flatten().tolist())) > 1, "positions should halt at different steps"
    # the output is the halting-weighted mean of the step states
    mix = sum(res.weights[..., n, None] * res.states[n] for n in range(res.steps))
    torch.testing.assert_close(res.hidden, mix, atol=1e-6, rtol=0)


def test_halting_at_step_one_equals_one_block_application():
    bb = _bb()
    with torch.no_grad():
        bb.depth.halt.weight.zero_()
        bb.depth.halt.bias.fill_(20.0)  # p = sigmoid(20) >= 1 - eps at step 1
    x = torch.randn(2, 5, D)
    out = bb(x)
    ctx = _ctx(2, 5)
    block = bb.depth.blocks[0]
    one = block(x + coordinate_embedding(ctx.pos_q, 1, D), ctx, None).hidden
    torch.testing.assert_close(out.hidden, bb.final_norm(one), atol=1e-6, rtol=0)
    assert out.metrics["act/ponder_steps"] == 1.0 and out.metrics["act/steps_run"] == 1.0
    torch.testing.assert_close(out.aux["ponder"], torch.tensor(0.01 * 2.0))  # tau (N + R) = 0.01 (1 + 1)


def test_without_coordinate_halting_at_step_one_is_the_plain_block():
    bb = _bb(coordinate=False)
    with torch.no_grad():
        bb.depth.halt.weight.zero_()
        bb.depth.halt.bias.fill_(20.0)
    x = torch.randn(2, 5, D)
    ctx = _ctx(2, 5)
    torch.testing.assert_close(bb.depth.run(x, ctx).hidden, bb.depth.blocks[0](x, ctx, None).hidden)


def test_ponder_cost_in_aux_and_steps_in_metrics():
    bb = _bb(ponder_weight=0.5, max_steps=5)
    x = torch.randn(2, 6, D)
    out = bb(x)
    res = bb.depth.run(x, _ctx(2, 6))
    torch.testing.assert_close(out.aux["ponder"], 0.5 * (res.n_updates + res.remainders).mean())
    torch.testing.assert_close(out.metrics["act/ponder_steps"], res.n_updates.mean())
    # the ponder cost trains the halting unit
    (g,) = torch.autograd.grad(out.aux["ponder"], bb.depth.halt.bias)
    assert g.abs() > 0


def test_fixed_steps_form_is_the_shared_block_applied_n_times():
    bb = _bb(act=False, max_steps=3)
    x = torch.randn(2, 5, D)
    ctx = _ctx(2, 5)
    h = x
    for n in range(1, 4):
        h = bb.depth.blocks[0](h + coordinate_embedding(ctx.pos_q, n, D), ctx, None).hidden
    out = bb(x)
    torch.testing.assert_close(out.hidden, bb.final_norm(h), atol=1e-6, rtol=0)
    assert "ponder" not in out.aux and out.metrics["act/ponder_steps"] == 3.0
    assert len(bb.depth.blocks) == 1 and bb.depth.halt is None


def test_coordinate_embedding_is_position_plus_step():
    pos = torch.tensor([[0, 3, 7]])
    e = coordinate_embedding(pos, 2, 8)
    torch.testing.assert_close(e, sinusoid(pos, 8) + sinusoid(torch.tensor([[2]]), 8))


def test_padded_positions_halt_at_once_and_change_nothing():
    bb = _bb(max_steps=6)
    with torch.no_grad():
        bb.depth.halt.bias.fill_(-2.0)
    x = torch.randn(2, 6, D)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    a = bb(x, mask=mask).hidden
    x2 = x.clone()
    x2[0, 4:] = 100 * torch.randn(2, D)
    b = bb(x2, mask=mask).hidden
    torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=0)
    res = bb.depth.run(x, _ctx(2, 6, mask))
    assert (res.n_updates[0, 4:] == 1).all()


def test_causal():
    bb = _bb(max_steps=4)
    with torch.no_grad():
        bb.depth.halt.bias.fill_(-1.0)
        bb.depth.halt.weight.normal_(0, 1)
    x = torch.randn(1, 6, D)
    base = bb(x).hidden
    x2 = x.clone()
    x2[:, 4:] = torch.randn(1, 2, D) * 5
    torch.testing.assert_close(bb(x2).hidden[:, :4], base[:, :4], atol=1e-6, rtol=0)


def test_refuses_memory_and_state():
    with pytest.raises(IncompatibleConfig, match="universal"):
        Backbone({"d_model": D, "n_heads": 2, "depth": {"kind": "universal"}, "memory": {"kind": "xl"}})
    bb = _bb()
    with pytest.raises(NotImplementedError, match="universal"):
        bb(torch.randn(1, 2, D), state=bb.initial_state(1))
    with pytest.raises(IncompatibleConfig, match="coordinate"):
        Backbone({"d_model": 15, "n_heads": 1, "depth": {"kind": "universal"}})
    with pytest.raises(Exception, match="max_steps"):
        _bb(max_steps=0)


# ---------------------------------------------------------- ACT bookkeeping in reduced precision
def test_act_halting_weights_sum_to_one_in_a_bfloat16_model():
    """Graves 2016, sec. 2 (eq. 5-7): the halting weights p_1..p_{N-1}, R sum to exactly 1 and
    N = min{n : sum p >= 1 - eps}. A bfloat16 model accumulated the halting sum in bfloat16:
    with p = sigmoid(-5) = 0.0067 (148 steps) the increments fell below bfloat16's spacing near
    1, so it halted at step 142 with weights summing to 0.96 (and N counted in bfloat16 stops at
    256). The bookkeeping must run in float32 (the float32 model's N and a sum of 1)."""
    d = 16
    cfg = {"d_model": d, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
           "depth": {"kind": "universal", "max_steps": 400, "epsilon": 0.01}}
    torch.manual_seed(0)
    bb = Backbone(cfg).eval()
    with torch.no_grad():
        bb.depth.halt.weight.zero_()
        bb.depth.halt.bias.fill_(-5.0)  # exactly representable: the same logit in both dtypes
    x = torch.randn(1, 3, d)
    pos = torch.arange(3)[None]
    p = torch.sigmoid(torch.tensor(-5.0))
    n_ref, total = 0, torch.tensor(0.0)
    while True:  # plain-loop ACT (Graves): the first n with sum_{n' <= n} p >= 1 - eps
        n_ref += 1
        if total + p >= 0.99:
            break
        total = total + p
    with torch.no_grad():
        r32 = bb.depth.run(x, AttnContext(pos_q=pos, pos_k=pos))
        r16 = bb.to(torch.bfloat16).depth.run(x.bfloat16(), AttnContext(pos_q=pos, pos_k=pos))
    assert n_ref == 148
    assert r32.n_updates.tolist() == [[148.0] * 3]
    assert r16.n_updates.float().tolist() == [[148.0] * 3]
    torch.testing.assert_close(r16.weights.float().sum(-1), torch.ones(1, 3), atol=1e-5, rtol=0)  # float32 sum of 148
    torch.testing.assert_close(r16.remainders.float(), 1 - total.expand(1, 3), atol=1e-5, rtol=0)
    assert r16.hidden.dtype == torch.bfloat16


def test_act_halting_with_many_steps_counts_beyond_bfloat16_integers():
    """N above 256 (bfloat16 represents integers exactly only up to 256)."""
    d = 16
    cfg = {"d_model": d, "n_layers": 1, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
           "depth": {"kind": "universal", "max_steps": 300, "epsilon": 0.01, "coordinate": False}}
    torch.manual_seed(0)
    bb = Backbone(cfg).eval()
    with torch.no_grad():
        bb.depth.halt.weight.zero_()
        bb.depth.halt.bias.fill_(-9.0)  # p = 1.2e-4: every position runs to max_steps
    pos = torch.arange(2)[None]
    with torch.no_grad():
        res = bb.to(torch.bfloat16).depth.run(torch.randn(1, 2, d).bfloat16(), AttnContext(pos_q=pos, pos_k=pos))
    assert res.steps == 300 and res.n_updates.float().tolist() == [[300.0, 300.0]]
    torch.testing.assert_close(res.weights.float().sum(-1), torch.ones(1, 2), atol=1e-5, rtol=0)


# -- separable-convolution transition (Dehghani et al. 2019, sec. 2.1; Chollet 2017) -------------
def _sepconv_reference(conv, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """A depthwise-separable convolution of one unpadded single-episode sequence, from its
    definition with torch's own convolution: per channel a width-w kernel (groups = channels),
    zero-padded on the left (causal) or both sides (centred), then the pointwise linear map."""
    w = conv.depthwise.shape[1]
    left = w - 1 if causal else w // 2
    z = torch.nn.functional.conv1d(torch.nn.functional.pad(x.transpose(1, 2), (left, w - 1 - left)),
                                   conv.depthwise[:, None, :], groups=x.shape[-1])  # (B, C, T)
    return conv.pointwise(z.transpose(1, 2))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("width", [1, 3, 4])
def test_sepconv_transition_equals_two_separable_convolutions(causal, width):
    bb = Backbone({"d_model": D, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": causal, "activation": "relu",
                   "depth": {"kind": "universal", "transition": "sepconv", "transition_kernel": width}}).double().eval()
    tr = bb.blocks[0].ffn
    x = torch.randn(2, 9, D, dtype=torch.float64)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        got = bb.blocks[0].transition(x, AttnContext(pos_q=pos, pos_k=pos, causal=causal))
        hidden = torch.relu(_sepconv_reference(tr.conv1, x, causal))
        want = _sepconv_reference(tr.conv2, hidden, causal)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert tr.conv1.pointwise.out_features == 4 * D  # d_ff: the feed-forward network's shape


def test_sepconv_transition_is_causal_and_keeps_padding_and_episodes_apart():
    bb = Backbone({"d_model": D, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": True,
                   "depth": {"kind": "universal", "transition": "sepconv", "transition_kernel": 3, "max_steps": 3}})
    bb.eval()
    x = torch.randn(2, 10, D, requires_grad=True)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    starts = torch.zeros(2, 10, dtype=torch.bool)
    starts[0, 6] = True  # a new episode at step 6 of row 0
    out = bb(x, mask=mask, episode_start=starts).hidden
    for t in range(9):  # the Jacobian to later tokens is exactly zero
        (g,) = torch.autograd.grad(out[:, t].sum(), x, retain_graph=True)
        assert torch.count_nonzero(g[:, t + 1:]) == 0, t
    (g,) = torch.autograd.grad(out[0, 6:].sum(), x, retain_graph=True)
    assert torch.count_nonzero(g[0, :6]) == 0  # the new episode reads nothing of the old one
    garbage = x.detach().clone()
    garbage[1, :2] = 1e3
    with torch.no_grad():
        a, b = bb(x.detach(), mask=mask).hidden, bb(garbage, mask=mask).hidden
    torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=0)


def test_sepconv_transition_fields_are_checked():
    with pytest.raises(Exception, match=r"depth.transition must be ffn or sepconv, got 'conv'"):
        _bb(transition="conv")
    with pytest.raises(Exception, match=r"depth.transition_kernel must be >= 1"):
        _bb(transition="sepconv", transition_kernel=0)
    with pytest.raises(IncompatibleConfig, match=r"^depth.transition='sepconv' convolves the whole sequence"):
        Backbone({"d_model": D, "n_heads": 2, "ffn_chunks": 2, "depth": {"kind": "universal", "transition": "sepconv"}})
    assert _bb(transition="sepconv").blocks[0].ffn.width == 3
