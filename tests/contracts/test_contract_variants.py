"""The contract every registered kind of every slot must satisfy (backbone level).

Parametrised from the registries (see contract_variants.py for how a kind declares test
parameters); tests are selected by the capabilities the kinds declare.
"""

from __future__ import annotations

import io

import pytest
import torch
from contract_checks import assert_causal, assert_finite_grads, assert_padding_invariant
from contract_variants import B, D, T, Variant, all_variants, mode_params, padding_mask, variant_params
from omegaconf import OmegaConf

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.registry import REGISTRIES, SLOTS
from rl_tformers.types import sum_aux


def _x(b: int = B, t: int = T) -> torch.Tensor:
    return torch.randn(b, t, D, generator=torch.Generator().manual_seed(7))


def _fwd(v: Variant, bb: Backbone, x, **kw):
    return bb(x, **kw, **v.forward_kwargs(bb))


def test_every_slot_has_kinds():
    for slot in SLOTS:
        assert len(REGISTRIES[slot]) >= 1, f"no {slot} kind registered"
    kinds = {v.id for v in all_variants()}
    assert {"attention:sdpa", "attention:reference", "block:gated", "block:reversible", "position:rotary"} <= kinds


@pytest.mark.parametrize("v", variant_params())
def test_builds_with_contract_parameters(v: Variant):
    try:
        bb = v.build()
    except Exception as exc:  # the message is the point of this test
        pytest.fail(
            f"{v.id} cannot be built for the contract suite with {v.config[v.slot]} "
            f"({type(exc).__name__}: {exc}); give its config class a contract_config(seq_len) "
            f"(and/or contract_backbone(seq_len)) classmethod, see tests/contracts/contract_variants.py"
        )
    assert isinstance(bb, Backbone)


@pytest.mark.parametrize(("v", "causal"), mode_params())
def test_output_shapes_aux_metrics(v: Variant, causal: bool):
    bb = v.build(causal).eval()
    out = _fwd(v, bb, _x())
    assert out.hidden.shape == (B, T, D)
    assert out.hidden.dtype == torch.float32
    assert torch.isfinite(out.hidden).all()
    for k, a in out.aux.items():
        assert torch.is_tensor(a) and a.dim() == 0 and torch.isfinite(a), f"aux {k} must be a finite 0-d tensor"
    for k, m in out.metrics.items():
        assert isinstance(m, (float, int)) or (torch.is_tensor(m) and m.dim() == 0), f"metric {k} must be a scalar"
    hs = _fwd(v, bb, _x(), output_hidden_states=True).hidden_states
    assert hs is not None and len(hs) >= 1 and all(h.shape == (B, T, D) for h in hs)


@pytest.mark.parametrize("v", variant_params(lambda v: v.causal_ok))
def test_causality(v: Variant):
    bb = v.build(True).eval()
    assert_causal(lambda x: _fwd(v, bb, x).hidden, _x())


@pytest.mark.parametrize("v", variant_params(lambda v: v.causal_ok))
def test_causality_with_padding(v: Variant):
    bb = v.build(True).eval()
    mask = padding_mask()
    assert_causal(lambda x: _fwd(v, bb, x, mask=mask).hidden * mask[..., None], _x())


@pytest.mark.parametrize(("v", "causal"), mode_params(lambda v: v.key_padding))
def test_padding_invariance(v: Variant, causal: bool):
    bb = v.build(causal).eval()
    assert_padding_invariant(lambda x, m: _fwd(v, bb, x, mask=m).hidden, _x(), padding_mask())


@pytest.mark.parametrize(("v", "causal"), mode_params(lambda v: v.key_padding))
def test_fully_masked_row_is_finite(v: Variant, causal: bool):
    bb = v.build(causal).train()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1] = False  # row 1: every key masked for every query
    x = _x().requires_grad_(True)
    out = _fwd(v, bb, x, mask=mask)
    assert torch.isfinite(out.hidden).all()
    (out.hidden.sum() + sum_aux(out.aux)).backward()
    assert torch.isfinite(x.grad).all()
    assert_finite_grads(bb, allow_none=("*",))  # which params get one is checked below


@pytest.mark.parametrize(("v", "causal"), mode_params())
def test_every_parameter_gets_a_finite_gradient(v: Variant, causal: bool):
    bb = v.build(causal).train()
    out = _fwd(v, bb, _x(), mask=padding_mask() if v.key_padding else None)
    r = torch.randn_like(out.hidden)
    ((out.hidden * r).sum() + sum_aux(out.aux)).backward()
    assert_finite_grads(bb, allow_none=v.no_grad_patterns())


