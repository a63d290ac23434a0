"""``backbone.layers``: per-layer attention, position and block kinds and fields, how entries
merge over the backbone-wide slots, repeat up the stack, round-trip, and what is refused (with
the layer's entry named)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.attention.local import LocalConfig
from rl_tformers.attention.routing import RoutingConfig
from rl_tformers.backbone import IncompatibleConfig
from rl_tformers.backbone_config import BuildContext
from rl_tformers.backbone_layers import LayerOverride
from rl_tformers.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from rl_tformers.registry import RegistryError
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.run_config import compose

SMALL = {"d_model": 16, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}


def _cfg(**kw) -> BackboneConfig:
    return BackboneConfig.from_dict({**SMALL, **kw})


def test_an_entry_of_the_same_kind_merges_its_fields_over_the_backbone_s_and_another_kind_starts_from_defaults():
    cfg = _cfg(n_layers=3, attention={"kind": "local", "block": 8, "memory": 8},
               layers=[{}, {"attention": {"memory": 4}}, {"attention": {"kind": "routing", "n_clusters": 2}}])
    assert cfg.layer_config(0).attention == LocalConfig(block=8, memory=8)
    assert cfg.layer_config(1).attention == LocalConfig(block=8, memory=4)
    assert cfg.layer_config(2).attention == RoutingConfig(n_clusters=2)
    assert cfg.layers[0] == LayerOverride() and cfg.layers[1].slots() == ("attention",)
    assert cfg.layer_config(1).layers == () and cfg.layer_config(1).position == cfg.position
    bb = Backbone(cfg)
    assert [type(b.attn).__name__ for b in bb.blocks] == ["Local1DAttention", "Local1DAttention", "RoutingAttention"]
    assert [getattr(b.attn, "memory", None) for b in bb.blocks[:2]] == [8, 4]


def test_a_shorter_list_is_a_pattern_repeated_up_the_stack():
    cfg = _cfg(n_layers=6, layers=[{"attention": {"kind": "strided", "stride": 4}},
                                   {"attention": {"kind": "fixed", "stride": 4}}])
    assert [cfg.layer_config(i).attention.kind for i in range(6)] == ["strided", "fixed"] * 3
    assert cfg.layers_repeat and cfg.layer_path(5, "attention") == "backbone.layers[1].attention"
    assert [w for w, _ in cfg.per_layer("attention")] == ["backbone.layers[0].attention",
                                                          "backbone.layers[1].attention"] * 3
    assert [w for w, _ in cfg.per_layer("position")] == ["backbone.position"] * 6
    assert [type(b.attn).__name__ for b in Backbone(cfg).blocks] == ["StridedAttention", "FixedAttention"] * 3


def test_a_list_that_neither_fills_nor_divides_the_stack_is_refused():
    with pytest.raises(ValueError, match=r"^backbone\.layers has 4 entries for backbone\.n_layers=6; give one entry "
                                         r"per layer \(6\), or a pattern repeated up the stack whose length divides "
                                         r"it \(1, 2, 3, 6\)$"):
        _cfg(n_layers=6, layers=[{}] * 4)


def test_the_build_context_of_a_layer_carries_that_layer_s_config():
    cfg = _cfg(n_layers=2, layers=[{}, {"attention": {"kind": "sliding_window", "window": 3}}])
    ctx = BuildContext(cfg)
    assert ctx.at_layer(1).config == cfg.layer_config(1) and ctx.at_layer(1).config.attention.window == 3
    assert ctx.at_layer(1).shared is ctx.shared and ctx.at_layer(1).layer_idx == 1
    assert ctx.at_layer(0).config.attention.kind == "sdpa"
    plain = _cfg()
    assert plain.layer_config(2) is plain and BuildContext(plain).at_layer(2).config is plain


def test_round_trip_through_dict_and_yaml_keeps_every_field_of_the_overridden_slots():
    cfg = _cfg(n_layers=2, position={"kind": "rotary"},
               layers=[{"position": {"kind": "alibi"}}, {"block": {"kind": "gated", "gate": "output"}}])
    d = cfg.to_dict()
    assert d["layers"] == [{"position": {"kind": "alibi"}},
                           {"block": {"kind": "gated", "gate": "output", "gate_bias": 2.0, "relu": True}}]
    assert BackboneConfig.from_dict(d) == cfg
    back = OmegaConf.to_container(OmegaConf.create(OmegaConf.to_yaml(OmegaConf.create(d))))
    assert BackboneConfig.from_dict(back) == cfg
    assert BackboneConfig().to_dict()["layers"] == []


@pytest.mark.parametrize(("layers", "message"), [
    ([{"attn": {"kind": "sdpa"}}], r"^backbone\.layers\[0\]\.attn: unknown key; did you mean "
                                   r"backbone\.layers\[0\]\.attention\? \(a layer sets: attention, position, block\)$"),
    ([{"memory": {"kind": "xl"}}], r"^backbone\.layers\[0\]\.memory: backbone\.memory is backbone-wide \(one memory "
                                   r"for the whole stack\); a layer sets only attention, position, block; set "
                                   r"backbone\.memory instead$"),
    ([{}, {"attention": {"kind": "sliding_window", "windw": 3}}, {}],
     r"^backbone\.layers\[1\]\.attention\.windw: unknown key: attention kind 'sliding_window' has no field 'windw'; "
     r"did you mean backbone\.layers\[1\]\.attention\.window\?"),
    ([{"attention": {"kind": "stridd"}}], r"^backbone\.layers\[0\]\.attention\.kind='stridd': unknown attention kind; "
                                          r"did you mean strided\?"),
    ([{"attention": {"kind": "local", "block": 2.5}}],
     r"^backbone\.layers\[0\]\.attention\.block must be an integer, got 2\.5 \(float\)$"),
    ([{"attention": "sdpa"}], r"^backbone\.layers\[0\]\.attention: expected a mapping with a 'kind' key, got str$"),
    ({"attention": {"kind": "sdpa"}}, r"^backbone\.layers: expected a list of per-layer entries, got dict$"),
])
def test_a_bad_entry_is_refused_naming_its_index_and_key(layers, message):
    with pytest.raises(RegistryError, match=message):
        _cfg(layers=layers)


def test_each_layer_is_checked_against_its_kinds_capabilities_naming_its_entry():
    with pytest.raises(IncompatibleConfig, match=r"^backbone\.layers\[2\]\.attention\.kind='longformer' has no causal "
                                                 r"form; set backbone\.causal=false"):
        Backbone(_cfg(layers=[{}, {}, {"attention": {"kind": "longformer"}}]))
    with pytest.raises(IncompatibleConfig, match=r"^backbone\.memory\.kind='xl' needs an attention kernel that accepts "
                                                 r"memory keys; backbone\.layers\[1\]\.attention\.kind='sinkhorn' does not"):
        Backbone(_cfg(n_layers=2, memory={"kind": "xl"}, layers=[{}, {"attention": {"kind": "sinkhorn"}}]))
    # a pattern: the layer index comes first, the entry is the pattern's
    with pytest.raises(IncompatibleConfig, match=r"^layer 1: backbone\.layers\[1\]\.position\.kind='alibi' cannot be "
                                                 r"used with backbone\.layers\[1\]\.attention\.kind='performer'"):
        Backbone(_cfg(n_layers=4, layers=[{}, {"attention": {"kind": "performer"}, "position": {"kind": "alibi"}}]))


def test_a_build_error_of_a_layer_names_the_layer():
    with pytest.raises(ValueError, match=r"^layer 0: position\.kind='sinusoidal' needs an even backbone\.d_model, got 15$"):
        Backbone({**SMALL, "d_model": 15, "n_heads": 1, "n_layers": 2, "layers": [{"position": {"kind": "sinusoidal"}}, {}]})


def test_a_stack_that_cannot_differ_per_layer_is_refused():
    with pytest.raises(IncompatibleConfig, match=r"^backbone\.layers: backbone\.depth\.kind='universal' runs one shared "
                                                 r"block at every step, so its layers cannot differ; remove "
                                                 r"backbone\.layers, or use a depth kind with a block per layer: "
                                                 r"early_exit, fixed$"):
        Backbone(_cfg(n_layers=2, depth={"kind": "universal"}, layers=[{}, {}]))
    with pytest.raises(IncompatibleConfig, match=r"^backbone\.block\.kind='pre_norm' at layer 1 and "
                                                 r"backbone\.layers\[0\]\.block\.kind='reversible' at layer 0: a stack of "
                                                 r"'reversible' blocks runs as one function of its input"):
        Backbone(_cfg(n_layers=2, layers=[{"block": {"kind": "reversible"}}, {}]))
    x = torch.randn(2, 5, 16)  # every layer reversible, kernels differing: one reversible stack
    bb = Backbone(_cfg(n_layers=2, block={"kind": "reversible"}, layers=[{}, {"attention": {"kind": "strided", "stride": 2}}]))
    assert [type(b.attn).__name__ for b in bb.blocks] == ["DenseAttention", "StridedAttention"]
    assert torch.isfinite(bb(x).hidden).all()


def test_an_absolute_position_above_the_first_layer_is_refused_as_adding_nothing():
    with pytest.raises(IncompatibleConfig, match=r"^backbone\.layers\[1\]\.position\.kind='sinusoidal' adds its "
                                                 r"encoding to the first layer's input only, so at layer 1 it adds "
                                                 r"nothing"):
        Backbone(_cfg(n_layers=2, layers=[{}, {"position": {"kind": "sinusoidal"}}]))
    bb = Backbone(_cfg(n_layers=2, layers=[{}, {"position": {"kind": "learned", "per_layer": True}}]))
    assert bb.blocks[1].attn.position.table is not None  # a table of its own at layer 1


def test_early_exit_depth_runs_a_per_layer_stack():
    cfg = _cfg(n_layers=2, depth={"kind": "early_exit"}, layers=[{"attention": {"kind": "local", "block": 2, "memory": 2}}, {}])
    bb = Backbone(cfg)
    assert [type(b.attn).__name__ for b in bb.blocks] == ["Local1DAttention", "DenseAttention"]
    assert bb(torch.randn(1, 6, 16)).hidden.shape == (1, 6, 16)


def test_a_layer_without_incremental_form_refuses_a_cache_naming_it():
    bb = Backbone(_cfg(n_layers=3, layers=[{}, {"attention": {"kind": "routing"}}, {}]))
    with pytest.raises(NotImplementedError, match=r"backbone\.layers\[1\]\.attention\.kind='routing' \(layer 1 of 3: a "
                                                  r"stack decodes incrementally only if every layer can\) cannot keep"):
        bb.initial_state(2)


def test_the_encoder_takes_per_layer_kinds_and_the_decoder_refuses_them():
    m = EncoderDecoder({"encoder": {**SMALL, "n_layers": 2, "layers": [{"attention": {"kind": "sliding_window"}}, {}]},
                        "decoder": SMALL})
    assert [type(b.attn).__name__ for b in m.encoder.blocks] == ["SlidingWindowAttention", "DenseAttention"]
    with pytest.raises(IncompatibleConfig, match=r"^decoder\.layers: the decoder's layers use the decoder-wide "
                                                 r"attention, position and block; .* remove decoder\.layers$"):
        EncoderDecoderConfig.from_dict({"decoder": {"n_layers": 2, "layers": [{}, {}]}})


def test_a_run_config_sets_layers_as_a_list_and_an_index_override_is_refused_naming_the_key():
    cfg = compose("dt/hopper_medium_sparse_interleaved", ["backbone.layers=[{attention: {kind: local}}]"])
    assert OmegaConf.to_container(cfg.backbone.layers) == [{"attention": {"kind": "local"}}]
    with pytest.raises(ConfigError, match=r"^backbone\.layers must be a list, got \{'1': \{'attention': \{'kind': "
                                          r"'longformer'\}\}\} \[command line\]$"):
        compose("dt/hopper_medium_sparse_interleaved", ["backbone.layers.1.attention.kind=longformer"])
