"""GTrXL with memory kind ``spalm``: the shipped offline config trains (BC and IQL) and acts
step by step with per-environment stores; PPO stores each step's long-term store, recomputes
the rollout's log-probabilities exactly, and resumes a run stopped inside a rollout bit for bit."""

from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy
from rl_tformers.agents.gtrxl.loss import SegmentBatch, encode_segment
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from rl_tformers.agents.gtrxl.ppo import GTrXLPPO
from rl_tformers.agents.gtrxl.ppo_update import STORE_KEYS
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.memory_tasks import scripted_dataset

from rl_tformers.memory.spalm import SpalmStore
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train
from tests.bitwise import same_bits

QUICK = ["train.steps=2", "train.batch_size=2", "train.progress=false", "train.log_every=1", "train.warmup_steps=1",
         "train.checkpoint_every=0", "device=cpu", "backbone.d_model=16", "agent.seq_len=8", "agent.burn_in=4"]
SHORT = "rl_tformers_test/ShortCartPole-v1"  # time limit 10: episode starts inside every rollout
if SHORT not in gym.registry:
    gym.register(SHORT, entry_point=CartPoleEnv, max_episode_steps=10)
PPO = ["agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=12", "agent.n_epochs=1", "agent.n_minibatches=2",
       "train.steps=4", "train.progress=false", "train.log_every=1", "eval.at_end=false", "eval.every=0",
       "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
       "backbone.memory={kind: spalm, mem_len: 2, store_len: 8, knn_k: 2}", f"agent.env_id={SHORT}"]


@pytest.fixture(scope="module")
def recall_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "recall-d8.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=8, seed=0), path)
    return path


@pytest.mark.parametrize("objective", ["bc", "iql"])
def test_shipped_spalm_config_trains_and_acts_with_per_environment_stores(tmp_path, recall_file, objective):
    cfg = compose("gtrxl/recall_spalm_bc", [f"dataset.path={recall_file}", f"agent.objective={objective}",
                                            "eval.at_end=true", "eval.episodes=2", "eval.n_envs=2", *QUICK])
    result = train(cfg, tmp_path / "run")
    assert 0.0 <= result.last_eval["eval/return_mean"] <= 32.0
    if objective == "bc":
        assert 0.0 < result.last_train["backbone/memory/spalm_hit_rate"] <= 1.0
    run = load_run(tmp_path / "run")
    policy = run.agent.policy()
    assert isinstance(policy, GTrXLPolicy)
    state = policy.initial_state(2)
    obs = np.zeros((2, *run.agent.make_env()().observation_space.shape), np.float32)
    stores = []
    for t in range(7):  # row 1 starts a new episode at step 4: only its store is cleared
        start = np.array([t == 0, t in (0, 4)])
        _, state = policy.act(obs, state, start, None if t == 0 else np.zeros(2))
        stores.append(state.memory.layers[-1].extra)
    assert isinstance(stores[-1], SpalmStore)
    assert stores[-1].valid[0].sum() == 7 and stores[-1].valid[1].sum() == 3
    assert torch.equal(stores[-1].pos[0, -7:], torch.arange(7)) and torch.equal(stores[-1].pos[1, -3:], torch.arange(3))


def test_acting_step_by_step_equals_the_burn_in_training_forward():
    """One episode of 16 steps acted one step at a time gives the actions of the training forward
    (7 burn-in steps, then the window), with XL memory covering the episode and the long-term
    store reading every earlier step (min_age 1)."""
    n, burn_in, length = 2, 7, 16
    bb = gtrxl_backbone(d_model=32, n_layers=2, n_heads=2, mem_len=length)
    bb["memory"] = {"kind": "spalm", "mem_len": length, "store_len": 12, "knn_k": 3, "min_age": 1, "gate_init": -1.0}
    torch.manual_seed(3)
    model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb, prev_action_input=True,
                                   prev_reward_input=True)).eval()
    pol = GTrXLPolicy(model, obs_mean=np.zeros(3, np.float32), obs_std=np.ones(3, np.float32),
                      action_low=-np.ones(2, np.float32), action_high=np.ones(2, np.float32))
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(length, n, 3)).astype(np.float32)
    rew = rng.normal(size=(length, n)).astype(np.float32)
    state, acts = pol.initial_state(n), []
    for t in range(length):
        a, state = pol.act(obs[t], state, np.full(n, t == 0), None if t == 0 else rew[t - 1])
        acts.append(torch.as_tensor(a))
    actions = torch.stack(acts, 1)  # (N, L, A)
    prev_r = torch.as_tensor(np.concatenate([np.zeros((1, n), np.float32), rew[:-1]], 0)).T
    start = torch.zeros(n, length, dtype=torch.bool)
    start[:, 0] = True
    batch = SegmentBatch(
        obs=torch.as_tensor(obs).transpose(0, 1), actions=actions, rewards=torch.as_tensor(rew).T,
        rtg=torch.zeros(n, length), prev_action=torch.cat([torch.zeros(n, 1, 2), actions[:, :-1]], 1),
        prev_reward=prev_r, terminals=torch.zeros(n, length, dtype=torch.bool), episode_start=start,
        timesteps=torch.arange(length).expand(n, length), mask=torch.ones(n, length, dtype=torch.bool),
        burn_in=burn_in,
    )
    with torch.no_grad():
        out = encode_segment(model.encoder, batch)
        window = model.actor.mode(out.features)  # (N, L - burn_in, A)
    assert float(out.metrics["memory/spalm_hit_rate"]) == 1.0  # every window step read the store
    assert (window - actions[:, burn_in:]).abs().max().item() < 1e-5


def test_ppo_stores_each_step_s_store_and_recomputes_the_rollout_exactly():
    cfg = compose(overrides=PPO)
    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(cfg, None, torch.device("cpu"))
    ro = ppo.collector.collect()
    assert ro["ltm_keys"].shape == (12, 2, 8, 16) and ro["ltm_valid"].shape == (12, 2, 8)
    # a store grows by one record per step and is empty again at an episode start
    fill = ro["ltm_valid"].sum(-1)  # (S, N)
    assert fill[0].tolist() == [0, 0] and int(fill.max()) == 8 and (fill[10] == 0).all()  # step 10 starts episode 2
    mb = next(ppo.minibatches(ro))
    assert set(STORE_KEYS) <= set(mb)
    _, logs = ppo.loss(mb)
    assert abs(float(logs["approx_kl"])) < 1e-7 and float(logs["clipfrac"]) == 0.0  # the ratio starts at 1


def test_ppo_with_spalm_resumes_a_run_stopped_inside_a_rollout_bit_for_bit(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    train(compose(overrides=PPO), full)
    train(compose(overrides=PPO), split, stop_at=1)
    saved = torch.load(split / "checkpoints" / "step_000000001.pt", weights_only=True)["trainer"]["process_ranks"][0]
    assert set(STORE_KEYS) <= set(saved["rollout"]["tensors"]) and "store" in saved["running"]["memory"]
    assert resume(split).step == 4
    a, b = (torch.load(r / "checkpoints" / "step_000000004.pt", weights_only=True) for r in (full, split))
    for key in ("model", "optimizer", "rng"):
        assert same_bits(a[key], b[key]), key
