"""GTrXL agent: segment batches, burn-in, BC/IQL losses, PPO rollouts and memory tasks."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.gtrxl.agent import GTRXL_DEFAULTS, GTrXLAgent, segment_batch
from rl_tformers.agents.gtrxl.loss import (
    SegmentBatch,
    bc_loss,
    encode_segment,
    expectile_loss,
    iql_loss,
    polyak_update,
    td_targets,
)
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO
from rl_tformers.agents.gtrxl.ppo_update import compute_gae, ppo_loss
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.memory_tasks import POSITION_INDICES, RecallEnv, scripted_dataset
from rl_tformers.envs.samplers import SegmentSampler
from rl_tformers.envs.trajectory import ObsStats
from typer.testing import CliRunner

from rl_tformers.attention._linear import maybe_redraw_random_features
from rl_tformers.backbone import Backbone
from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.cli import app
from rl_tformers.runtime.run_config import ConfigError, compose

TINY = gtrxl_backbone(d_model=32, n_layers=2, n_heads=2, mem_len=8)


def tiny_dataset() -> EpisodeDataset:
    """Two episodes (lengths 3 and 4) with actions = 10 * step id and rewards = step id."""
    obs = np.arange(7, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    act = (np.arange(7, dtype=np.float32)[:, None] * 0.1).repeat(2, 1) - 0.3  # inside [-1, 1]
    rew = np.arange(7, dtype=np.float64)
    term = np.array([0, 0, 1, 0, 0, 0, 0], bool)
    trunc = np.array([0, 0, 0, 0, 0, 0, 1], bool)
    return EpisodeDataset(obs, act, rew, term, trunc, np.array([0, 3]), np.array([3, 4]),
                          action_space=gym.spaces.Box(-1.0, 1.0, (2,), np.float32))


def test_segment_batch_gives_exact_previous_action_and_reward_across_episode_boundaries():
    ds = tiny_dataset()
    sampler = SegmentSampler(ds, seq_len=4, burn_in=1 + 1)  # agent burn-in 1, plus the extra leading step
    raw = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sampler.sample(32, np.random.default_rng(0)).items()}
    seg = segment_batch(raw, burn_in=1, discrete=False, action_low=-torch.ones(2), action_high=torch.ones(2))
    assert seg.obs.shape == (32, 5, 2) and seg.burn_in == 1
    for b in range(32):
        for j in range(5):
            if not seg.mask[b, j]:
                continue
            step = int(seg.obs[b, j, 0])  # observation = flat step index
            first = step in (0, 3)
            assert bool(seg.episode_start[b, j]) == first
            assert seg.timesteps[b, j] == (step if step < 3 else step - 3)
            assert seg.rewards[b, j] == step
            assert seg.prev_reward[b, j] == (0.0 if first else step - 1)
            expected_prev = torch.zeros(2) if first else torch.full((2,), (step - 1) * 0.1 - 0.3)
            torch.testing.assert_close(seg.prev_action[b, j], expected_prev)
            assert bool(seg.terminals[b, j]) == (step == 2)


def _random_batch(b=3, length=10, burn_in=4, obs_dim=3, act_dim=2, seed=0) -> SegmentBatch:
    g = torch.Generator().manual_seed(seed)
    start = torch.zeros(b, length, dtype=torch.bool)
    start[0, 0] = True
    start[1, 6] = True
    ts = torch.arange(length).expand(b, length).clone()
    ts[1, 6:] = torch.arange(length - 6)
    return SegmentBatch(
        obs=torch.randn(b, length, obs_dim, generator=g), actions=torch.rand(b, length, act_dim, generator=g) * 2 - 1,
        rewards=torch.randn(b, length, generator=g), rtg=torch.randn(b, length, generator=g),
        prev_action=torch.zeros(b, length, act_dim), prev_reward=torch.zeros(b, length),
        terminals=torch.zeros(b, length, dtype=torch.bool), episode_start=start, timesteps=ts,
        mask=torch.ones(b, length, dtype=torch.bool), burn_in=burn_in,
    )


def test_burn_in_rebuilds_memory_without_gradient_then_matches_a_continued_run():
    torch.manual_seed(0)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=TINY))
    batch = _random_batch()
    batch.obs.requires_grad_(True)
    out = encode_segment(model.encoder, batch)
    assert out.features.shape == (3, 6, 32)
    out.features.sum().backward()
    assert batch.obs.grad[:, :4].abs().sum() == 0  # burn-in steps: no gradient
    assert batch.obs.grad[:, 4:].abs().sum() > 0
    # equals: first segment (the burn-in) then the window with the carried memory
    enc = model.encoder
    x = enc.inputs(batch.obs.detach())
    with torch.no_grad():
        a = enc(x[:, :4], batch.timesteps[:, :4], state=enc.initial_state(3), episode_start=batch.episode_start[:, :4])
        b = enc(x[:, 4:], batch.timesteps[:, 4:], state=a.state, episode_start=batch.episode_start[:, 4:])
    torch.testing.assert_close(out.features.detach(), b.features, atol=1e-6, rtol=0)


def test_expectile_loss_and_polyak_exact_values():
    diff = torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0])
    assert expectile_loss(diff, 0.7).tolist() == pytest.approx([0.3 * 4, 0.3 * 1, 0.0, 0.7 * 1, 0.7 * 9])
    tgt, src = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        tgt.weight.fill_(1.0)
        src.weight.fill_(3.0)
    polyak_update(tgt, src, 0.25)
    assert torch.equal(tgt.weight, torch.full((2, 2), 1.5))


def test_td_targets_mask_time_limits_and_bootstrap_only_inside_an_episode():
    w = SegmentBatch(
        obs=torch.zeros(1, 5, 1), actions=torch.zeros(1, 5, 1),
        rewards=torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]), rtg=torch.zeros(1, 5),
        prev_action=torch.zeros(1, 5, 1), prev_reward=torch.zeros(1, 5),
        terminals=torch.tensor([[False, True, False, False, False]]),
        episode_start=torch.tensor([[False, False, True, False, False]]),
        timesteps=torch.tensor([[5, 6, 0, 1, 2]]),
        mask=torch.tensor([[True, True, True, True, False]]),
    )
    v = torch.tensor([[10.0, 20.0, 30.0, 40.0, 50.0]])
    target, ok = td_targets(w, v, 0.5)
    # t=0: 1 + 0.5*20; t=1 terminal: 2; t=2: 3 + 0.5*40; t=3: next step is padding -> unusable
    assert ok.tolist() == [[True, True, True, False]]
    assert target[ok].tolist() == [11.0, 2.0, 23.0]


@pytest.mark.parametrize("discrete", [False, True])
@pytest.mark.parametrize("share", [False, True])
def test_iql_loss_trains_actor_and_critics_but_never_the_target(discrete, share):
    torch.manual_seed(1)
    cfg = GTrXLConfig(obs_dim=3, act_dim=2, discrete=discrete, backbone=TINY, critic="iql", critic_hidden=16,
                      share_critic_encoder=share)
    model = GTrXLModel(cfg)
    batch = _random_batch()
    if discrete:
        batch.actions = (batch.actions[..., 0] > 0).long()
        batch.prev_action = torch.zeros(3, 10, dtype=torch.long)
    before = {k: v.clone() for k, v in model.target.state_dict().items()}
    loss, logs = iql_loss(model, model.target, batch)
    loss.backward()
    assert set(logs) >= {"loss_value", "loss_q", "loss_actor", "iql/adv_mean"}
    assert model.value[0].weight.grad.abs().sum() > 0
    assert model.q.q1[0].weight.grad.abs().sum() > 0 and model.q.q2[0].weight.grad.abs().sum() > 0
    assert model.actor.net.weight.grad.abs().sum() > 0
    assert model.critic_net.embed.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.target.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.target.state_dict().items())


def test_bc_loss_discrete_is_cross_entropy_over_real_window_steps():
    torch.manual_seed(2)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=4, discrete=True, backbone=TINY))
    batch = _random_batch(burn_in=2)
    batch.actions = torch.randint(0, 4, (3, 10))
    batch.prev_action = torch.zeros(3, 10, dtype=torch.long)
    batch.mask[2, 7:] = False
    loss, logs = bc_loss(model, batch)
    logits = model.actor(encode_segment(model.encoder, batch).features)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 4), batch.actions[:, 2:].reshape(-1), reduction="none")
    expected = ce[batch.mask[:, 2:].reshape(-1)].mean()
    torch.testing.assert_close(loss, expected)
    assert 0.0 <= logs["accuracy"] <= 1.0


def _agent_cfg(**agent):
    return OmegaConf.create({
        "seed": 0,
        "agent": {**GTRXL_DEFAULTS["agent"], "seq_len": 8, "burn_in": 4, **agent},
        "backbone": TINY,
        "dataset": {"scripted": {"task": "recall", "episodes": 40, "delay": 2}},
        "train": {"batch_size": 8, "steps": 4},
        "eval": {"episodes": 3, "n_envs": 3},
    })


@pytest.mark.parametrize("objective", ["bc", "rcbc", "iql"])
def test_agent_trains_and_evaluates_every_objective(objective):
    agent = GTrXLAgent(_agent_cfg(objective=objective, iql_reward_norm=False, prev_action=True), None, torch.device("cpu"))
    data = agent.batches(0)
    b0, b0_again = data[0], data[0]
    assert all(torch.equal(b0[k], b0_again[k]) for k in b0)  # batch s is a pure function of (seed, s)
    opt = torch.optim.Adam([p for p in agent.model.parameters() if p.requires_grad], 1e-3)
    for s in range(3):
        loss, _ = agent.loss(data[s])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        result = agent.evaluate(0)
    assert 0.0 <= result["eval/return_mean"] <= 32.0  # 32 scored answers per episode
    assert agent.extra_state()["env_id"] == "rl_tformers.envs.memory_tasks:rl_tformers/Recall-d2-v0"


# -- PPO --------------------------------------------------------------------------------------------
def test_gae_matches_a_hand_computed_example():
    rewards = torch.tensor([[1.0], [1.0], [1.0]])
    values = torch.tensor([[0.5], [0.5], [0.5]])
    dones = torch.tensor([[False], [True], [False]])
    adv, ret = compute_gae(rewards, values, dones, torch.tensor([2.0]), gamma=0.5, lam=0.5)
    d2 = 1.0 + 0.5 * 2.0 - 0.5  # last step bootstraps from last_value
    d1 = 1.0 - 0.5  # episode ends after step 1
    d0 = 1.0 + 0.5 * 0.5 - 0.5
    assert adv[:, 0].tolist() == pytest.approx([d0 + 0.25 * d1, d1, d2])
    torch.testing.assert_close(ret, adv + values)


def _ppo(**agent):
    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"n_envs": 3, "n_steps": 40, "n_minibatches": 2, **agent})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    return GTrXLPPO.for_training(cfg, None, torch.device("cpu"))


@pytest.mark.parametrize("env_id", ["rl_tformers/PositionOnlyCartPole-v1", "rl_tformers/PositionOnlyPendulum-v1"])
def test_ppo_update_recomputes_exactly_the_rollout_with_stored_memory(env_id):
    torch.manual_seed(3)
    ppo = _ppo(env_id=env_id, prev_action=True)
    ro = ppo.collector.collect()
    assert ro["mem"].shape == (40, 3, 1, 4, 16)  # (S, N, layers, M, D): memory stored per step
    if env_id.endswith("CartPole-v1"):
        assert ro["dones"].any()  # CartPole episodes under a random policy end within 40 steps
    mb = next(ppo.minibatches(ro))
    loss, logs = ppo.loss(mb)
    assert abs(logs["approx_kl"]) < 1e-6 and logs["clipfrac"] == 0.0
    flat = {k: v.flatten(0, 1) for k, v in ro.items() if isinstance(v, torch.Tensor)}
    from rl_tformers.agents.gtrxl.ppo_update import state_from_rows

    with torch.no_grad():
        st = state_from_rows(flat["mem"], flat["mem_pos"], flat["mem_valid"], flat["mem_seg"], flat["episode"], flat["pos"])
        h = ppo.model.encoder(flat["x"][:, None], flat["pos"][:, None], state=st).features[:, 0]
        logp = ppo.model.actor.log_prob(h, flat["actions"])
    torch.testing.assert_close(logp, flat["logp"], atol=1e-5, rtol=0)
    loss.backward()
    assert any(k.startswith("gate/layer0_") for k in logs) and "attention_entropy/layer0" in mb["stats"]


def test_ppo_rollout_resets_only_finished_environments():
    torch.manual_seed(4)
    ppo = _ppo()
    ro = ppo.collector.collect()
    dones = ro["dones"]  # (S, N): the episode ended after step t
    for t in range(1, 40):
        for i in range(3):
            fresh = not ro["mem_valid"][t, i].any()
            if dones[t - 1, i]:
                assert fresh and ro["pos"][t, i] == 0  # reset: no valid slot, episode step 0
            else:
                assert ro["pos"][t, i] == ro["pos"][t - 1, i] + 1 and ro["mem_valid"][t, i].any()


def test_ppo_loss_gradient_is_finite():
    torch.manual_seed(5)
    ppo = _ppo()
    mb = next(ppo.minibatches(ppo.collector.collect()))
    loss, _ = ppo_loss(ppo.model, mb, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, norm_adv=True)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in ppo.model.parameters() if p.grad is not None)


# -- memory tasks -------------------------------------------------------------------------------------
def test_recall_env_scores_the_symbol_from_delay_steps_ago():
    env = RecallEnv(delay=2, n_symbols=3, length=6)
    obs, info = env.reset(seed=0)
    seen, total = [int(obs.argmax())], 0.0
    for t in range(6):
        target = seen[t - 2] if t >= 2 else -1
        assert info["target"] == target
        obs, r, term, trunc, info = env.step(target if target >= 0 else 0)
        total += r
        seen.append(int(obs.argmax()))
    assert term and not trunc and total == 4.0  # steps 2..5 answered correctly, 0..1 not scored


def test_position_only_tasks_hide_velocities():
    cart = gym.make("rl_tformers/PositionOnlyCartPole-v1")
    full = gym.make("CartPole-v1")
    o, _ = cart.reset(seed=3)
    f, _ = full.reset(seed=3)
    assert np.array_equal(o, f[[0, 2]])
    assert gym.make("rl_tformers/PositionOnlyPendulum-v1").observation_space.shape == (2,)
    from rl_tformers.envs.pomdp import position_indices

    assert list(POSITION_INDICES["Hopper-v5"]) == position_indices("Hopper-v5")
    assert gym.make("rl_tformers/PositionOnlyHopper-v5").observation_space.shape == (5,)


def test_scripted_datasets_are_deterministic_and_named():
    a = scripted_dataset("recall", 5, seed=1, delay=4)
    b = scripted_dataset("recall", 5, seed=1, delay=4)
    assert np.array_equal(a.observations, b.observations) and np.array_equal(a.actions, b.actions)
    assert a.metadata.env_id == "rl_tformers.envs.memory_tasks:rl_tformers/Recall-d4-v0" and a.num_steps == 5 * 36
    assert gym.make(a.metadata.env_id).unwrapped.delay == 4
    c = scripted_dataset("cartpole", 2, epsilon=0.0)
    assert c.observation_shape == (2,) and c.episode_returns.tolist() == [500.0, 500.0]


def test_rcbc_evaluation_feeds_the_training_time_return_to_go():
    from rl_tformers.envs.trajectory import returns_to_go

    agent = GTrXLAgent(_agent_cfg(objective="rcbc"), None, torch.device("cpu"))
    ep = agent.dataset.episode(3)
    policy = agent.policy()
    ret = float(ep.rewards.sum())
    state = policy.initial_state(1, target_return=ret)
    seen = []
    for t in range(len(ep.rewards)):
        _, state = policy.act(ep.observations[t][None], state, np.array([t == 0]),
                              None if t == 0 else ep.rewards[t - 1][None])
        seen.append(state.rtg[0])
    assert np.array_equal(np.asarray(seen), returns_to_go(ep.rewards))


@pytest.mark.parametrize("memory", ["xl", "compressive", "knn"])
def test_offline_loss_and_acting_work_with_every_stateful_memory_kind(memory):
    from rl_tformers.agents.gtrxl.agent import GTrXLPolicy

    torch.manual_seed(6)
    bb = gtrxl_backbone(d_model=32, n_layers=2, n_heads=2, mem_len=4)
    bb["memory"] = {"kind": memory}
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))
    loss, _ = bc_loss(model, _random_batch())
    loss.backward()
    assert torch.isfinite(loss) and model.encoder.embed.weight.grad.abs().sum() > 0
    pol = GTrXLPolicy(model, obs_mean=np.zeros(3), obs_std=np.ones(3), action_low=-np.ones(2), action_high=np.ones(2))
    state = pol.initial_state(2)
    for t in range(9):
        actions, state = pol.act(np.full((2, 3), t, np.float32), state, np.array([t == 0, t in (0, 5)]))
        assert np.isfinite(actions).all()


@pytest.mark.parametrize(("memory", "message"), [
    ({"kind": "knn"}, r"backbone\.memory\.kind='knn'; PPO stores the memory of every rollout step"),
    ({"kind": "compressive"}, r"backbone\.memory\.compression='conv'; PPO collects its rollouts without gradient"),
])
def test_ppo_refuses_memory_kinds_it_cannot_store_per_step(memory, message):
    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.backbone.memory = memory
    with pytest.raises(ValueError, match=message):
        GTrXLPPO.for_training(cfg, None, torch.device("cpu"))


def test_ppo_critic_warmup_changes_only_the_value_head():
    torch.manual_seed(7)
    ppo = _ppo(critic_warmup=1)
    mb = next(ppo.minibatches(ppo.collector.collect()))
    assert mb["critic_only"] is True
    loss, _ = ppo.loss(mb)
    loss.backward()
    grads = {n: p.grad for n, p in ppo.model.named_parameters()}
    assert all(g is None or g.abs().sum() == 0 for n, g in grads.items() if not n.startswith("value."))
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.startswith("value."))
    ppo.collector.collect()
    assert next(ppo.minibatches(ppo.collector.collect()))["critic_only"] is False  # rollout 3 > warm-up


# ------------------------------------------------- IQL's target encoder and the online critic's buffers
def _iql_model(attention: dict):
    from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone

    bb = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    bb["position"] = {"kind": "none"}
    bb["attention"] = attention
    torch.manual_seed(0)
    return GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb, critic="iql", critic_hidden=8)).train()


def _segment(seed: int):
    from rl_tformers.agents.gtrxl.loss import SegmentBatch

    g = torch.Generator().manual_seed(seed)
    b, n = 3, 10
    return SegmentBatch(
        obs=torch.randn(b, n, 3, generator=g), actions=torch.rand(b, n, 2, generator=g) * 2 - 1,
        rewards=torch.randn(b, n, generator=g), rtg=torch.randn(b, n, generator=g),
        prev_action=torch.zeros(b, n, 2), prev_reward=torch.zeros(b, n),
        terminals=torch.zeros(b, n, dtype=torch.bool), episode_start=torch.zeros(b, n, dtype=torch.bool),
        timesteps=torch.arange(n).expand(b, n).clone(), mask=torch.ones(b, n, dtype=torch.bool), burn_in=2,
    )


@pytest.mark.parametrize("attention", [
    {"kind": "routing", "n_clusters": 2, "local_heads": 0, "cluster_window": 4, "ema_decay": 0.5, "seed": 0},
    {"kind": "performer", "chunk_size": 4, "seed": 0, "redraw_every": 1},
], ids=["routing-centroids", "performer-redrawn-features"])
def test_iql_target_encoder_uses_the_online_critic_s_attention_state(attention: dict) -> None:
    from rl_tformers.agents.gtrxl.loss import iql_loss, polyak_update

    model = _iql_model(attention)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], 1e-3)
    for step in range(3):  # the agent's update: Polyak step, loss, optimiser step, the trainer's redraw
        polyak_update(model.target, model.critic_target_modules(), 0.005)
        loss, _ = iql_loss(model, model.target, _segment(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        maybe_redraw_random_features(model, step + 1, torch.Generator().manual_seed(step))
    polyak_update(model.target, model.critic_target_modules(), 0.005)  # the next update's Polyak step
    online = dict(model.critic_target_modules()["encoder"].named_buffers())
    target = dict(model.target["encoder"].named_buffers())
    name = next(n for n in online if n.endswith(("centroids", "omega")))
    init = dict(_iql_model(attention).critic_target_modules()["encoder"].named_buffers())[name]
    assert not torch.equal(online[name], init)  # the online critic's attention state moved
    assert torch.equal(target[name], online[name])  # routing: target stuck at init; performer: its own draws


runner = CliRunner()


TINY_GTRXL = ["agent.seq_len=4", "agent.burn_in=2", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
        "backbone.memory.mem_len=4", "train.batch_size=4", "train.warmup_steps=1", "eval.every=0",
        "eval.at_end=false", "train.progress=false", "--device", "cpu"]


def _cfg(**agent) -> OmegaConf:
    return OmegaConf.create({
        "seed": 0,
        "agent": {**GTRXL_DEFAULTS["agent"], "seq_len": 4, "burn_in": 0, **agent},
        "backbone": gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4),
        "dataset": {"scripted": {"task": "recall", "episodes": 4, "delay": 2}},
        "train": {"batch_size": 2, "steps": 1},
        "eval": {"episodes": 1, "n_envs": 1},
    })


# ------------------------------------------------- resume on changed data
def test_resume_refuses_a_dataset_that_changed_since_the_checkpoint(tmp_path: Path) -> None:
    """The recall file behind dataset.path is rewritten between two parts of a GTrXL run (other
    episodes, 30 instead of 20): ``--resume`` refuses it, as the DT does, instead of training on
    it with the checkpoint's observation statistics, reward scale and default target."""
    h5 = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=2, seed=0), h5)
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", f"dataset.path={h5}", "train.steps=2",
                            "train.checkpoint_every=2", *TINY_GTRXL, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3"])  # the same data: resumes
    assert r.exit_code == 0, r.output

    save_d4rl_hdf5(scripted_dataset("recall", 30, delay=2, seed=1), h5)
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the dataset {h5} is not the data this run was trained on: its statistics differ "
                           f"from the checkpoint's (obs_mean: ["), line
    assert "; dataset_return_max: " in line and "; dataset_return_mean: " in line, line
    assert line.endswith("checkpoint -> now); resume with the original data, or start a new run on this dataset"), line
    assert "Traceback" not in r.output

    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=2, seed=0), h5)  # the original data back
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 0, r.output


