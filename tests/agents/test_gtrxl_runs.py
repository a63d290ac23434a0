"""GTrXL through the shared trainer: `train` writes a run, `load_run` rebuilds the policy without data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.memory_tasks import scripted_dataset

from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

TINY_BACKBONE = [
    "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4",
]


@pytest.fixture(scope="module")
def recall_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "recall-d2.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 30, delay=2, seed=0), path)
    return path


def _rollout(policy, make_env, steps=12):
    env = make_env()
    obs, _ = env.reset(seed=7)
    state = policy.initial_state(1, None if not policy.model.cfg.rtg_input else 30.0)
    acts, start, last_r = [], np.array([True]), None
    for _ in range(steps):
        a, state = policy.act(obs[None], state, start, last_r)
        obs, r, term, trunc, _ = env.step(a[0])
        acts.append(a[0])
        start, last_r = np.array([term or trunc]), np.array([r])
        if term or trunc:
            obs, _ = env.reset()
    return np.asarray(acts)


@pytest.mark.parametrize("objective", ["bc", "iql"])
def test_train_then_load_run_rebuilds_the_same_policy_without_the_dataset(tmp_path, recall_file, objective):
    cfg = compose(overrides=[
        "agent.kind=gtrxl", f"agent.objective={objective}", "agent.seq_len=4", "agent.burn_in=4",
        "agent.iql_reward_norm=false", f"dataset.path={recall_file}", "train.steps=3", "train.batch_size=4",
        "train.progress=false", "train.log_every=1", "eval.at_end=true", "eval.episodes=2", "eval.n_envs=2",
        "device=cpu", *TINY_BACKBONE,
    ])
    result = train(cfg, tmp_path / "run")
    assert result.last_eval is not None and "eval/return_mean" in result.last_eval
    run = load_run(tmp_path / "run")
    assert run.kind == "gtrxl" and run.step == 3 and run.agent.dataset is None  # no data read
    assert run.env_id.endswith("rl_tformers/Recall-d2-v0")
    # the rebuilt policy acts exactly like one built from the training-time agent with the same weights
    from rl_tformers.agents.gtrxl.agent import GTrXLAgent

    fresh = GTrXLAgent(run.cfg, None, "cpu")
    fresh.model.load_state_dict(run.agent.model.state_dict())
    a1 = _rollout(run.agent.policy(), run.agent.make_env())
    a2 = _rollout(fresh.policy(), fresh.make_env())
    assert np.array_equal(a1, a2)


def test_ppo_trains_through_the_trainer_and_reloads(tmp_path):
    cfg = compose(overrides=[
        "agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=8", "agent.n_epochs=1", "agent.n_minibatches=2",
        "train.steps=4", "train.progress=false", "train.log_every=2", "eval.episodes=1", "eval.n_envs=1", "device=cpu",
        *TINY_BACKBONE,
    ])
    result = train(cfg, tmp_path / "ppo")
    assert "eval/return_mean" in result.last_eval
    run = load_run(tmp_path / "ppo")
    assert run.kind == "gtrxl_ppo" and run.extra["rollouts"] == 2 and run.extra["env_steps"] == 32
    policy = run.agent.policy()
    state = policy.initial_state(3)
    actions, _ = policy.act(np.zeros((3, 2), np.float32), state, np.ones(3, bool))
    assert actions.shape == (3,) and actions.dtype == np.int64
    np.testing.assert_allclose(policy.obs_mean.numpy(), run.extra["obs_mean"].numpy(), rtol=1e-6)  # running stats restored


def test_ppo_fine_tunes_an_offline_checkpoint(tmp_path, recall_file):
    cfg = compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=4", "agent.burn_in=2", f"dataset.path={recall_file}", "train.steps=2",
        "train.batch_size=4", "train.progress=false", "eval.at_end=false", "device=cpu", *TINY_BACKBONE,
    ])
    train(cfg, tmp_path / "offline")
    offline = load_run(tmp_path / "offline")
    ppo_cfg = compose(overrides=[
        "agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d2-v0", f"agent.init_checkpoint={tmp_path / 'offline'}",
        "agent.n_envs=2", "agent.n_steps=4", "agent.n_epochs=1", "agent.n_minibatches=1", "device=cpu",
    ])
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO

    ppo = GTrXLPPO.for_training(ppo_cfg, None, "cpu")
    own = ppo.model.state_dict()
    for k, v in offline.agent.model.state_dict().items():
        assert torch.equal(own[k], v), k  # encoder and actor copied
    assert ppo.model.value is not None and not ppo.collector.update_obs_stats
    np.testing.assert_allclose(ppo.obs_rms.std, offline.extra["obs_std"].numpy(), rtol=1e-5)


@pytest.mark.slow
def test_benchmark_ppo_gtrxl_solves_position_only_cartpole(tmp_path):
    """The docs/gtrxl.md benchmark: 960 updates = 60 rollouts = 122,880 env steps (~7 min on 2 busy CPU cores)."""
    cfg = compose("gtrxl/ppo_cartpole", ["eval.every=0", "train.progress=false", "device=cpu"])
    result = train(cfg, tmp_path / "ppo")
    assert result.last_eval["eval/return_mean"] >= 475.0
