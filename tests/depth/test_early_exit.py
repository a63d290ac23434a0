"""Early exit (``early_exit``): Depth-Adaptive Transformer exit classifiers and CALM confidences."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rl_tformers import Backbone
from rl_tformers.depth.early_exit import (
    CONFIDENCES,
    calibrate_threshold,
    consistency_evaluator,
    consistency_labels,
    exit_loss,
    exit_predictions,
    hoeffding_p_value,
    oracle_depth,
    softmax_response,
    with_final_norm,
)
from rl_tformers.types import AttnContext

D, A = 16, 4


def _bb(n_layers=3, memory=None, **depth):
    cfg = {
        "d_model": D, "n_layers": n_layers, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
        "depth": {"kind": "early_exit", **depth},
    }
    if memory:
        cfg["memory"] = memory
    return Backbone(cfg).eval()


def _head():
    torch.manual_seed(7)
    return torch.nn.Linear(D, A)


@pytest.mark.parametrize("confidence", CONFIDENCES)
def test_threshold_zero_exits_every_token_at_layer_one(confidence):
    bb, head = _bb(confidence=confidence), _head()
    x = torch.randn(2, 6, D)
    out = bb(x, exit_head=with_final_norm(bb, head), exit_threshold=0.0)
    assert out.metrics["exit/mean_layer"] == 1.0 and out.metrics["exit/early_frac"] == 1.0
    assert out.metrics["exit/layers_run"] == 1.0
    ctx = AttnContext(pos_q=torch.arange(6).expand(2, 6), pos_k=torch.arange(6).expand(2, 6))
    one = bb.depth.blocks[0](x, ctx, None).hidden
    torch.testing.assert_close(out.hidden, bb.final_norm(one), atol=1e-6, rtol=0)


@pytest.mark.parametrize("confidence", CONFIDENCES)
def test_threshold_above_any_confidence_equals_the_full_model(confidence):
    bb, head = _bb(confidence=confidence), _head()
    x = torch.randn(2, 6, D)
    full = bb(x).hidden
    out = bb(x, exit_head=with_final_norm(bb, head), exit_threshold=1.0 + 1e-6)
    assert torch.equal(out.hidden, full)
    assert out.metrics["exit/mean_layer"] == 3.0 and out.metrics["exit/layers_run"] == 3.0
    # and the full model is the fixed stack with the same blocks
    fixed = Backbone({**bb.config.to_dict(), "depth": {"kind": "fixed"}}).eval()
    fixed.load_state_dict({k: v for k, v in bb.state_dict().items() if "exit_" not in k})
    torch.testing.assert_close(fixed(x).hidden, full, atol=0, rtol=0)


def test_exited_states_are_copied_upward_and_attended():
    bb = _bb()
    x = torch.randn(1, 4, D)
    forced = torch.tensor([[0, 2, 1, 2]])  # token 0 exits after layer 1, token 2 after layer 2
    out = bb(x, exit_layers=forced)
    ctx = AttnContext(pos_q=torch.arange(4)[None], pos_k=torch.arange(4)[None])
    b0, b1, b2 = bb.depth.blocks
    h1 = b0(x, ctx, None).hidden
    h2 = b1(h1, ctx, None).hidden
    h2 = torch.where(torch.tensor([True, False, False, False])[None, :, None], h1, h2)
    h3 = b2(h2, ctx, None).hidden
    h3 = torch.where(torch.tensor([True, False, True, False])[None, :, None], h2, h3)
    torch.testing.assert_close(out.hidden, bb.final_norm(h3), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.metrics["exit/mean_layer"], torch.tensor((1 + 3 + 2 + 3) / 4))
    # later tokens really read the copied state: it differs from the full model's
    assert (out.hidden[0, 1] - bb(x).hidden[0, 1]).abs().max() > 1e-4


def test_incremental_decoding_with_exits_equals_the_full_pass():
    bb = _bb(n_layers=4, confidence="classifier")
    with torch.no_grad():
        bb.depth.exit_classifier.weight.normal_(0, 1.0)
    x = torch.randn(2, 8, D)
    full = bb(x, exit_threshold=0.5)
    assert 1.0 < full.metrics["exit/mean_layer"] < 4.0, "the test needs a mix of exit layers"
    st = bb.initial_state(2)
    outs = []
    for t in range(8):
        o = bb(x[:, t : t + 1], state=st, exit_threshold=0.5)
        st = o.state
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full.hidden, atol=1e-5, rtol=0)


def test_xl_memory_receives_copied_states_when_layers_are_skipped():
    bb = _bb(memory={"kind": "xl", "mem_len": 8}, confidence="saturation")
    x = torch.randn(2, 5, D)
    out = bb(x, state=bb.initial_state(2), exit_threshold=0.0, output_hidden_states=True)
    assert out.metrics["exit/layers_run"] == 1.0
    h1 = out.hidden_states[0]
    for ls in out.state.layers[1:]:
        torch.testing.assert_close(ls.memory[:, -5:], h1, atol=0, rtol=0)
    assert all(torch.equal(h, h1) for h in out.hidden_states)


def test_exit_mask_limits_who_decides():
    bb = _bb(confidence="saturation")
    x = torch.randn(1, 6, D)
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, -1] = True  # only the last token's output is used (DT-style)
    out = bb(x, exit_threshold=0.0, exit_mask=mask)
    assert out.metrics["exit/mean_layer"] == 1.0 and out.metrics["exit/layers_run"] == 1.0
    ctx = AttnContext(pos_q=torch.arange(6)[None], pos_k=torch.arange(6)[None])
    one = bb.depth.blocks[0](x, ctx, None).hidden
    torch.testing.assert_close(out.hidden[0, -1], bb.final_norm(one)[0, -1], atol=1e-6, rtol=0)


def test_softmax_confidence_needs_a_head():
    bb = _bb(confidence="softmax")
    with pytest.raises(ValueError, match="exit_head"):
        bb(torch.randn(1, 3, D), exit_threshold=0.5)
    bb(torch.randn(1, 3, D))  # without exits no head is needed


def test_softmax_response_and_threshold_buffer():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    torch.testing.assert_close(softmax_response(logits), torch.tensor([0.3]))
    bb = _bb(confidence="saturation")
    assert math.isinf(float(bb.depth.exit_threshold))
    bb.depth.set_threshold(0.0)
    assert bb(torch.randn(1, 3, D)).metrics["exit/mean_layer"] == 1.0
    bb2 = _bb(confidence="saturation")
    bb2.load_state_dict(bb.state_dict())
    assert float(bb2.depth.exit_threshold) == 0.0


@pytest.mark.parametrize("confidence", ["softmax", "classifier"])
def test_calibration_yields_the_stated_consistency_on_held_out_data(confidence):
    torch.manual_seed(0)
    bb = _bb(n_layers=4, confidence=confidence)
    head = _head()
    calib = [{"x": torch.randn(8, 10, D)} for _ in range(20)]
    test = [{"x": torch.randn(8, 10, D)} for _ in range(20)]
    delta, eps = 0.1, 0.05
    cal = calibrate_threshold(consistency_evaluator(bb, head, calib, discrete=True), [i / 20 for i in range(21)], delta, eps)
    assert cal.threshold < 1.0, "calibration should allow early exits"
    assert cal.n == 1600
    agree = consistency_evaluator(bb, head, test, discrete=True)(cal.threshold)
    assert 1 - agree.float().mean() <= delta
    mean_layer = sum(float(bb(**kw, exit_head=with_final_norm(bb, head), exit_threshold=cal.threshold).metrics["exit/mean_layer"]) for kw in test) / len(test)
    assert mean_layer < 4.0


def test_learn_then_test_fixed_sequence():
    risks = {1.0: 0.0, 0.8: 0.01, 0.6: 0.03, 0.4: 0.2, 0.2: 0.01}  # 0.2 passes, but 0.4 failed first

    def evaluate(lam):
        n = 1000
        bad = int(round(risks[lam] * n))
        return torch.arange(n) >= bad

    cal = calibrate_threshold(evaluate, risks, delta=0.1, epsilon=0.05)
    assert cal.threshold == 0.6 and 0.2 not in cal.risks
    assert cal.p_values[0.6] == pytest.approx(hoeffding_p_value(0.03, 0.1, 1000), rel=1e-3)
    assert hoeffding_p_value(0.2, 0.1, 10**6) == 1.0
    # a tiny calibration set cannot certify anything
    cal = calibrate_threshold(lambda lam: torch.ones(10, dtype=torch.bool), [0.5, 1.0], delta=0.1, epsilon=0.05)
    assert math.isinf(cal.threshold)


def test_oracles():
    # N=3 layers, B=1, T=3; scores = log-likelihoods
    score = torch.tensor([[[-1.0, -0.1, -2.0]], [[-0.5, -0.1, -1.0]], [[-0.4, -3.0, -0.1]]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert oracle_depth(score, mask).tolist() == [[2, 0, 2]]
    assert oracle_depth(score, mask, penalty=0.2).tolist() == [[1, 0, 2]]  # -0.5-0.4 > -0.4-0.6
    # sequence level: totals -3.1, -1.6, -3.5 -> layer 2 (index 1) for every token
    assert oracle_depth(score, mask, level="sequence").tolist() == [[1, 1, 1]]
    # smoothing over time mixes neighbours' scores
    k = torch.exp(-torch.tensor([[0.0, 1, 4], [1, 0, 1], [4, 1, 0]]) / 1.0)
    smooth = torch.einsum("nbs,ts->nbt", score, k)
    assert oracle_depth(score, mask, sigma=1.0).tolist() == [smooth.argmax(0)[0].tolist()]


def test_exit_loss_schemes():
    tl = torch.tensor([3.0, 2.0, 1.0])[:, None, None].expand(3, 2, 4)
    torch.testing.assert_close(exit_loss(tl, scheme="uniform"), torch.tensor(2.0))
    torch.testing.assert_close(exit_loss(tl, scheme="weighted"), torch.tensor((3 + 4 + 3) / 6))
    s = exit_loss(tl, scheme="sampled", generator=torch.Generator().manual_seed(0))
    assert 1.0 <= float(s) <= 3.0
    with pytest.raises(ValueError):
        exit_loss(tl, scheme="x")


@pytest.mark.parametrize("confidence", ["classifier", "geometric", "multinomial", "sequence"])
def test_exit_classifier_trains_alone_and_loss_decreases(confidence):
    torch.manual_seed(0)
    bb, head = _bb(confidence=confidence, depth_penalty=0.05), _head()
    x, y = torch.randn(4, 6, D), torch.randint(0, A, (4, 6))
    out = bb(x, output_hidden_states=True)
    preds = exit_predictions(bb, out.hidden_states, head)
    torch.testing.assert_close(preds[-1], head(out.hidden))
    tl = torch.stack([F.cross_entropy(p.transpose(1, 2), y, reduction="none") for p in preds])  # (N, B, T)
    labels = consistency_labels(preds, discrete=True)
    assert labels[-1].all()
    clf = [p for n, p in bb.named_parameters() if n.startswith("depth.exit_classifier")]
    opt = torch.optim.Adam(clf, lr=0.05)

    def loss():
        return bb.depth.exit_classifier_loss(out.hidden_states, token_loss=tl, consistent=labels)

    names, params = zip(*bb.named_parameters())
    grads = torch.autograd.grad(loss(), params, allow_unused=True)
    reached = {n for n, g in zip(names, grads) if g is not None and g.abs().sum() > 0}
    assert reached and all(n.startswith("depth.exit_classifier") for n in reached)
    first = float(loss().detach())
    for _ in range(30):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert float(loss().detach()) < 0.7 * first


def test_missing_labels_are_reported():
    bb = _bb(confidence="classifier")
    out = bb(torch.randn(1, 3, D), output_hidden_states=True)
    with pytest.raises(ValueError, match="consistent"):
        bb.depth.exit_classifier_loss(out.hidden_states)
    bb = _bb(confidence="geometric", oracle="correctness")
    with pytest.raises(ValueError, match="correct"):
        bb.depth.exit_classifier_loss(out.hidden_states, token_loss=torch.zeros(3, 1, 3))
    assert float(_bb(confidence="saturation").depth.exit_classifier_loss(out.hidden_states)) == 0.0


def test_continuous_consistency():
    a = [torch.zeros(1, 2, 3), torch.tensor([[[0.0, 0.05, 0.0], [0.2, 0.0, 0.0]]])]
    assert consistency_labels(a, discrete=False, tol=0.1).tolist() == [[[True, False]], [[True, True]]]