def test_load_extra_state_refuses_changed_statistics_and_keeps_the_checkpoints_when_equal() -> None:
    """The same refusal in Python (the trainer's resume path), and an equal dataset still takes the
    checkpoint's extra state (reward multiplier and model config included)."""
    agent = GTrXLAgent(_cfg(), None, "cpu")
    saved = {**agent.extra_state(), "reward_mult": 0.25}
    agent.load_extra_state(saved)
    assert agent.extra["reward_mult"] == 0.25
    other = GTrXLAgent(_cfg(), None, "cpu", dataset=scripted_dataset("recall", 6, delay=2, seed=3))
    with pytest.raises(ValueError, match=r"^the dataset built by dataset\.scripted=\{'task': 'recall', 'episodes': 4, 'delay': 2\} is not the data this run "
                                         r"was trained on: its statistics differ from the checkpoint's \("):
        other.load_extra_state(saved)


# ------------------------------------------------- discrete a_{t-1} at an episode start
def _start_segment(agent: GTrXLAgent, episode: int):
    """The training segment whose gradient window starts at the first step of ``episode``."""
    ds, info = agent.dataset, agent.info
    first = int(ds.starts[episode])

    class FixedStart:  # the sampler's first (leading) step: the one before the episode's first
        def integers(self, lo, hi, size):
            return np.full(size, first - 1)

    shape = ds.observation_shape
    sampler = SegmentSampler(ds, agent.seq_len, burn_in=agent.burn_in + 1, reward_scale=info.reward_scale,
                             obs_stats=ObsStats(info.obs_mean.reshape(shape), info.obs_std.reshape(shape)))
    raw = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sampler.sample(1, FixedStart()).items()}
    return agent.to_segments(raw)


