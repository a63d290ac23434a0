"""Defects the lead found in session 6, each pinned by a test."""

from __future__ import annotations

import warnings

import pytest

from rl_tformers.backbone import Backbone
from rl_tformers.config import BackboneConfig


def _build(kind: str, attn_dropout: float, causal: bool = True) -> list[str]:
    cfg = BackboneConfig.from_dict(
        {"d_model": 32, "n_heads": 2, "n_layers": 3, "attn_dropout": attn_dropout, "causal": causal,
         "attention": {"kind": kind}}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Backbone(cfg)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("kind", ["performer", "rfa"])
def test_linear_attention_says_once_that_attention_dropout_is_not_applied(kind):
    # performer/rfa form no probabilities: attn_dropout=0.1 (the DT default) was dropped silently
    msgs = _build(kind, 0.1)
    assert msgs == [
        f"backbone.attention.kind={kind!r} forms no attention probabilities, so backbone.attn_dropout=0.1 "
        "is not applied (residual and feed-forward dropout still are); set backbone.attn_dropout=0 to say "
        "so and silence this warning"
    ]
    assert _build(kind, 0.0) == []


def test_kernels_with_probabilities_do_not_warn_about_attention_dropout():
    assert _build("sdpa", 0.1) == []
    assert _build("linformer", 0.1, causal=False) == []
