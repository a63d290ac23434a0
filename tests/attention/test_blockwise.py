"""Blockwise attention (BlockBERT): the capabilities its configuration declares, and the head
assignments it refuses."""

from __future__ import annotations

import pytest

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.registry import ATTENTION


def test_subquadratic_only_with_a_fixed_block_length():
    """Fixed n_blocks (the paper's setting, the default) costs L^2 / n: not subquadratic; a fixed
    block length b costs L b: subquadratic. The kind's listing shows the default's flag."""
    assert ATTENTION.get("blockwise").capabilities.subquadratic is False
    cfg = BackboneConfig(n_heads=2, causal=False, attention={"kind": "blockwise"})
    assert cfg.attention.config_capabilities().subquadratic is False
    cfg = BackboneConfig(n_heads=2, causal=False, attention={"kind": "blockwise", "block": 64})
    caps = cfg.attention.config_capabilities()
    assert caps.subquadratic is True
    assert caps.causal is False and caps.exact is True  # the other flags stay the kind's


@pytest.mark.parametrize(("heads", "n_blocks"), [(1, 2), (2, 3), (3, 4)])
def test_fewer_heads_than_blocks_is_refused_naming_the_fields(heads, n_blocks):
    """With the default split H // n heads per shift, H < n gives the shifts k >= 1 no head: one
    head would silently be block-diagonal attention (kind local)."""
    with pytest.raises(IncompatibleConfig) as err:
        Backbone({"d_model": 12, "n_heads": heads, "causal": False,
                  "attention": {"kind": "blockwise", "n_blocks": n_blocks}})
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"backbone.n_heads={heads} leaves the shifts 1..{n_blocks - 1} of "
                          f"backbone.attention.n_blocks={n_blocks} without a head")
    assert "backbone.attention.heads_per_shift" in msg


def test_every_shift_with_a_head_or_an_explicit_assignment_builds():
    Backbone({"d_model": 12, "n_heads": 2, "causal": False, "attention": {"kind": "blockwise", "n_blocks": 2}})
    bb = Backbone({"d_model": 12, "n_heads": 3, "causal": False, "attention": {"kind": "blockwise", "n_blocks": 3}})
    assert bb.blocks[0].attn.shifts == [0, 1, 2]
    bb = Backbone({"d_model": 12, "n_heads": 1, "causal": False,
                   "attention": {"kind": "blockwise", "n_blocks": 2, "heads_per_shift": [0, 1]}})
    assert bb.blocks[0].attn.shifts == [1]
