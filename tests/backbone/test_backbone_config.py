"""Backbone configs (rl_tformers.backbone_config): field types, ranges, numbers and built configs."""

from __future__ import annotations

import dataclasses
import json
import typing

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf
from typer.testing import CliRunner

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.cli import app
from rl_tformers.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from rl_tformers.registry import REGISTRIES, SLOTS, RegistryError
from rl_tformers.runtime.run_config import ConfigError, compose

D, H = 16, 2


BASE = {"d_model": D, "n_heads": H, "n_layers": 2, "d_ff": 32, "dropout": 0.0, "attn_dropout": 0.0}


# ------------------------------------------------- slot config fields are checked by type
def _typed_fields():
    """(slot, kind, field, bad value) for every field of every registered kind: a string where
    the field takes no string, a number where it takes only strings."""
    out = []
    for slot in SLOTS:
        for e in REGISTRIES[slot]:
            hints = typing.get_type_hints(e.config_cls)
            for f in dataclasses.fields(e.config_cls):
                bad = 3 if hints[f.name] is str else "x"
                out.append(pytest.param(slot, e.kind, f.name, bad, id=f"{slot}.{e.kind}.{f.name}"))
    return out


@pytest.mark.parametrize(("slot", "kind", "field", "bad"), _typed_fields())
def test_every_slot_field_of_the_wrong_type_is_refused_naming_it(slot, kind, field, bad):
    """Each wrong type is refused naming the field (not a deep TypeError such as "'<' not
    supported between 'str' and 'int'", nor accepted to fail in forward or silently)."""
    with pytest.raises(RegistryError, match=rf"backbone\.{slot}\.{field} must be "):
        BackboneConfig.from_dict({slot: {"kind": kind, field: bad}})


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"attention": {"kind": "sinkhorn", "block_size": 2.5}},
            r"backbone\.attention\.block_size must be an integer, got 2\.5",
        ),
        (
            {"attention": {"kind": "bigbird", "global_tokens": 0}},
            r"backbone\.attention\.global_tokens must be a list of integers",
        ),
        (
            {"attention": {"kind": "performer", "orthogonal": 0}},
            r"backbone\.attention\.orthogonal must be true or false",
        ),
        (
            {"attention": {"kind": "routing", "n_clusters": True}},
            r"backbone\.attention\.n_clusters must be an integer",
        ),
        (
            {"attention": {"kind": "rfa", "sigma_init": float("nan")}},
            r"backbone\.attention\.sigma_init must be a finite number",
        ),
        (
            {"position": {"kind": "distance_aware", "alpha_init": float("inf")}},
            r"backbone\.position\.alpha_init must be a finite",
        ),
        ({"memory": {"kind": "knn", "top_k": 2.0}}, r"backbone\.memory\.top_k must be an integer"),
        ({"memory": {"kind": "xl", "detach": 1}}, r"backbone\.memory\.detach must be true or false"),
        (
            {"depth": {"kind": "universal", "max_steps": 2.0}},
            r"backbone\.depth\.max_steps must be an integer or null",
        ),
        (
            {"attention": {"kind": "local_2d", "query_shape": [4]}},
            r"backbone\.attention\.query_shape must be a list of 2 integers",
        ),
    ],
)
def test_wrong_types_are_refused_naming_the_field(cfg, message):
    with pytest.raises(RegistryError, match=message):
        Backbone({**BASE, "causal": False, **cfg})


