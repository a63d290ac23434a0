"""The backbone contract on per-layer stacks (``backbone.layers``).

The stacks are the backbone sections of the shipped example configs (scaled to the suite's
width) and two stacks whose every layer declares ``exact_chunking``. A stack's capability holds
when every layer's attention, position and block kinds and the memory and depth kinds declare
it, and the tests are selected by those, as for single kinds (test_contract_variants.py).
"""

from __future__ import annotations

import io

import pytest
import torch
from contract_checks import assert_causal, assert_finite_grads, assert_padding_invariant
from omegaconf import OmegaConf

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.runtime.run_config import compose, to_container
from rl_tformers.types import sum_aux

B, T, D, H = 2, 16, 16, 2
SMALL = {"d_model": D, "n_heads": H, "d_ff": 32, "dropout": 0.0, "attn_dropout": 0.0, "max_position": 4096}
#: The shipped example configs of per-layer stacks (docs/backbone.md, "Per-layer stacks").
SHIPPED = ("dt/hopper_medium_sparse_interleaved", "dt/hopper_medium_longformer_windows",
           "gtrxl/recall_routing_top2", "gtrxl/recall_local_dense_top")
#: Stacks whose every layer declares exact_chunking: kernels and positions differ per layer.
CHUNKING = {
    "sdpa_performer": {"n_layers": 2, "position": {"kind": "rotary"}, "memory": {"kind": "xl", "mem_len": T},
                       "layers": [{"attention": {"kind": "sdpa"}, "position": {"kind": "xl_relative"}},
                                  {"attention": {"kind": "performer", "nb_features": 16}}]},
    "alibi_rotary_pattern": {"n_layers": 4, "memory": {"kind": "xl", "mem_len": T},
                             "layers": [{"position": {"kind": "alibi"}}, {"position": {"kind": "rotary"},
                                                                          "block": {"kind": "gated"}}]},
}


def shipped_stack(name: str) -> dict:
    """The backbone section of shipped config ``name`` at the suite's width."""
    return {**to_container(compose(name))["backbone"], **SMALL}


STACKS = {**{n: shipped_stack(n) for n in SHIPPED}, **{n: {**SMALL, **c} for n, c in CHUNKING.items()}}


def stack_flag(cfg: BackboneConfig, flag: str) -> bool:
    """True when every layer's attention, position and block kinds and the memory and depth
    kinds declare ``flag``."""
    layers = [getattr(cfg.layer_config(i), s).config_capabilities()
              for i in range(cfg.n_layers) for s in ("attention", "position", "block")]
    return all(getattr(c, flag) for c in layers + [cfg.memory.config_capabilities(), cfg.depth.config_capabilities()])


def stacks(flag: str | None = None, stateful: bool | None = None) -> list:
    out = []
    for name, data in STACKS.items():
        cfg = BackboneConfig.from_dict(data)
        if flag is not None and not stack_flag(cfg, flag):
            continue
        if stateful is not None and cfg.memory.config_capabilities().stateful != stateful:
            continue
        out.append(pytest.param(name, id=name))
    return out


def build(name: str) -> Backbone:
    torch.manual_seed(1234)
    return Backbone(STACKS[name]).eval()


def _x(b: int = B, t: int = T) -> torch.Tensor:
    return torch.randn(b, t, D, generator=torch.Generator().manual_seed(7))


def _mask() -> torch.Tensor:
    m = torch.ones(B, T, dtype=torch.bool)
    m[0, T - 3:] = False
    m[1, :2] = False
    return m


def test_every_stack_differs_between_layers_and_tests_are_selected_by_capabilities():
    for name, data in STACKS.items():
        cfg = BackboneConfig.from_dict(data)
        layers = {(lc.attention, lc.position, lc.block) for lc in map(cfg.layer_config, range(cfg.n_layers))}
        assert cfg.layers and len(layers) > 1, name  # kinds or fields differ between layers
    assert {p.id for p in stacks("causal")} == set(STACKS)  # every stack is causal
    assert {p.id for p in stacks("incremental", stateful=False)} == {
        "dt/hopper_medium_sparse_interleaved", "dt/hopper_medium_longformer_windows"}
    assert {p.id for p in stacks("exact_chunking", stateful=True)} == set(CHUNKING)