def test_discrete_previous_action_is_zeros_at_an_episode_start_in_training_and_acting() -> None:
    """The recall data (4 actions) with agent.prev_action: the a_{t-1} columns of the first token of
    an episode are zeros (as the docs say, not [1, 0, 0, 0], action 0) in the training segment and
    in GTrXLPolicy.act, and a step after action 0 gets [1, 0, 0, 0]."""
    agent = GTrXLAgent(_cfg(prev_action=True, prev_reward=True), None, "cpu")
    enc = agent.model.encoder
    o = agent.info.obs_dim
    seg = _start_segment(agent, 2)
    assert bool(seg.episode_start[0, 0])
    x = enc.inputs(seg.obs, seg.rtg, seg.prev_action, seg.prev_reward)  # (1, T, O + 4 + 1)
    assert x[0, 0, o:o + 4].tolist() == [0.0, 0.0, 0.0, 0.0]  # not [1, 0, 0, 0]
    data_a = agent.dataset.episode(2).actions
    for t in range(1, agent.seq_len):  # later steps: the one-hot of the data's previous action
        assert x[0, t, o:o + 4].tolist() == np.eye(4)[int(data_a[t - 1])].tolist()

    seen = []
    hook = enc.embed.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach().clone()))
    try:
        pol = agent.policy()
        state = pol.initial_state(2)
        obs = agent.dataset.episode(2).observations[:2]  # two environments
        _, state = pol.act(obs, state, np.array([True, True]))
        state.prev_action = torch.tensor([0, 2])  # the actions taken
        _, state = pol.act(obs, state, np.array([False, True]), np.array([1.0, 1.0]))
    finally:
        hook.remove()
    assert seen[0][:, 0, o:o + 4].tolist() == [[0.0] * 4, [0.0] * 4]  # both start: zeros (not action 0)
    assert seen[1][0, 0, o:o + 4].tolist() == [1.0, 0.0, 0.0, 0.0]  # after action 0: its one-hot
    assert seen[1][1, 0, o:o + 4].tolist() == [0.0, 0.0, 0.0, 0.0]  # env 1 started again (action 2 forgotten)


