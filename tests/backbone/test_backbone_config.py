"""The Backbone class (rl_tformers.backbone): dtypes, episode isolation, states, weights, empty inputs."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.registry import REGISTRIES, SLOTS, RegistryError

D, H = 16, 2


BASE = {"d_model": D, "n_heads": H, "n_layers": 2, "d_ff": 32, "dropout": 0.0, "attn_dropout": 0.0}


# ------------------------------------------------- 1: slot config fields are checked by type
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
    """Old code: wrong types got deep TypeErrors without the field ('<' not supported between
    'str' and 'int'), were accepted and failed in forward, or were silently accepted."""
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
def test_wrong_types_that_old_code_accepted_or_crashed_on(cfg, message):
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
