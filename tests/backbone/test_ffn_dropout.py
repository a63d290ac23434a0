"""``backbone.ffn_dropout``: dropout on the feed-forward hidden layer (default: ``dropout``)."""

from __future__ import annotations

from rl_tformers import Backbone
from rl_tformers.backbone_config import BackboneConfig


def test_ffn_dropout_defaults_to_dropout_and_can_be_set_apart() -> None:
    default = Backbone(BackboneConfig(d_model=8, n_layers=2, n_heads=1, dropout=0.2))
    assert [b.ffn.dropout.p for b in default.blocks] == [0.2, 0.2]
    gpt2 = Backbone(BackboneConfig.from_dict({"d_model": 8, "n_layers": 2, "n_heads": 1, "dropout": 0.2,
                                              "ffn_dropout": 0.0}))
    assert [b.ffn.dropout.p for b in gpt2.blocks] == [0.0, 0.0]
    assert [b.dropout.p for b in gpt2.blocks] == [0.2, 0.2]  # residual dropout unchanged
    assert gpt2.config.to_dict()["ffn_dropout"] == 0.0 and default.config.ffn_dropout is None