def test_models_without_the_field_keep_the_one_hot_of_action_zero() -> None:
    """Models whose config has no ``prev_action_zero_at_start`` and PPO (whose rollouts feed
    action 0 at a start) keep the encoding they were trained with."""
    cfg = GTrXLConfig(obs_dim=2, act_dim=3, discrete=True, prev_action_input=True,
                      backbone=gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4))
    assert cfg.prev_action_zero_at_start is False
    enc = GTrXLModel(cfg).encoder
    x = enc.inputs(torch.zeros(1, 2, 2), prev_action=torch.tensor([[-1, 0]]))
    assert x[0, :, 2:].tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    new = GTrXLModel(GTrXLConfig(**{**cfg.__dict__, "prev_action_zero_at_start": True})).encoder
    x = new.inputs(torch.zeros(1, 2, 2), prev_action=torch.tensor([[-1, 0]]))
    assert x[0, :, 2:].tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    agent = GTrXLAgent(_cfg(prev_action=True), None, "cpu")
    assert agent.model_cfg.prev_action_zero_at_start is True and agent.extra["model"]["prev_action_zero_at_start"]


# ------------------------------------------------- burn-in as long as the dataset
def test_burn_in_that_leaves_no_real_step_in_any_window_is_refused() -> None:
    """2 recall episodes = 68 steps, agent.burn_in=67: the sampler's leading step plus 67 burn-in
    steps reach the end of the data from any first step, so every window would be padding (loss 0,
    gradient 0): refused."""
    ds = scripted_dataset("recall", 2, delay=2, seed=0)
    assert ds.num_steps == 68
    with pytest.raises(ValueError, match=r"^agent\.burn_in=67: a training segment's gradient window starts 68 steps "
                                         r"after the segment's first step \(one step for a_\{t-1\}, then the burn-in\), "
                                         r"which is drawn uniformly over the dataset's 68 steps: no gradient window "
                                         r"would hold a real step .* use agent\.burn_in below 67"):
        GTrXLAgent(_cfg(burn_in=67), None, "cpu", dataset=ds)
    with pytest.warns(UserWarning, match=r"agent\.burn_in=66: 67 of the dataset's 68 steps .* 99% of the sampled "
                                         r"segments have no real step in their gradient window"):
        agent = GTrXLAgent(_cfg(burn_in=66), None, "cpu", dataset=ds)
    assert agent.burn_in == 66
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GTrXLAgent(_cfg(burn_in=8), None, "cpu", dataset=ds)  # 9 / 68 = 13% of the segments: no warning


