"""Block kinds: GTrXL gates (paper formulas, identity at large b_g, near-identity at b_g = 2),
reversible layers (gradients equal the ordinary stack, activation memory flat in depth, refusals)
and the chunked feed-forward."""

from __future__ import annotations

import pytest
import torch

from rl_tformers import Backbone, IncompatibleConfig
from rl_tformers.bench.reversible import saved_activation_bytes
from rl_tformers.blocks.base import FeedForward
from rl_tformers.blocks.gated import GATES, Gate
from rl_tformers.blocks.reversible import run_reversible

D = 16


def _bb(**kw):
    cfg = {"d_model": D, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    cfg.update(kw)
    torch.manual_seed(0)
    return Backbone(cfg)


# -- GTrXL gates -------------------------------------------------------------------------------------
def test_gate_formulas_match_the_paper():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, D), torch.randn(2, 3, D)
    sig, tanh = torch.sigmoid, torch.tanh
    for kind in GATES:
        g = Gate(kind, D, bias=1.5)
        out, mean = g(x, y)
        if kind == "input":
            s = sig(x @ g.w.weight.T)
            want = s * x + y
        elif kind == "output":
            s = sig(x @ g.w.weight.T - 1.5)
            want = x + s * y
        elif kind == "highway":
            s = sig(x @ g.w.weight.T + 1.5)
            want = s * x + (1 - s) * y
        elif kind == "sigmoid_tanh":
            wg, ug = g.w.weight.chunk(2, 0)
            s = sig(y @ wg.T - 1.5)
            want = x + s * tanh(y @ ug.T)
        else:
            wr, wz, wg = g.w.weight.chunk(3, 0)
            ur, uz = g.u.weight.chunk(2, 0)
            r = sig(y @ wr.T + x @ ur.T)
            s = sig(y @ wz.T + x @ uz.T - 1.5)
            h = tanh(y @ wg.T + (r * x) @ g.u_g.weight.T)
            want = (1 - s) * x + s * h
        torch.testing.assert_close(out, want, atol=1e-6, rtol=0, msg=kind)
        assert mean.item() == pytest.approx(s.mean().item(), abs=1e-6)


@pytest.mark.parametrize("kind", ["gru", "output", "highway", "sigmoid_tanh"])
def test_gate_with_huge_bias_returns_its_input_unchanged(kind):
    g = Gate(kind, D, bias=1e4)
    x, y = torch.randn(4, 5, D), torch.randn(4, 5, D) * 10
    out, _ = g(x, y)
    assert torch.equal(out, x)


def test_gated_block_with_huge_bias_is_exactly_the_identity():
    """Layer norm only on the sub-layer inputs: a closed gate passes the raw stream through."""
    bb = _bb(n_layers=1, final_norm=False, block={"kind": "gated", "gate": "gru", "gate_bias": 1e4}).eval()
    x = torch.randn(2, 7, D) * 5 + 3  # far from normalised
    assert torch.equal(bb(x).hidden, x)


def test_gru_gate_bias_two_starts_close_to_identity():
    def rel_change(bias):
        torch.manual_seed(0)
        bb = Backbone({"d_model": 64, "n_layers": 1, "n_heads": 4, "dropout": 0.0, "attn_dropout": 0.0,
                       "final_norm": False, "block": {"kind": "gated", "gate": "gru", "gate_bias": bias}}).eval()
        x = torch.randn(4, 20, 64, generator=torch.Generator().manual_seed(1))
        out = bb(x)
        return ((out.hidden - x).norm() / x.norm()).item(), out.metrics

    r0, _ = rel_change(0.0)
    r2, m2 = rel_change(2.0)
    r6, _ = rel_change(6.0)
    # z = sigmoid(W_z y + U_z x - b_g) starts near sigmoid(-2) = 0.119
    assert 0.09 < float(m2["layer0/gate_attn"]) < 0.16 and 0.09 < float(m2["layer0/gate_ffn"]) < 0.16
    assert r2 < 0.35 and r2 < 0.5 * r0  # close to the input, far closer than with b_g = 0
    assert r6 < 0.25 * r2  # and the identity is approached as b_g grows


