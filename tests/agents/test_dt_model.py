"""Decision Transformer model and loss: causality, padding invariance, modes, heads."""

from __future__ import annotations

import pytest
import torch
from rl_tformers.agents.decision_transformer.loss import dt_loss
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig

OBS, ACT, K = 5, 3, 6


def _model(**kw) -> DecisionTransformer:
    bb = {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    bb.update(kw.pop("backbone", {}))
    cfg = DTConfig(obs_dim=OBS, act_dim=kw.pop("act_dim", ACT), context_len=K, max_ep_len=50, embed_dropout=0.0, backbone=bb, **kw)
    return DecisionTransformer(cfg).eval()


def _batch(b=4, discrete=False, n_act=ACT):
    g = torch.Generator().manual_seed(1)
    actions = torch.randint(0, n_act, (b, K), generator=g) if discrete else torch.rand(b, K, n_act, generator=g) * 2 - 1
    return {
        "obs": torch.randn(b, K, OBS, generator=g),
        "actions": actions,
        "rtg": torch.randn(b, K, generator=g),
        "timesteps": torch.arange(K).repeat(b, 1) + 3,
        "mask": torch.ones(b, K, dtype=torch.bool),
    }


def _fwd(m, batch):
    return m(batch["obs"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])


@pytest.mark.parametrize("position", ["none", "learned", "rotary", "alibi"])
def test_perturbing_action_t_and_later_does_not_change_predicted_action_t(position):
    from rl_tformers.registry import POSITION

    if position not in POSITION:
        pytest.skip(f"position kind {position} not registered yet")
    m = _model(backbone={"position": {"kind": position}})
    batch = _batch()
    ref = _fwd(m, batch).action  # (B, K, A)
    for t in range(K):
        pert = dict(batch)
        a = batch["actions"].clone()
        a[:, t:] = torch.rand_like(a[:, t:]) * 2 - 1  # a_t, a_t+1, ...
        pert["actions"] = a
        o = pert["obs"].clone()
        o[:, t + 1 :] += 10.0  # later states too
        pert["obs"] = o
        r = pert["rtg"].clone()
        r[:, t + 1 :] -= 7.0  # and later returns-to-go
        pert["rtg"] = r
        out = _fwd(m, pert).action
        torch.testing.assert_close(out[:, : t + 1], ref[:, : t + 1], atol=1e-6, rtol=0)
        # the perturbation does reach later predictions (the test can fail)
        if t + 1 < K:
            assert (out[:, t + 1 :] - ref[:, t + 1 :]).abs().max() > 1e-4


def test_autograd_zero_jacobian_from_action_t_to_prediction_t():
    m = _model()
    batch = _batch(b=1)
    acts = batch["actions"].clone().requires_grad_(True)
    out = m(batch["obs"], acts, batch["rtg"], batch["timesteps"], batch["mask"]).action
    t = 2
    (g,) = torch.autograd.grad(out[0, t].sum(), acts)
    assert torch.count_nonzero(g[0, t:]) == 0
    assert torch.count_nonzero(g[0, :t]) > 0


@pytest.mark.parametrize("mode", ["causal", "last_action"])
def test_perturbing_padded_steps_changes_nothing(mode):
    kw = {"mode": mode}
    if mode == "last_action":
        kw["backbone"] = {"causal": False}
    m = _model(**kw)
    batch = _batch()
    mask = torch.ones(4, K, dtype=torch.bool)
    if mode == "causal":
        mask[:, 4:] = False  # align="start": padding at the end
        mask[1, 1:] = False
    else:
        mask[:, :3] = False  # align="end": padding at the start
        mask[2, :-1] = False
    batch["mask"] = mask
    ref = _fwd(m, batch).action
    pert = {k: v.clone() for k, v in batch.items()}
    pad = ~mask
    pert["obs"][pad] = 1e3
    pert["actions"][pad] = -0.9
    pert["rtg"][pad] = 1e4
    pert["timesteps"][pad] = 10_000  # beyond max_ep_len: padding never indexes the table
    out = _fwd(m, pert).action
    if mode == "causal":
        torch.testing.assert_close(out[mask], ref[mask], atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    # and changing a real step does change the output (the test can fail)
    pert["obs"][:, -1] += 5.0
    pert["obs"][mask] += 1.0
    assert (_fwd(m, pert).action - ref).abs().max() > 1e-4


def test_padding_timestep_index_never_shared_with_a_real_step():
    m = _model()
    ts = torch.tensor([[0, 1, 2, 0, 0, 0]])
    mask = torch.tensor([[True, True, True, False, False, False]])
    assert m.timestep_index(ts, mask).tolist() == [[1, 2, 3, 0, 0, 0]]


def test_timestep_past_max_ep_len_raises_clear_error():
    m = _model()
    batch = _batch(b=1)
    batch["timesteps"][0, -1] = 50
    with pytest.raises(ValueError, match=r"timestep 50 is outside \[0, agent.max_ep_len=50\)"):
        _fwd(m, batch)
    m.train()  # an update checks no range (no host sync); the embedding lookup still refuses it
    with pytest.raises(IndexError):
        _fwd(m, batch)


def test_last_action_mode_predicts_one_action_and_ignores_last_action_input():
    m = _model(mode="last_action", backbone={"causal": False})
    batch = _batch()
    out = _fwd(m, batch).action
    assert out.shape == (4, 1, ACT)
    pert = dict(batch)
    a = batch["actions"].clone()
    a[:, -1] = 0.77
    pert["actions"] = a
    torch.testing.assert_close(_fwd(m, pert).action, out, atol=0, rtol=0)
    # an earlier action does matter (bidirectional window over the past)
    a2 = batch["actions"].clone()
    a2[:, 0] = 0.9
    pert["actions"] = a2
    assert (_fwd(m, pert).action - out).abs().max() > 1e-5


def test_causal_mode_refuses_bidirectional_backbone():
    with pytest.raises(ValueError, match="agent.mode=causal needs backbone.causal=true"):
        _model(backbone={"causal": False})


def test_loss_ignores_padded_steps_exactly():
    m = _model()
    batch = _batch()
    batch["mask"][:, 3:] = False
    loss, _ = dt_loss(m, batch)
    out = _fwd(m, batch).action
    expect = ((out[:, :3] - batch["actions"][:, :3]) ** 2).mean()
    torch.testing.assert_close(loss, expect, atol=1e-7, rtol=0)
    batch["actions"][:, 3:] = 0.5  # targets at padded steps do not count
    torch.testing.assert_close(dt_loss(m, batch)[0], expect, atol=1e-7, rtol=0)


def test_discrete_cross_entropy_over_unpadded_steps():
    m = _model(discrete=True, act_dim=4)
    batch = _batch(discrete=True, n_act=4)
    batch["mask"][:, 4:] = False
    loss, metrics = dt_loss(m, batch)
    out = _fwd(m, batch)
    expect = torch.nn.functional.cross_entropy(out.logits[:, :4].reshape(-1, 4), batch["actions"][:, :4].reshape(-1))
    torch.testing.assert_close(loss, expect, atol=1e-6, rtol=0)
    assert out.action.shape == (4, K)


def test_gaussian_head_trains_temperature_and_is_finite():
    m = _model(head="gaussian").train()
    batch = _batch()
    loss, metrics = dt_loss(m, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert m.log_temperature.grad is not None and m.log_temperature.grad.abs() > 0
    # temperature gradient sign: entropy above target -> lower the temperature
    ent = float(metrics["entropy"])
    expect_sign = 1.0 if ent > m.target_entropy else -1.0
    assert torch.sign(m.log_temperature.grad).item() == expect_sign


def test_every_parameter_gets_a_gradient():
    m = _model().train()
    loss, _ = dt_loss(m, _batch())
    loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert missing == []


def _kinds(causal: bool) -> list[str]:
    from rl_tformers.registry import all_entries

    return [e.kind for e in all_entries() if e.slot == "attention" and e.capabilities.causal == causal]


@pytest.mark.parametrize("kind", _kinds(causal=False))
def test_kernels_without_causal_form_train_in_last_action_mode(kind):
    """Every registered kind without a causal form is refused in causal mode and trains in last_action mode."""
    from rl_tformers.backbone import IncompatibleConfig

    with pytest.raises(IncompatibleConfig, match="agent.mode=last_action"):
        _model(backbone={"attention": {"kind": kind}})
    m = _model(mode="last_action", backbone={"attention": {"kind": kind}, "causal": False}).train()
    batch = _batch()
    batch["mask"][:, :2] = False  # align="end" windows: padding on the left
    loss, _ = dt_loss(m, batch)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_embed_init_gpt2_or_the_official_codes_pytorch_defaults():
    torch.manual_seed(0)
    gpt2 = DecisionTransformer(DTConfig(obs_dim=OBS, act_dim=ACT, backbone={"d_model": 64, "n_layers": 1}))
    torch.manual_seed(0)
    paper = DecisionTransformer(DTConfig(obs_dim=OBS, act_dim=ACT, embed_init="paper",
                                         backbone={"d_model": 64, "n_layers": 1}))
    for m in (gpt2.embed_return, gpt2.embed_state, gpt2.embed_action, gpt2.head):
        assert torch.count_nonzero(m.bias) == 0
    assert abs(gpt2.embed_timestep.weight.std().item() - 0.02) < 0.002
    # official code: nn.Embedding N(0, 1); nn.Linear(1, d) weight and bias U(-1, 1)
    assert abs(paper.embed_timestep.weight.std().item() - 1.0) < 0.05
    for p in (paper.embed_return.weight, paper.embed_return.bias):
        assert p.abs().max().item() <= 1.0 and p.abs().max().item() > 0.9
    with pytest.raises(ValueError, match="agent.embed_init='xavier'"):
        DTConfig(obs_dim=OBS, act_dim=ACT, embed_init="xavier")


@pytest.mark.parametrize("discrete", [False, True])
def test_forward_early_exit_runs_the_same_tokens_layer_by_layer(discrete):
    """``forward`` is the full model; ``forward_early_exit`` at threshold +inf gives its outputs bit
    for bit, and at threshold 0 every deciding state token exits after layer 1 with the head's
    prediction from that layer's output (final norm, then head)."""
    torch.manual_seed(0)
    m = _model(backbone={"n_layers": 3, "depth": {"kind": "early_exit", "confidence": "saturation"}},
               discrete=discrete)
    b = _batch(discrete=discrete)
    args = (b["obs"], b["actions"], b["rtg"], b["timesteps"], b["mask"])
    with torch.no_grad():
        full = m(*args, output_hidden_states=True)
        never = m.forward_early_exit(*args, exit_threshold=float("inf"))
        first = m.forward_early_exit(*args, exit_threshold=0.0)
    assert torch.equal(never.action, full.action) and torch.equal(never.features, full.features)
    assert float(never.metrics["exit/mean_layer"]) == 3.0 and float(first.metrics["exit/mean_layer"]) == 1.0
    layer1 = m.predict(m.backbone.final_norm(full.hidden_states[0]))  # hidden_states[n]: after layer n + 1
    assert torch.equal(first.action, layer1.action)


def test_forward_early_exit_needs_the_early_exit_depth_kind():
    b = _batch()
    with pytest.raises(ValueError, match="backbone.depth.kind=early_exit"):
        _model().forward_early_exit(b["obs"], b["actions"], b["rtg"], b["timesteps"], b["mask"], exit_threshold=0.0)