# ------------------------------------------------- window longer than the training segment
def test_gtrxl_window_longer_than_the_training_segment_warns() -> None:
    """agent.window=8 with agent.seq_len=4: when acting each step attends to its 7 earlier steps,
    in training to at most 3 (relative distances never trained), silently."""
    bb = {**gtrxl_backbone(d_model=16, n_layers=1, n_heads=2), "memory": {"kind": "none"}}
    cfg = _cfg(window=8, seq_len=4)
    cfg.backbone = bb
    with pytest.warns(UserWarning, match=r"agent\.seq_len=4 < agent\.window=8: when acting a step attends to its 7 "
                                         r"earlier steps, in training to at most 3; set agent\.seq_len=8"):
        GTrXLAgent(cfg, None, "cpu")
    cfg = _cfg(window=8, seq_len=8)
    cfg.backbone = bb
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GTrXLAgent(cfg, None, "cpu")


def test_ppo_fine_tuning_feeds_no_previous_action_at_episode_starts_as_the_offline_encoder_learned(tmp_path) -> None:
    """The offline agent encodes a discrete a_{t-1} at an episode start as zeros
    (prev_action_zero_at_start); PPO fine-tuned from it feeds zeros there too (the one-hot of
    action 0 would be off the distribution its encoder was trained on). PPO from scratch keeps
    action 0's one-hot."""
    import torch
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=1, seed=0), data)
    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", "agent.prev_action=true", f"dataset.path={data}",
        "train.steps=1", "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false",
        "device=cpu", *tiny,
    ]), tmp_path / "offline")
    ppo_over = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d1-v0", "agent.n_envs=2", "agent.n_steps=6",
                "agent.n_minibatches=1", "device=cpu"]
    torch.manual_seed(0)
    tuned = GTrXLPPO.for_training(compose(overrides=[*ppo_over, f"agent.init_checkpoint={tmp_path / 'offline'}"]), None, "cpu")
    assert tuned.model_cfg.prev_action_zero_at_start
    ro = tuned.collector.collect()
    n_act = tuned.model_cfg.act_dim
    prev_a = ro["x"][..., -n_act:]  # inputs [obs ; one-hot a_{t-1}]
    assert torch.equal(prev_a[0], torch.zeros(2, n_act))  # the first step of each episode: no previous action
    assert torch.equal(prev_a[1:].sum(-1), torch.ones(5, 2))  # later steps: the one-hot of the action taken
    scratch = GTrXLPPO.for_training(compose(overrides=[*ppo_over, "agent.prev_action=true", *tiny]), None, "cpu")
    assert not scratch.model_cfg.prev_action_zero_at_start
    assert torch.equal(scratch.collector.collect()["x"][0, :, -n_act:], torch.nn.functional.one_hot(torch.zeros(2, dtype=torch.long), n_act).float())