def test_gated_block_exposes_gate_metrics_per_layer():
    out = _bb(block={"kind": "gated"})(torch.randn(2, 5, D))
    assert {"layer0/gate_attn", "layer0/gate_ffn", "layer1/gate_attn", "layer1/gate_ffn"} <= set(out.metrics)
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in out.metrics.values())


def test_gated_block_relu_flag_changes_the_output():
    x = torch.randn(2, 5, D)
    a = _bb(block={"kind": "gated", "relu": True}).eval()(x).hidden
    b = _bb(block={"kind": "gated", "relu": False}).eval()(x).hidden
    assert (a - b).abs().max() > 1e-3


def test_gated_config_rejects_unknown_gate():
    with pytest.raises(Exception, match="block.gate='lstm'"):
        _bb(block={"kind": "gated", "gate": "lstm"})


def test_documented_done_when_config_builds():
    bb = Backbone({"d_model": 32, "n_heads": 4, "n_layers": 2, "attention": {"kind": "sdpa"},
                   "position": {"kind": "rotary"}, "block": {"kind": "gated", "gate": "gru"}})
    assert bb(torch.randn(2, 6, 32)).hidden.shape == (2, 6, 32)


# -- reversible ---------------------------------------------------------------------------------------
def _grads(bb, x, mask, seed):
    bb.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = bb(xx, mask=mask).hidden
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)).sum().backward()
    return out.detach(), xx.grad, {n: p.grad.clone() for n, p in bb.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reversible_gradients_equal_the_ordinary_stack(dtype):
    """Same weights, same dropout masks: recomputing activations in backward changes nothing."""
    bb = _bb(n_layers=4, dropout=0.1, attn_dropout=0.1, block={"kind": "reversible"},
             position={"kind": "learned", "per_layer": True}).to(dtype).train()
    x = torch.randn(2, 9, D, dtype=dtype)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    results = []
    for recompute in (True, False):
        for b in bb.blocks:
            b.recompute = recompute
        results.append(_grads(bb, x, mask, seed=3))
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    tol = 1e-5 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(o1, o2, atol=0, rtol=0)
    torch.testing.assert_close(gx1, gx2, atol=tol, rtol=0)
    assert gp1.keys() == gp2.keys() and len(gp1) > 0
    for n in gp1:
        torch.testing.assert_close(gp1[n], gp2[n], atol=tol, rtol=0, msg=n)
    if dtype == torch.float64:  # far below the 1e-5 of the must-show
        assert max((gp1[n] - gp2[n]).abs().max().item() for n in gp1) < 1e-10


def test_reversible_activation_memory_is_flat_in_depth():
    def saved(n_layers, recompute):
        bb = _bb(n_layers=n_layers, block={"kind": "reversible", "recompute": recompute}).train()
        x = torch.randn(2, 32, D, requires_grad=True)
        nbytes, _ = saved_activation_bytes(lambda: bb(x).hidden, exclude=list(bb.parameters()))
        return nbytes

    rev = [saved(n, True) for n in (2, 4, 8)]
    ordinary = [saved(n, False) for n in (2, 4, 8)]
    assert rev[0] == rev[1] == rev[2]  # flat: only the two output streams (+ final norm) are kept
    assert ordinary[2] > 3 * ordinary[0]  # grows linearly with depth
    assert rev[2] * 5 < ordinary[2]


def test_reversible_stack_equals_its_definition():
    """Y1 = X1 + F(X2), Y2 = X2 + G(Y1), output (Y1 + Y2) / 2, computed by hand."""
    bb = _bb(n_layers=2, final_norm=False, block={"kind": "reversible"}).eval()
    x = torch.randn(2, 6, D)
    ctx_out = bb(x).hidden
    from rl_tformers.types import AttnContext

    pos = torch.arange(6).expand(2, 6)
    ctx = AttnContext(pos_q=pos, pos_k=pos, causal=True)
    x1 = x2 = x
    for blk in bb.blocks:
        y1 = x1 + blk.attn(blk.norm1(x2), blk.norm1(x2), ctx).out
        y2 = x2 + blk.ffn(blk.norm2(y1))
        x1, x2 = y1, y2
    torch.testing.assert_close(ctx_out, 0.5 * (x1 + x2), atol=1e-6, rtol=0)
    torch.testing.assert_close(run_reversible(bb.blocks, x, ctx, recompute=False).hidden, ctx_out, atol=0, rtol=0)


def test_reversible_refuses_memory_depth_and_state():
    with pytest.raises(IncompatibleConfig, match="backbone.memory.kind='xl'"):
        _bb(block={"kind": "reversible"}, memory={"kind": "xl"})
    bb = _bb(block={"kind": "reversible"})
    with pytest.raises(NotImplementedError, match="block.kind='reversible'"):
        bb(torch.randn(1, 3, D), state=bb.initial_state(1))


def test_reversible_refuses_other_depth_kinds():
    from rl_tformers.registry import DEPTH

    others = [k for k in DEPTH.kinds() if k != "fixed"]
    if not others:
        pytest.skip("only depth kind 'fixed' is registered")
    with pytest.raises(IncompatibleConfig, match="depth.kind='fixed'"):
        _bb(block={"kind": "reversible"}, depth={"kind": others[0]})


# -- chunked feed-forward -------------------------------------------------------------------------------
def test_chunked_feed_forward_equals_unchunked():
    torch.manual_seed(0)
    ff = FeedForward(D, 4 * D, "gelu", 0.0, chunks=1)
    ffc = FeedForward(D, 4 * D, "gelu", 0.0, chunks=3)
    ffc.load_state_dict(ff.state_dict())
    x = torch.randn(2, 10, D, requires_grad=True)
    torch.testing.assert_close(ffc(x), ff(x), atol=1e-6, rtol=0)
    (g1,) = torch.autograd.grad(ff(x).sum(), x)
    (g2,) = torch.autograd.grad(ffc(x).sum(), x)
    torch.testing.assert_close(g2, g1, atol=1e-6, rtol=0)


def test_backbone_ffn_chunks_equals_unchunked():
    a = _bb(ffn_chunks=1).eval()
    b = _bb(ffn_chunks=4).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 11, D)
    torch.testing.assert_close(b(x).hidden, a(x).hidden, atol=1e-6, rtol=0)


