"""The DT asks its backbone for the state tokens only (``output_tokens``): the last layer then
runs 1 query in 3 (causal) or 1 (last_action), with the same predictions, loss and gradients as
the full stack (taken through ``output_hidden_states=True``, which needs every token)."""

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