def test_ppo_fine_tuning_says_which_backbone_settings_it_ignores(tmp_path) -> None:
    """`train -c gtrxl/ppo_cartpole_finetune backbone.block.gate=highway` runs the checkpoint's
    GRU-gated backbone and says that it ignores the setting (silently, a gate sweep would give
    identical runs while config.yaml records gate: highway)."""
    import warnings

    import pytest
    from rl_tformers.agents.gtrxl.fine_tune import fine_tune_backbone_changes
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose, to_container
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=1, seed=0), data)
    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", f"dataset.path={data}", "train.steps=1",
        "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu",
        "backbone.dropout=0.1", *tiny,
    ]), tmp_path / "offline")
    over = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d1-v0", f"agent.init_checkpoint={tmp_path / 'offline'}",
            "agent.n_envs=2", "agent.n_steps=6", "agent.n_minibatches=1", "device=cpu", *tiny,
            "agent.head_hidden=0"]  # the offline run's (another one is warned about)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="gtrxl_ppo trains without dropout")
        GTrXLPPO.for_training(compose(overrides=over), None, "cpu")  # the same backbone (dropout aside): nothing ignored
    cfg = compose(overrides=[*over, "backbone.block.gate=highway", "backbone.n_layers=3"])
    ignored = fine_tune_backbone_changes(to_container(cfg)["backbone"], to_container(compose(overrides=over))["backbone"], "x")
    assert ignored == ["backbone.block.gate='highway' (the checkpoint's: 'gru')", "backbone.n_layers=3 (the checkpoint's: 1)"]
    with pytest.warns(UserWarning, match=r"ignores the config's backbone\.block\.gate='highway' \(the checkpoint's: 'gru'\); "
                                         r"backbone\.n_layers=3 \(the checkpoint's: 1\) \(config\.yaml still records them\)"):
        ppo = GTrXLPPO.for_training(cfg, None, "cpu")
    assert ppo.model_cfg.backbone["block"]["gate"] == "gru" and len(ppo.model.encoder.backbone.blocks) == 1