# ------------------------------------------------- reversible: per-layer outputs carry gradients
def test_reversible_hidden_states_backpropagate_as_without_recompute() -> None:
    from rl_tformers import Backbone

    def grads(recompute: bool, layers: tuple[int, ...]):
        torch.manual_seed(0)
        bb = Backbone({"d_model": 16, "n_layers": 3, "n_heads": 2, "dropout": 0.1, "attn_dropout": 0.1,
                       "position": {"kind": "learned", "per_layer": True},
                       "block": {"kind": "reversible", "recompute": recompute}}).double().train()
        x = torch.randn(2, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        mask = torch.ones(2, 7, dtype=torch.bool)
        mask[1, 5:] = False
        torch.manual_seed(4)  # the same dropout masks in both runs
        out = bb(x, mask=mask, output_hidden_states=True)
        assert len(out.hidden_states) == 3 and all(h.requires_grad for h in out.hidden_states)
        g = torch.Generator().manual_seed(2)
        loss = sum((out.hidden_states[i] * torch.randn(2, 7, 16, dtype=torch.float64, generator=g)).sum()
                   for i in layers)
        if not layers:
            loss = (out.hidden * torch.randn(2, 7, 16, dtype=torch.float64, generator=g)).sum()
        loss.backward()
        return x.grad, {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in bb.named_parameters()}

    for layers in ((0,), (1,), (0, 1, 2), ()):
        (gx, gp), (hx, hp) = grads(True, layers), grads(False, layers)
        assert gx.abs().sum() > 0 and sum(g.abs().sum() for g in gp.values()) > 0
        torch.testing.assert_close(gx, hx, atol=1e-10, rtol=0)
        for name in gp:
            torch.testing.assert_close(gp[name], hp[name], atol=1e-10, rtol=0, msg=name)


# ------------------------------------------------- reversible: auxiliary attention losses backpropagate
@pytest.mark.parametrize("attention", [
    {"kind": "adaptive_span", "max_span": 6, "loss_coef": 0.01},
    {"kind": "adaptive_span", "max_span": 6, "loss_coef": 0.01, "dynamic": True},
    {"kind": "routing", "n_clusters": 2, "local_window": 4, "cluster_window": 4, "commitment_weight": 0.5,
     "ema_decay": 0.9},
], ids=["span-static", "span-dynamic", "routing-commitment"])
def test_reversible_recompute_backpropagates_auxiliary_attention_losses(attention) -> None:
    from rl_tformers import Backbone

    def run(recompute: bool, use_aux: bool):
        torch.manual_seed(0)
        bb = Backbone({"d_model": 16, "n_layers": 3, "n_heads": 2, "dropout": 0.1, "attn_dropout": 0.0,
                       "causal": False, "position": {"kind": "learned", "per_layer": True}, "attention": attention,
                       "block": {"kind": "reversible", "recompute": recompute}}).double().train()
        x = torch.randn(2, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        mask = torch.ones(2, 12, dtype=torch.bool)
        mask[1, 9:] = False
        torch.manual_seed(4)  # the same dropout masks in both runs
        out = bb(x, mask=mask)  # raised RuntimeError here with recompute=true
        assert len(out.aux) == 1 and all(v.requires_grad for v in out.aux.values())
        loss = (out.hidden * torch.randn(2, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))).sum()
        if use_aux:
            loss = loss + 100 * sum(out.aux.values())
        loss.backward()
        params = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in bb.named_parameters()}
        buffers = {n: b.clone() for n, b in bb.named_buffers()}
        return {k: v.detach() for k, v in out.aux.items()}, x.grad, params, buffers

    for use_aux in (True, False):
        (aux, gx, gp, buf), (aux0, hx, hp, buf0) = run(True, use_aux), run(False, use_aux)
        assert aux.keys() == aux0.keys() and all(torch.equal(aux[k], aux0[k]) for k in aux)
        torch.testing.assert_close(gx, hx, atol=1e-10, rtol=0)
        for name in gp:
            torch.testing.assert_close(gp[name], hp[name], atol=1e-10, rtol=0, msg=name)
        for name in buf:  # routing's EMA centroids: one update per step either way
            torch.testing.assert_close(buf[name], buf0[name], atol=1e-12, rtol=0, msg=name)


# ------------------------------------------------------------------- reversible block with a memory
def test_reversible_block_with_a_memory_says_what_to_use_instead() -> None:
    """`rl-tformers train -c gtrxl/hopper_positions_bc backbone.block.kind=reversible` gives the
    block's own advice, not only the generic capability check's "backbone.memory.kind='xl' is not
    supported by backbone.block.kind='reversible'" (the block's check runs first)."""
    from rl_tformers import Backbone
    from rl_tformers.backbone import IncompatibleConfig

    with pytest.raises(IncompatibleConfig) as exc:
        Backbone({"d_model": 16, "n_heads": 2, "block": {"kind": "reversible"}, "memory": {"kind": "xl"}})
    assert str(exc.value) == (
        "backbone.memory.kind='xl' is not supported by backbone.block.kind='reversible' (it keeps no per-layer "
        "memory); blocks that do: gated, post_norm, pre_norm; or use backbone.memory.kind=none (GTrXL then runs "
        "in its plain-window mode: agent.window=W backbone.memory.kind=none agent.burn_in=0 agent.seq_len=W)")
