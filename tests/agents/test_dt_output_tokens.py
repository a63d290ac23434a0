"""The DT asks its backbone for the state tokens only (``output_tokens``): the last layer then
runs 1 query in 3 (causal) or 1 (last_action), with the same predictions, loss and gradients as
the full stack (taken through ``output_hidden_states=True``, which needs every token); with
``predict_at``, one state token per row (acting), the full prediction at those steps."""

from __future__ import annotations

import pytest
import torch
from rl_tformers.agents.decision_transformer.loss import dt_loss
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig

OBS, ACT, K = 5, 3, 6


def _model(mode: str, block: str) -> DecisionTransformer:
    torch.manual_seed(0)
    bb = {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
          "block": {"kind": block}, "causal": mode == "causal"}
    return DecisionTransformer(DTConfig(obs_dim=OBS, act_dim=ACT, context_len=K, max_ep_len=50, embed_dropout=0.0,
                                        mode=mode, backbone=bb))


def _batch(b: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(b, K, dtype=torch.bool)
    mask[1, :2] = False  # left padding, as the window sampler pads
    mask[2, :5] = False
    return {"obs": torch.randn(b, K, OBS, generator=g), "actions": torch.rand(b, K, ACT, generator=g) * 2 - 1,
            "rtg": torch.randn(b, K, generator=g), "timesteps": torch.arange(K).repeat(b, 1), "mask": mask}


@pytest.mark.parametrize("block", ["pre_norm", "post_norm"])
@pytest.mark.parametrize("mode", ["causal", "last_action"])
def test_state_tokens_only_same_predictions_loss_and_gradients(mode, block):
    m, batch = _model(mode, block), _batch()
    queries = []
    hook = m.backbone.blocks[-1].attn.register_forward_hook(lambda mod, a, o: queries.append(a[0].shape[1]))
    out = m(batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    full = m(batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"], output_hidden_states=True)
    hook.remove()
    n = 3 * K - (mode == "last_action")
    assert queries == [K if mode == "causal" else 1, n]  # the fast path, then the full stack
    p = K if mode == "causal" else 1
    assert out.mean.shape == full.mean.shape == (4, p, ACT)
    torch.testing.assert_close(out.mean, full.mean, rtol=1e-5, atol=1e-6)

    loss, _ = dt_loss(m, batch)
    grads = torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)
    m.backbone.query_subset = False  # the full stack, then the slice
    loss_full, _ = dt_loss(m, batch)
    grads_full = torch.autograd.grad(loss_full, list(m.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, loss_full, rtol=1e-6, atol=1e-7)
    for g, gf in zip(grads, grads_full, strict=True):
        if gf is None:
            assert g is None
        else:
            torch.testing.assert_close(g, gf, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("block", ["pre_norm", "post_norm"])
def test_predict_at_one_step_per_row_equals_the_full_prediction_there(block):
    """``predict_at`` (B,): the prediction at that step of each row (different per row, padded
    rows included), P = 1, its last layer running 1 query per row; the same values, features and
    per-layer states as the full forward at those steps."""
    m, batch = _model("causal", block), _batch()
    args = (batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    at = torch.tensor([0, 5, K - 1, 3])  # row 1 has 2 padded steps, row 2 has 5
    rows = torch.arange(4)
    queries = []
    hook = m.backbone.blocks[-1].attn.register_forward_hook(lambda mod, a, o: queries.append(a[0].shape[1]))
    with torch.no_grad():
        m.eval()
        one = m(*args, predict_at=at)
        full = m(*args)
        hs_one = m(*args, predict_at=at, output_hidden_states=True).hidden_states
        hs_full = m(*args, output_hidden_states=True).hidden_states
    hook.remove()
    assert queries[:2] == [1, K]
    assert one.action.shape == (4, 1, ACT) and one.features.shape == (4, 1, 32)
    for name in ("action", "mean", "features"):
        torch.testing.assert_close(getattr(one, name)[:, 0], getattr(full, name)[rows, at], rtol=0, atol=1e-6)
    for h1, hf in zip(hs_one, hs_full, strict=True):
        torch.testing.assert_close(h1[:, 0], hf[rows, at], rtol=0, atol=0)


def test_predict_at_with_early_exit_gathers_the_deciding_steps():
    torch.manual_seed(0)
    bb = {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
          "depth": {"kind": "early_exit", "confidence": "saturation"}}
    m = DecisionTransformer(DTConfig(obs_dim=OBS, act_dim=ACT, context_len=K, max_ep_len=50, embed_dropout=0.0,
                                     backbone=bb)).eval()
    batch = _batch()
    args = (batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    at = torch.tensor([1, 5, K - 1, 0])
    decide = torch.nn.functional.one_hot(at, K).bool()
    with torch.no_grad():
        one = m.forward_early_exit(*args, predict_at=at, exit_threshold=0.5)
        full = m.forward_early_exit(*args, exit_steps=decide, exit_threshold=0.5)
    assert one.metrics["exit/mean_layer"] == full.metrics["exit/mean_layer"]  # the same tokens decide
    torch.testing.assert_close(one.action[:, 0], full.action[torch.arange(4), at], rtol=0, atol=1e-6)


def test_predict_at_is_refused_when_it_cannot_apply():
    batch = _batch()
    args = (batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    m = _model("causal", "pre_norm").eval()
    for at, why in ((torch.tensor([0, 1, K, 2]), rf"predict_at holds step {K}, outside the window's \[0, {K}\)"),
                    (torch.tensor([0, -1, 0, 0]), r"predict_at holds step -1"),
                    (torch.zeros(4, 1, dtype=torch.long), r"predict_at must be a \(B,\) integer tensor"),
                    (torch.zeros(4), r"predict_at must be a \(B,\) integer tensor of step slots, got torch.float32")):
        with pytest.raises(ValueError, match=why):
            m(*args, predict_at=at)
    last = _model("last_action", "pre_norm").eval()
    with pytest.raises(ValueError, match="predict_at needs agent.mode=causal"):
        last(*args, predict_at=torch.zeros(4, dtype=torch.long))