def test_configs_built_in_python_are_checked_and_lists_become_tuples():
    from rl_tformers.attention.bigbird import BigBirdConfig
    from rl_tformers.attention.sinkhorn import SinkhornConfig
    from rl_tformers.registry import FieldError

    with pytest.raises(FieldError, match=r"attention\.block_size must be an integer, got True"):
        SinkhornConfig(block_size=True)
    with pytest.raises(FieldError, match="temperature"):
        SinkhornConfig(temperature=float("nan"))
    cfg = BigBirdConfig(global_tokens=[0, 3])
    assert cfg.global_tokens == (0, 3)
    hash(cfg)  # frozen configs stay hashable
    assert dataclasses.replace(cfg, block=4).block == 4


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"position": {"kind": "sinusoidal", "base": 0.0}}, "base"),
        ({"position": {"kind": "xl_relative", "base": -1.0}}, "base"),
        ({"position": {"kind": "rotary", "base": 0}}, "base"),
        ({"attention": {"kind": "sinkhorn", "sort_hidden": -1}}, "sort_hidden"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_field(cfg, message):
    """Old code: a non-positive base failed in forward (math domain error), a negative SortNet
    width in torch ('negative dimension')."""
    with pytest.raises(RegistryError, match=message):
        Backbone({**BASE, **cfg})


# -- numbers of other types in configs ------------------------------------------------------------
def test_numpy_numbers_in_a_config_are_stored_as_python_numbers_and_dump_everywhere() -> None:
    """NumPy scalars (a sweep over ``np.arange`` / ``np.linspace``) are stored as built-in ints
    and floats, in the backbone fields and in slot configs, so ``to_dict()`` can be written
    (``yaml.safe_dump``, ``OmegaConf.create`` and ``json.dumps`` refuse NumPy scalars)."""
    cfg = BackboneConfig.from_dict({
        "d_model": np.int64(16), "n_heads": np.int32(2), "n_layers": np.int64(1), "d_ff": np.int16(24),
        "dropout": np.float64(0.25), "attn_dropout": np.float32(0.5), "activation": np.str_("relu"),
        "attention": {"kind": "local", "block": np.int64(4), "memory": np.int64(4)},
        "position": {"kind": "rotary", "base": np.float32(500.0)},
        "memory": {"kind": "xl", "mem_len": np.int64(6)},
    })
    assert [type(v) for v in (cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.d_ff)] == [int] * 4
    assert (type(cfg.dropout), type(cfg.attn_dropout), type(cfg.activation)) == (float, float, str)
    assert (cfg.dropout, cfg.attn_dropout, cfg.activation) == (0.25, 0.5, "relu")
    assert (type(cfg.attention.block), type(cfg.position.base), type(cfg.memory.mem_len)) == (int, float, int)
    assert (cfg.attention.block, cfg.position.base, cfg.memory.mem_len) == (4, 500.0, 6)
    d = cfg.to_dict()
    assert BackboneConfig.from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg
    assert BackboneConfig.from_dict(OmegaConf.to_container(OmegaConf.create(d))) == cfg
    assert BackboneConfig.from_dict(json.loads(json.dumps(d))) == cfg
    # built in Python, without from_dict
    direct = BackboneConfig(d_model=np.int64(8), n_heads=np.int64(2), dropout=np.float32(0.5))
    assert (type(direct.d_model), type(direct.n_heads), type(direct.dropout)) == (int, int, float)
    yaml.safe_dump(direct.to_dict())


# -- config objects where a mapping is expected -----------------------------------------------
def test_built_configs_are_taken_where_a_config_mapping_is_expected() -> None:
    """``BackboneConfig.from_dict(cfg)`` and ``EncoderDecoder({"encoder": BackboneConfig(...)})``
    take a built config as it is (as the slot registries do); anything else, such as
    ``Backbone("sdpa")``, is a TypeError saying what is expected."""
    cfg = BackboneConfig(d_model=8, n_heads=2, n_layers=1)
    assert BackboneConfig.from_dict(cfg) is cfg
    enc, dec = cfg.replace(causal=False), cfg.replace(block={"kind": "pre_norm"})
    edc = EncoderDecoderConfig.from_dict({"encoder": enc, "decoder": dec})
    assert edc.encoder is enc and edc.decoder is dec
    assert EncoderDecoderConfig.from_dict(edc) is edc
    model = EncoderDecoder({"encoder": enc, "decoder": dec})
    assert model.config.encoder is enc and model(torch.randn(2, 3, 8), torch.randn(2, 4, 8)).hidden.shape == (2, 4, 8)
    with pytest.raises(TypeError, match=r"^backbone: expected a BackboneConfig or a mapping of its fields .*got str$"):
        Backbone("sdpa")
    with pytest.raises(TypeError, match=r"^encoder: expected a BackboneConfig or a mapping of its fields, got list$"):
        EncoderDecoderConfig.from_dict({"encoder": [("d_model", 8)]})
    with pytest.raises(TypeError, match=r"^encoder_decoder: expected an EncoderDecoderConfig or a mapping"):
        EncoderDecoder("vanilla")


# ------------------------------------------------------------------- backbone numbers
@pytest.mark.parametrize("override, expected", [
    ("backbone.attn_dropout=2", "backbone.attn_dropout must be a probability in [0, 1), got 2"),
    ("backbone.dropout=1.5", "backbone.dropout must be a probability in [0, 1), got 1.5"),
    ("backbone.ffn_dropout=-0.1", "backbone.ffn_dropout must be a probability in [0, 1) or null (= backbone.dropout), "
                                  "got -0.1"),
    ("backbone.d_ff=-4", "backbone.d_ff must be an integer >= 1 or null (4 * d_model), got -4"),
    ("backbone.d_ff=0", "backbone.d_ff must be an integer >= 1 or null (4 * d_model), got 0"),
    ("backbone.d_model=16.0", "backbone.d_model must be an integer >= 1, got 16.0"),
    ("backbone.max_position=-1", "backbone.max_position must be an integer >= 1, got -1"),
    ("backbone.n_heads='2'", "backbone.n_heads must be an integer >= 1, got '2'"),
    ("backbone.causal=maybe", "backbone.causal must be true or false, got 'maybe'"),
])
def test_backbone_numbers_are_checked_with_their_key(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose(None, ["agent.kind=toy", override])
    assert str(info.value) == expected


runner = CliRunner()


# -- the hint "rl-tformers backbones lists them" points to a command that lists no fields --------
def test_unknown_field_hint_leads_to_the_kinds_that_have_it() -> None:
    with pytest.raises(ConfigError) as info:
        compose(overrides=["agent.kind=dt", "backbone.attention.window=3"])
    msg = str(info.value)
    assert "backbone.attention.window" in msg
    if "sliding_window" in msg:  # the message itself names a kind with a `window` field
        return
    assert "rl-tformers backbones" in msg
    r = runner.invoke(app, ["backbones", "--slot", "attention", "--json"])
    assert r.exit_code == 0, r.output
    entry = next(e for e in json.loads(r.stdout) if e["kind"] == "sliding_window")
    listed = json.dumps({k: v for k, v in entry.items() if k not in ("description", "paper", "kind", "slot")})
    assert "window" in listed, f"the error sends the user to `rl-tformers backbones`, which lists no fields: {entry}"