@pytest.mark.parametrize("name", stacks("causal"))
def test_causality(name: str):
    bb = build(name)
    assert_causal(lambda x: bb(x).hidden, _x())


@pytest.mark.parametrize("name", stacks("causal"))
def test_causality_with_padding(name: str):
    bb = build(name)
    mask = _mask()
    assert_causal(lambda x: bb(x, mask=mask).hidden * mask[..., None], _x())


@pytest.mark.parametrize("name", stacks("key_padding"))
def test_padding_invariance(name: str):
    bb = build(name)
    assert_padding_invariant(lambda x, m: bb(x, mask=m).hidden, _x(), _mask())


@pytest.mark.parametrize("name", stacks())
def test_every_parameter_gets_a_finite_gradient(name: str):
    bb = build(name).train()
    out = bb(_x(), mask=_mask())
    ((out.hidden * torch.randn_like(out.hidden)).sum() + sum_aux(out.aux)).backward()
    # routing layers' centroids are k-means buffers, not parameters; every parameter learns
    assert_finite_grads(bb, allow_none=())


@pytest.mark.parametrize("name", stacks())
def test_config_round_trips_through_dict_and_yaml(name: str):
    cfg = BackboneConfig.from_dict(STACKS[name])
    assert BackboneConfig.from_dict(cfg.to_dict()) == cfg
    yaml = OmegaConf.to_yaml(OmegaConf.create(cfg.to_dict()))
    assert BackboneConfig.from_dict(OmegaConf.to_container(OmegaConf.create(yaml))) == cfg


def _chunks(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    assert sum(sizes) == x.shape[1]
    return list(x.split(sizes, dim=1))


@pytest.mark.parametrize("name", stacks("incremental", stateful=False))
def test_step_by_step_equals_full_pass(name: str):
    bb = build(name)
    x = _x()
    full = bb(x).hidden
    st, outs = bb.initial_state(B), []
    for xc in _chunks(x, [1, 1, 3, 1, 1, 5, 4]):
        o = bb(xc, state=st)
        st = o.state
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", stacks("exact_chunking", stateful=True))
def test_segments_with_memory_equal_one_pass(name: str):
    bb = build(name)
    x = _x()
    full = bb(x).hidden
    st, outs = bb.initial_state(B), []
    for xc in _chunks(x, [5, 7, 4]):
        o = bb(xc, state=st)
        st = o.state
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", stacks("causal", stateful=True))
def test_memory_reset_isolates_rows(name: str):
    """Segments with memory: a row cleared by reset_state continues as a fresh stream, the other
    row keeps its memory; the state survives a weights_only save and load."""
    bb = build(name)
    x = _x()
    o1 = bb(x[:, :8], state=bb.initial_state(B))
    o2 = bb(x[:, 8:], state=o1.state)
    reset = bb.reset_state(o1.state, torch.tensor([False, True]))
    o3 = bb(x[:, 8:], state=reset)
    fresh = bb(x[1:, 8:], state=bb.initial_state(1))
    torch.testing.assert_close(o3.hidden[0], o2.hidden[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(o3.hidden[1], fresh.hidden[0], atol=1e-5, rtol=0)
    buf = io.BytesIO()
    torch.save(o1.state, buf)
    buf.seek(0)
    assert torch.equal(bb(x[:, 8:], state=torch.load(buf, weights_only=True)).hidden, o2.hidden)


@pytest.mark.parametrize("name", stacks(stateful=False))
def test_a_stack_with_a_layer_without_incremental_form_refuses_a_cache_naming_it(name: str):
    """Memory kind none: a cache only when every layer decodes incrementally, else the
    refusal names the first layer that cannot."""
    data = {**STACKS[name], "layers": [*BackboneConfig.from_dict(STACKS[name]).to_dict()["layers"]]}
    n = BackboneConfig.from_dict(data).n_layers
    if len(data["layers"]) != n:
        data["layers"] = [data["layers"][i % len(data["layers"])] for i in range(n)]
    data["layers"][-1] = {"attention": {"kind": "routing", "n_clusters": 2, "local_window": 4, "cluster_window": 8}}
    bb = Backbone(data)
    with pytest.raises(NotImplementedError, match=rf"backbone\.layers\[{n - 1}\]\.attention\.kind='routing' "
                                                  rf"\(layer {n - 1} of {n}: a stack decodes incrementally only"):
        bb.initial_state(B)