@pytest.mark.parametrize(("overrides", "first"), [
    (["agent.window=16"], "keeps no memory to rebuild, so agent.burn_in=16 has nothing to warm up"),
    (["agent.window=16", "agent.burn_in=0", "agent.seq_len=16"], "carries memory; use agent.window=0"),
    (["backbone.depth={kind: universal}"], "backbone.depth.kind='universal' keeps no state between calls"),
])
def test_window_mode_errors_give_the_whole_recipe(tmp_path, overrides, first) -> None:
    """Window-mode errors name every missing setting at once, and universal depth's error points
    at the window mode."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import Trainer

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=8, seed=0), data)
    with pytest.raises(Exception) as exc:
        Trainer(compose("gtrxl/recall_bc", [f"dataset.path={data}", "device=cpu", "train.progress=false", *overrides]),
                tmp_path / "run")
    msg = str(exc.value)
    assert first in msg
    assert "backbone.memory.kind=none agent.burn_in=0 agent.seq_len=" in msg


def test_fine_tuning_from_a_run_not_trained_yet_names_the_option_and_the_command(tmp_path) -> None:
    """`train -c gtrxl/ppo_cartpole_finetune` before the offline run exists names the option and
    the command that trains it, not only "runs/gtrxl/cartpole_gtrxl_bc: cannot be loaded
    (FileNotFoundError ...)"."""
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO

    from rl_tformers.runtime.run_config import compose

    missing = tmp_path / "not_trained"
    cfg = compose("gtrxl/ppo_cartpole_finetune", [f"agent.init_checkpoint={missing}", "device=cpu"])
    with pytest.raises(ValueError, match=rf"^agent\.init_checkpoint={missing}: no such run directory or checkpoint "
                                         rf"file; train the offline gtrxl run there first .*`rl-tformers train -c "
                                         rf"gtrxl/cartpole_positions_bc run_dir={missing}`"):
        GTrXLPPO.for_training(cfg, None, "cpu")


HUGE = 10**12


def test_huge_max_position_names_the_option() -> None:
    cfg = BackboneConfig.from_dict({"d_model": 16, "n_layers": 1, "n_heads": 2, "max_position": HUGE,
                                    "position": {"kind": "learned"}})
    with pytest.raises(ValueError, match=r"\(1000000000000, 16\) float32 table sized by backbone\.max_position"):
        Backbone(cfg)


def test_huge_max_ep_len_names_the_option() -> None:
    cfg = DTConfig(obs_dim=3, act_dim=2, context_len=4, max_ep_len=HUGE, backbone={"d_model": 16, "n_layers": 1})
    with pytest.raises(ValueError, match=r"sized by agent\.max_ep_len .* lower agent\.max_ep_len"):
        DecisionTransformer(cfg)