@pytest.mark.parametrize(("v", "causal"), mode_params())
def test_bf16_autocast_is_finite_with_padding(v: Variant, causal: bool):
    bb = v.build(causal).train()
    mask = padding_mask() if v.key_padding else None
    x = _x().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _fwd(v, bb, x, mask=mask)
        loss = out.hidden.float().sum() + sum_aux(out.aux)
    assert torch.isfinite(out.hidden.float()).all()
    loss.backward()
    assert torch.isfinite(x.grad).all()
    assert_finite_grads(bb, allow_none=("*",))


@pytest.mark.parametrize("v", variant_params())
def test_config_round_trip_dict_and_yaml(v: Variant):
    cfg = v.backbone_config()
    assert BackboneConfig.from_dict(cfg.to_dict()) == cfg
    yaml = OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
    back = OmegaConf.to_container(OmegaConf.create(yaml), resolve=True)
    assert BackboneConfig.from_dict(back) == cfg
    slot_cfg = getattr(cfg, v.slot)
    assert REGISTRIES[v.slot].from_dict(slot_cfg.to_dict()) == slot_cfg
    assert slot_cfg.to_dict()["kind"] == v.kind


def _chunks(x, sizes):
    out, s = [], 0
    for n in sizes:
        out.append(x[:, s : s + n])
        s += n
    assert s == x.shape[1]
    return out


@pytest.mark.parametrize("v", variant_params(lambda v: v.incremental and v.causal_ok))
def test_step_by_step_equals_full_pass(v: Variant):
    bb = v.build(True).eval()
    x = _x()
    full = _fwd(v, bb, x).hidden
    st = bb.initial_state(B)
    outs = []
    for xc in _chunks(x, [1, 1, 3, 1, 1, 5]):
        o = _fwd(v, bb, xc, state=st)
        st = o.state
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


def _chunk_variant(v: Variant) -> Variant:
    return v if v.stateful else v.with_config(memory={"kind": "xl", "mem_len": T})


@pytest.mark.parametrize("v", variant_params(lambda v: v.exact_chunking and v.causal_ok))
def test_segments_with_memory_equal_one_pass(v: Variant):
    cv = _chunk_variant(v)
    bb = cv.build(True).eval()
    x = _x()
    full = _fwd(cv, bb, x).hidden
    st = bb.initial_state(B)
    outs = []
    for xc in _chunks(x, [5, 7]):
        o = _fwd(cv, bb, xc, state=st)
        st = o.state
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("v", variant_params(lambda v: v.stateful and v.causal_ok))
def test_memory_reset_isolates_rows_and_padding(v: Variant):
    bb = v.build(True).eval()
    x = _x()
    m1 = torch.ones(B, 6, dtype=torch.bool)
    m1[0, 4:] = False
    o1 = _fwd(v, bb, x[:, :6], mask=m1, state=bb.initial_state(B))
    o2 = _fwd(v, bb, x[:, 6:], state=o1.state)
    # garbage in the padded slots of the first segment changes nothing valid downstream
    xg = x.clone()
    xg[0, 4:6] = torch.randn(2, D) * 100
    g1 = _fwd(v, bb, xg[:, :6], mask=m1, state=bb.initial_state(B))
    g2 = _fwd(v, bb, xg[:, 6:], state=g1.state)
    torch.testing.assert_close(g1.hidden[m1], o1.hidden[m1], atol=1e-5, rtol=0)
    torch.testing.assert_close(g2.hidden, o2.hidden, atol=1e-5, rtol=0)
    # reset row 1: it behaves as a fresh stream, row 0 keeps its memory
    reset = bb.reset_state(o1.state, torch.tensor([False, True]))
    o3 = _fwd(v, bb, x[:, 6:], state=reset)
    fresh = _fwd(v, bb, x[1:, 6:], state=bb.initial_state(1))
    torch.testing.assert_close(o3.hidden[0], o2.hidden[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(o3.hidden[1], fresh.hidden[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("v", variant_params(lambda v: (v.stateful or v.incremental) and v.causal_ok))
def test_state_round_trips_through_weights_only_load(v: Variant):
    """A state saved with ``torch.save`` loads back with ``torch.load(weights_only=True)``
    (PyTorch's default) and continues exactly as the original (every state type is allowed
    through ``rl_tformers.types.state_type``)."""
    bb = v.build(True).eval()
    x = _x()
    st = _fwd(v, bb, x[:, :7], state=bb.initial_state(B)).state
    buf = io.BytesIO()
    torch.save(st, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert type(loaded) is type(st)
    assert torch.equal(_fwd(v, bb, x[:, 7:], state=loaded).hidden, _fwd(v, bb, x[:, 7:], state=st).hidden)
