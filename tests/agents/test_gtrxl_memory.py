"""GTrXL agent: identity initialisation, memory as explicit state, resets, detached memory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, build_backbone, gtrxl_backbone

from rl_tformers.attention.sdpa import SDPAConfig
from rl_tformers.backbone import IncompatibleConfig
from rl_tformers.registry import ATTENTION, Capabilities, Entry


def small_cfg(**kw) -> GTrXLConfig:
    bb = gtrxl_backbone(d_model=32, n_layers=2, n_heads=2, mem_len=kw.pop("mem_len", 16))
    bb.update(kw.pop("backbone", {}))
    return GTrXLConfig(obs_dim=kw.pop("obs_dim", 3), act_dim=kw.pop("act_dim", 2), backbone=bb, **kw)


def policy_for(model: GTrXLModel, obs_dim: int = 3, act_dim: int = 2) -> GTrXLPolicy:
    return GTrXLPolicy(
        model,
        obs_mean=np.zeros(obs_dim, np.float32),
        obs_std=np.ones(obs_dim, np.float32),
        action_low=-np.ones(act_dim, np.float32),
        action_high=np.ones(act_dim, np.float32),
        rtg_scale=10.0,
    )


# -- identity initialisation ----------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["gru", "output", "highway", "sigmoid_tanh"])
def test_huge_gate_bias_makes_every_block_the_identity(gate):
    bb = gtrxl_backbone(d_model=32, n_layers=3, n_heads=2, mem_len=8, gate=gate, gate_bias=1e4)
    bb["final_norm"] = False
    backbone = build_backbone(bb)
    x = torch.randn(2, 5, 32)
    out = backbone(x, state=backbone.initial_state(2))
    assert torch.equal(out.hidden, x)
    for layer in range(3):  # the gate passes the residual stream through: z = 0 (or s = 1 for highway)
        g = float(out.metrics[f"layer{layer}/gate_attn"])
        assert g == (1.0 if gate == "highway" else 0.0)


def test_gate_bias_two_starts_close_to_the_identity_path():
    torch.manual_seed(0)
    x = torch.randn(4, 10, 64)

    def run(block: dict) -> tuple[torch.Tensor, dict]:
        bb = gtrxl_backbone(d_model=64, n_layers=3, n_heads=4, mem_len=8)
        bb.update(final_norm=False, block=block)
        backbone = build_backbone(bb)
        with torch.no_grad():
            out = backbone(x, state=backbone.initial_state(4))
        return torch.nn.functional.cosine_similarity(out.hidden, x, dim=-1).mean(), out.metrics

    cos2, metrics = run({"kind": "gated", "gate": "gru", "gate_bias": 2.0})
    for layer in range(3):
        for which in ("attn", "ffn"):
            z = float(metrics[f"layer{layer}/gate_{which}"])
            # z = sigmoid(W_z y + U_z x - 2) with zero-mean W_z y + U_z x: close to sigmoid(-2) = 0.1192
            assert abs(z - 0.1192) < 0.03, (layer, which, z)
    cos0, _ = run({"kind": "gated", "gate": "gru", "gate_bias": 0.0})
    cos_pre, _ = run({"kind": "pre_norm"})
    # after 3 blocks the output still points along the input (measured 0.984), unlike b_g = 0
    # (0.32) or a pre-norm stack of the same size (0.90)
    assert cos2 > 0.97 and cos2 > cos_pre and cos0 < 0.6, (cos2, cos_pre, cos0)


# -- step-wise inference == segment forward ---------------------------------------------------------
def test_policy_step_by_step_equals_one_segment_forward():
    torch.manual_seed(1)
    cfg = small_cfg(rtg_input=True, prev_action_input=True, prev_reward_input=True, mem_len=16)
    model = GTrXLModel(cfg).eval()
    pol = policy_for(model)
    n, length = 3, 12
    obs = np.random.default_rng(0).normal(size=(length, n, 3)).astype(np.float32)
    rew = np.random.default_rng(1).normal(size=(length, n))
    state = pol.initial_state(n, target_return=20.0)
    acts, feats = [], []
    for t in range(length):
        a, state = pol.act(obs[t], state, np.full(n, t == 0), None if t == 0 else rew[t - 1])
        acts.append(torch.as_tensor(a))
    actions = torch.stack(acts, 1)  # (N, L, A) in [-1, 1] bounds == normalised units here
    # the same episode as one segment
    rtg = 20.0 - np.concatenate([np.zeros((1, n)), np.cumsum(rew[:-1], 0)], 0)  # (L, N)
    prev_r = np.concatenate([np.zeros((1, n)), rew[:-1]], 0)
    prev_a = torch.cat([torch.zeros(n, 1, 2), actions[:, :-1]], 1)
    enc = model.encoder
    x = enc.inputs(
        torch.as_tensor(obs).transpose(0, 1),
        torch.as_tensor(rtg / 10.0, dtype=torch.float32).T,
        prev_a,
        torch.as_tensor(prev_r, dtype=torch.float32).T,
    )
    with torch.no_grad():
        full = enc(x, torch.arange(length).expand(n, length), state=enc.initial_state(n))
        full_actions = model.actor.mode(full.features)
    torch.testing.assert_close(full_actions, actions, atol=1e-5, rtol=0)
    del feats


def test_sixteen_steps_equal_two_segments_of_eight_with_memory_eight():
    torch.manual_seed(2)
    model = GTrXLModel(small_cfg(mem_len=8)).eval()
    enc = model.encoder
    x = enc.inputs(torch.randn(2, 16, 3))
    pos = torch.arange(16).expand(2, 16) + torch.tensor([[0], [5]])  # any absolute offset
    with torch.no_grad():
        full = enc(x, pos, state=enc.initial_state(2))
        a = enc(x[:, :8], pos[:, :8], state=enc.initial_state(2))
        b = enc(x[:, 8:], pos[:, 8:], state=a.state)
    torch.testing.assert_close(torch.cat([a.features, b.features], 1), full.features, atol=1e-5, rtol=0)
    for la, lb in zip(full.state.layers, b.state.layers):
        torch.testing.assert_close(la.memory, lb.memory, atol=1e-5, rtol=0)
    assert torch.equal(full.state.pos, b.state.pos) and torch.equal(full.state.valid, b.state.valid)


def test_one_step_costs_m_keys_not_the_history():
    model = GTrXLModel(small_cfg(mem_len=8)).eval()
    pol = policy_for(model)
    state = pol.initial_state(2)
    for t in range(30):
        _, state = pol.act(np.zeros((2, 3), np.float32), state, np.full(2, t == 0))
    assert [tuple(ls.memory.shape) for ls in state.memory.layers] == [(2, 8, 32), (2, 8, 32)]
    assert state.memory.valid.all() and state.memory.pos[0].tolist() == list(range(22, 30))


# -- resets --------------------------------------------------------------------------------------
def _run(pol, obs, starts, state=None):
    n = obs.shape[1]
    state = pol.initial_state(n) if state is None else state
    outs = []
    for t in range(obs.shape[0]):
        a, state = pol.act(obs[t], state, starts[t])
        outs.append(a)
    return np.stack(outs), state


def test_previous_episode_cannot_leak_after_reset_bit_for_bit():
    torch.manual_seed(3)
    pol = policy_for(GTrXLModel(small_cfg(mem_len=16)))
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(14, 2, 3)).astype(np.float32)
    starts = np.zeros((14, 2), bool)
    starts[0] = True
    starts[6, 0] = True  # env 0: new episode at step 6; env 1 at step 9
    starts[9, 1] = True
    out1, _ = _run(pol, obs, starts)
    obs2 = obs.copy()
    obs2[:6, 0] = rng.normal(size=(6, 3)) * 100  # every observation of env 0's first episode
    obs2[:9, 1] = rng.normal(size=(9, 3)) * 100
    out2, _ = _run(pol, obs2, starts)
    assert np.array_equal(out1[6:, 0], out2[6:, 0])
    assert np.array_equal(out1[9:, 1], out2[9:, 1])
    assert not np.array_equal(out1[:6, 0], out2[:6, 0])  # the perturbation is real


def test_window_crossing_an_episode_boundary_does_not_leak():
    torch.manual_seed(4)
    enc = GTrXLModel(small_cfg(mem_len=8)).eval().encoder
    x = enc.inputs(torch.randn(1, 12, 3))
    start = torch.zeros(1, 12, dtype=torch.bool)
    start[0, 5] = True
    pos = torch.cat([torch.arange(5), torch.arange(7)]).view(1, 12)
    with torch.no_grad():
        a = enc(x, pos, state=enc.initial_state(1), episode_start=start).features
        x2 = x.clone()
        x2[:, :5] = torch.randn(1, 5, x.shape[-1]) * 100
        b = enc(x2, pos, state=enc.initial_state(1), episode_start=start).features
        alone = enc(x[:, 5:], pos[:, 5:], state=enc.initial_state(1)).features
    assert torch.equal(a[:, 5:], b[:, 5:])
    torch.testing.assert_close(a[:, 5:], alone, atol=1e-5, rtol=0)


def test_done_false_true_false_resets_only_row_one():
    torch.manual_seed(5)
    pol = policy_for(GTrXLModel(small_cfg(mem_len=8)))
    obs = np.random.default_rng(1).normal(size=(5, 3, 3)).astype(np.float32)
    starts = np.zeros((5, 3), bool)
    starts[0] = True
    _, state = _run(pol, obs, starts)
    enc = pol.model.encoder
    reset = enc.reset_state(state.memory, torch.tensor([False, True, False]))
    for before, after in zip(state.memory.layers, reset.layers):
        assert torch.equal(after.memory[[0, 2]], before.memory[[0, 2]])
        assert torch.equal(after.memory[1], torch.zeros_like(after.memory[1]))
        assert before.memory[1].abs().sum() > 0
    assert torch.equal(reset.valid[[0, 2]], state.memory.valid[[0, 2]]) and not reset.valid[1].any()
    assert reset.episode.tolist() == [state.memory.episode[0].item(), state.memory.episode[1].item() + 1,
                                      state.memory.episode[2].item()]
    # through act(): rows 0 and 2 continue exactly as without a reset, row 1 acts as a fresh env
    nxt = np.random.default_rng(2).normal(size=(3, 3)).astype(np.float32)
    a_reset, _ = pol.act(nxt, state, np.array([False, True, False]))
    a_cont, _ = pol.act(nxt, state, np.array([False, False, False]))
    a_fresh, _ = pol.act(nxt, pol.initial_state(3), np.array([True, True, True]))
    a_alone, _ = pol.act(nxt[1:2], pol.initial_state(1), np.array([True]))
    assert np.array_equal(a_reset[[0, 2]], a_cont[[0, 2]])
    assert np.array_equal(a_reset[1], a_fresh[1])  # same batch size: bit for bit
    # one row alone runs other GEMM kernels (batch 1 vs 3: another summation order on some CPUs)
    np.testing.assert_allclose(a_reset[1], a_alone[0], rtol=0, atol=1e-6)
    assert not np.array_equal(a_reset[1], a_cont[1])


# -- gradients and memory ------------------------------------------------------------------------
@pytest.mark.parametrize("detach", [True, False])
def test_no_gradient_reaches_detached_memory(detach):
    torch.manual_seed(6)
    bb = gtrxl_backbone(d_model=32, n_layers=2, n_heads=2, mem_len=8)
    bb["memory"]["detach"] = detach
    enc = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb)).encoder
    x1 = torch.randn(2, 8, 3, requires_grad=True)
    x2 = torch.randn(2, 8, 3, requires_grad=True)
    pos = torch.arange(16).expand(2, 16)
    s1 = enc(enc.inputs(x1), pos[:, :8], state=enc.initial_state(2))
    s2 = enc(enc.inputs(x2), pos[:, 8:], state=s1.state)
    s2.features.sum().backward()
    assert x2.grad is not None and x2.grad.abs().sum() > 0
    if detach:
        assert x1.grad is None
        assert all(not ls.memory.requires_grad for ls in s1.state.layers)
    else:  # the check can fail: without detach the gradient does flow into segment 1
        assert x1.grad is not None and x1.grad.abs().sum() > 0


# -- construction errors -------------------------------------------------------------------------
@dataclass(frozen=True)
class _NoMemoryAttention(SDPAConfig):
    pass


def test_attention_without_memory_support_is_refused_with_a_clear_message(monkeypatch):
    _NoMemoryAttention.kind = "test_no_memory"
    _NoMemoryAttention.slot = "attention"
    entry = Entry("attention", "test_no_memory", _NoMemoryAttention, "test", "-", Capabilities(memory=False))
    monkeypatch.setitem(ATTENTION._entries, "test_no_memory", entry)
    bb = gtrxl_backbone(d_model=32, n_layers=1, n_heads=2, mem_len=4)
    bb["attention"] = {"kind": "test_no_memory"}
    with pytest.raises(IncompatibleConfig, match=r"backbone\.attention\.kind='test_no_memory' takes no memory keys.*: .*sdpa"):
        GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))


def test_memoryless_backbone_is_refused():
    bb = gtrxl_backbone(d_model=32, n_layers=1, n_heads=2)
    bb["memory"] = {"kind": "none"}
    with pytest.raises(IncompatibleConfig, match=r"backbone\.memory\.kind='none'"):
        GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))


@pytest.mark.parametrize("kind", ATTENTION.kinds())
def test_every_registered_attention_kernel_either_runs_with_memory_or_is_refused_by_name(kind):
    bb = gtrxl_backbone(d_model=32, n_layers=1, n_heads=2, mem_len=4)
    bb["attention"] = {"kind": kind}
    caps = ATTENTION.get(kind).capabilities
    if not (caps.memory and caps.causal):
        with pytest.raises(IncompatibleConfig, match=rf"gtrxl: backbone\.attention\.kind='{kind}'"):
            GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))
        return
    if caps.positions is not None and "xl_relative" not in caps.positions:
        with pytest.raises(IncompatibleConfig, match=r"backbone\.position\.kind='xl_relative'"):
            GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))
        bb["position"] = {"kind": caps.positions[-1]}  # e.g. rotary for the linear-attention kernels
    pol = policy_for(GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb)))
    state = pol.initial_state(2)
    for t in range(7):  # fills the memory (4 slots), then one row starts a new episode
        actions, state = pol.act(np.ones((2, 3), np.float32) * t, state, np.array([t == 0, t in (0, 5)]))
        assert actions.shape == (2, 2) and np.isfinite(actions).all()
    assert state.memory.valid[0].all() and state.memory.valid[1].sum() == 2