def test_huge_max_position_is_a_clean_train_error(tmp_path: Path, cartpole_h5) -> None:
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    h5 = cartpole_h5(tmp_path / "cp.hdf5")
    res = CliRunner().invoke(app, [
        "train", "-c", "dt/hopper_medium", f"dataset.path={h5}", "backbone.position.kind=learned",
        f"backbone.max_position={HUGE}", "train.steps=1", "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "error: the (1000000000000, 128) float32 table sized by backbone.max_position" in res.output
    assert not (tmp_path / "run").exists()


def _gtrxl_cfg(h5: Path, max_position: int):
    bb = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    bb["position"] = {"kind": "learned"}
    bb["max_position"] = max_position
    return OmegaConf.create({
        "seed": 0, "agent": {**GTRXL_DEFAULTS["agent"], "seq_len": 4, "burn_in": 0}, "backbone": bb,
        "dataset": {"path": str(h5)}, "train": {"batch_size": 2, "steps": 1}, "eval": {"episodes": 1, "n_envs": 1},
    })


@pytest.mark.parametrize("max_position, warns", [(20, True), (500, False)])
def test_gtrxl_learned_positions_shorter_than_the_time_limit_warn(tmp_path: Path, cartpole_h5, caplog,
                                                                   max_position: int, warns: bool) -> None:
    """The fixture's episodes have 10 steps; CartPole-v1's time limit is 500 (positions 0..499)."""
    h5 = cartpole_h5(tmp_path / "cp.hdf5")
    with caplog.at_level(logging.WARNING, logger="rl_tformers.agents.gtrxl.agent"):
        GTrXLAgent(_gtrxl_cfg(h5, max_position), None, "cpu")
    msgs = [r.getMessage() for r in caplog.records if "backbone.max_position" in r.getMessage()]
    if warns:
        assert msgs == [
            "the evaluation environment CartPole-v1 runs episodes of up to 500 steps but backbone.max_position=20 "
            "(GTrXL's positions are episode steps, backbone.position.kind=learned): an evaluation episode that "
            "reaches step 20 will stop the evaluation; set backbone.max_position >= 500 or use a relative "
            "position kind (xl_relative)"]
    else:
        assert msgs == []


def _gtrxl(path: Path, *extra: str) -> list[str]:
    return ["agent.kind=gtrxl", "agent.objective=bc", f"dataset.path={path}", "agent.seq_len=4", "agent.burn_in=2",
            "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "train.batch_size=4",
            "train.steps=2", "train.warmup_steps=1", "train.progress=false", "eval.at_end=false", "eval.every=0",
            "device=cpu", *extra]


def _build(overrides: list[str], tmp_path: Path):
    from rl_tformers.runtime.agent_registry import build_agent

    return build_agent(compose(overrides=overrides), tmp_path / "run", torch.device("cpu"))


# -- offline GTrXL trained with bidirectional attention (future steps leak into each action) ----
def test_gtrxl_refuses_or_ignores_a_non_causal_backbone(tmp_path, cartpole_h5) -> None:
    from rl_tformers.runtime.agent_registry import AgentBuildError

    data = cartpole_h5(tmp_path / "cp.h5")
    try:
        agent = _build(_gtrxl(data, "backbone.causal=false"), tmp_path)
    except (AgentBuildError, ConfigError) as exc:  # the fix may refuse it, naming the option
        assert "backbone.causal" in str(exc), str(exc)
        return
    # ... or build a causal stack anyway: step t's features must not depend on steps > t
    enc = agent.model.encoder
    enc.eval()
    torch.manual_seed(0)
    x = torch.randn(1, 5, enc.cfg.input_dim)
    pos = torch.arange(5)[None]
    with torch.no_grad():
        h1 = enc(x, pos, state=enc.initial_state(1)).features
        x2 = x.clone()
        x2[0, 4] += 10.0
        h2 = enc(x2, pos, state=enc.initial_state(1)).features
    leak = (h1[0, :4] - h2[0, :4]).abs().max().item()
    assert leak == 0.0, f"steps 0..3 changed by {leak:.2e} when only step 4's input changed (future leak)"


# -- GTrXL's refusal of a non-causal kernel advises the leaking backbone.causal=false -------------
def test_gtrxl_refusal_of_a_non_causal_kernel_does_not_advise_causal_false(tmp_path, cartpole_h5) -> None:
    from rl_tformers.runtime.agent_registry import AgentBuildError

    data = cartpole_h5(tmp_path / "cp.h5")
    with pytest.raises((AgentBuildError, ConfigError)) as info:
        _build(_gtrxl(data, "backbone.attention.kind=bigbird"), tmp_path)
    msg = str(info.value)
    assert "bigbird" in msg
    assert "set backbone.causal=false" not in msg, msg  # GTrXL has no last_action mode: that config leaks


# -- 3./4. GTrXL parameters without a gradient under DDP (early_exit, compressive) -------------------
@pytest.mark.filterwarnings("ignore:backbone.memory.kind")  # xl's mem_len/detach dropped: wanted here
@pytest.mark.parametrize("swap", [
    ["backbone.depth.kind=early_exit"],
    ["backbone.memory.kind=compressive"],  # default mem_len=32 > burn_in + seq_len: compresses only at episode ends
], ids=["early_exit", "compressive"])
def test_gtrxl_asks_ddp_to_find_parameters_that_some_updates_leave_without_gradient(tmp_path, cartpole_h5, swap):
    """DistributedDataParallel (find_unused_parameters=False, the default) needs every trainable
    parameter to get a gradient in every update, else ``--nproc 2`` dies at the next update (or, when
    only one rank skips them, gloo aborts on a collective mismatch). An agent that leaves some without
    one must ask for ``ddp_find_unused`` itself (docs/runtime.md), as PPO's critic warm-up does."""
    data = cartpole_h5(tmp_path / "cp.h5")
    agent = _build(_gtrxl(data, "train.steps=3", *swap), tmp_path)
    batches = iter(agent.batches(0))
    unused: set[str] = set()
    for _ in range(3):
        agent.model.zero_grad(set_to_none=True)
        loss, _logs = agent.loss(next(batches))
        loss.backward()
        unused |= {n for n, p in agent.model.named_parameters() if p.requires_grad and p.grad is None}
    if unused:
        assert getattr(agent, "ddp_find_unused", False), (
            f"{swap}: parameters {sorted(unused)} got no gradient in some updates, but the agent does not ask "
            f"for ddp_find_unused: rl-tformers train --nproc 2 crashes")
