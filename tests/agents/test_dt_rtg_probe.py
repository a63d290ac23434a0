"""The return-to-go probe of a trained DT: exact fit and shift values on the data's own windows."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from rl_tformers.runtime.loading import load_run
from rl_tformers.agents.decision_transformer.model import from_env_action
from rl_tformers.agents.decision_transformer.rtg_probe import rtg_probe
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.trajectory import returns_to_go

from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

K = 4


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    rng = np.random.default_rng(0)
    space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32)  # Pendulum-v1's
    eps = []
    for n in (12, 12, 6, 3):  # episode 3 (3 steps) is shorter than K: never probed
        eps.append({"observations": rng.normal(size=(n + 1, 3)).astype(np.float32),
                    "actions": rng.uniform(-2, 2, (n, 1)).astype(np.float32),
                    "rewards": rng.uniform(0, 1, n), "terminations": np.eye(1, n, n - 1, dtype=bool)[0],
                    "truncations": np.zeros(n, bool)})
    ds = EpisodeDataset.from_episodes(eps, observation_space=gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                                      action_space=space, metadata=DatasetMetadata(env_id="Pendulum-v1"))
    tmp = tmp_path_factory.mktemp("probe")
    path = save_d4rl_hdf5(ds, tmp / "data.hdf5")
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", "backbone.d_model=16", "backbone.n_layers=1",
                                       "backbone.n_heads=1", f"agent.context_len={K}", "agent.max_ep_len=20",
                                       "train.steps=3", "train.batch_size=4", "train.warmup_steps=1",
                                       "train.progress=false", "eval.every=0", "eval.at_end=false", "device=cpu"])
    train(cfg, tmp / "run")
    return load_run(tmp / "run"), ds


def test_fit_and_shift_are_the_models_exact_values(probe_run):
    run, ds = probe_run
    agent, info = run.agent, run.agent.info
    rows = rtg_probe(agent, ds, {"a": [0, 1], "b": [2, 3]}, t0s=(0, 8), rtgs=(0.5,))
    assert [(r["group"], r["t0"], r["episodes"]) for r in rows] == [("a", 0, 2), ("a", 8, 2), ("b", 0, 1), ("b", 8, 0)]
    assert rows[3]["fit"] is None and rows[3]["shift"] == {}
    # recompute group a, t0 = 8 by hand
    obs, act, rtg = [], [], []
    for i in (0, 1):
        ep = ds.episode(i)
        obs.append((np.asarray(ep.observations[8:12]) - info.obs_mean) / info.obs_std)
        act.append(np.asarray(ep.actions[8:12]))
        rtg.append(returns_to_go(np.asarray(ep.rewards, np.float64))[8:12] / info.reward_scale)
    obs, act, rtg = (torch.tensor(np.stack(x), dtype=torch.float32) for x in (obs, act, rtg))
    act = from_env_action(act, torch.full((1,), -2.0), torch.full((1,), 2.0))
    steps, mask = (8 + torch.arange(K)).expand(2, K), torch.ones(2, K, dtype=torch.bool)
    with torch.no_grad():
        base = agent.model(obs, act, rtg, steps, mask).action
        moved = agent.model(obs, act, rtg - rtg[:, :1] + 0.5, steps, mask).action
    assert rows[1]["fit"] == pytest.approx(float(((base - act) ** 2).sum(-1).mean()), rel=1e-6)
    assert rows[1]["shift"][0.5] == pytest.approx(float(((moved - base) ** 2).sum(-1).mean()), rel=1e-6)
    assert rows[1]["shift"][0.5] > 0  # the return-to-go token reaches the action


def test_shift_to_the_windows_own_return_is_zero_and_errors_are_clear(probe_run):
    run, ds = probe_run
    own = float(returns_to_go(np.asarray(ds.episode(0).rewards, np.float64))[0] / run.agent.info.reward_scale)
    (row,) = rtg_probe(run.agent, ds, {"a": [0]}, t0s=(0,), rtgs=(own,))
    assert row["shift"][own] == pytest.approx(0.0, abs=1e-10)
    with pytest.raises(ValueError, match="group 'x' has episode indices \\[7\\] outside 0..3"):
        rtg_probe(run.agent, ds, {"x": [7]})
