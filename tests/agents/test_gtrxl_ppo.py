"""PPO-GTrXL (rl_tformers.agents.gtrxl.ppo): rollout and update options, actions and observations, fine-tuning from an offline run, dropout, positions, processes."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

SHORT = "rl_tformers_breaker8/ShortCartPole-v1"  # time limit 10: a truncation in every rollout below


if SHORT not in gym.registry:
    gym.register(SHORT, entry_point=CartPoleEnv, max_episode_steps=10)


PPO_TINY = ["agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=12", "agent.n_epochs=1", "agent.n_minibatches=1",
            "train.steps=2", "train.progress=false", "train.log_every=1", "eval.at_end=false", "eval.every=0",
            "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
            "backbone.memory.mem_len=4", f"agent.env_id={SHORT}"]


# ------------------------------------------------- 1. PPO: learned positions and the truncation bootstrap
def test_ppo_learned_positions_need_a_row_for_the_bootstrapped_final_observation(tmp_path) -> None:
    """max_position == time limit passed the check and crashed at the first truncation
    ("position.learned: positions must lie in [0, 10) but got [10, 10]"); now refused up front,
    naming the option and the size it needs; time limit + 1 rows train."""
    from rl_tformers.runtime.agent_registry import AgentBuildError

    learned = ["backbone.position.kind=learned"]
    with pytest.raises(AgentBuildError, match=r"backbone\.max_position=10 but .* episodes run up to 10 steps .*"
                                              r"set backbone\.max_position >= 11"):
        train(compose(overrides=[*PPO_TINY, *learned, "backbone.max_position=10"]), tmp_path / "ten")
    state = train(compose(overrides=[*PPO_TINY, *learned, "backbone.max_position=11"]), tmp_path / "eleven")
    assert state.step == 2


# ------------------------------------------------- 2. PPO: a scalar Box action space
class _ScalarActionEnv(gym.Env):
    """Box(-2, 2, shape=()) actions; refuses any action its space does not contain."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Box(-2.0, 2.0, (), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        if not self.action_space.contains(np.asarray(action, np.float32)):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        self.t += 1
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), float(action), self.t >= 4, False, {}


SCALAR = "rl_tformers_breaker8/ScalarAction-v0"


if SCALAR not in gym.registry:
    gym.register(SCALAR, entry_point=_ScalarActionEnv, max_episode_steps=6)


def test_ppo_with_a_scalar_box_action_evaluates_with_scalar_actions() -> None:
    from omegaconf import OmegaConf
    from rl_tformers.agents.gtrxl.model import gtrxl_backbone
    from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO

    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"env_id": SCALAR, "n_envs": 2, "n_steps": 6, "n_minibatches": 2})
    cfg.eval.update({"episodes": 2, "n_envs": 2})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(cfg, None, torch.device("cpu"))
    ppo.collector.collect()  # (the rollout already stepped with scalar actions)
    policy = ppo.policy()
    actions, _ = policy.act(np.zeros((2, 3), np.float32), policy.initial_state(2), np.ones(2, bool))
    assert actions.shape == (2,) and actions.dtype == np.float32
    assert all(ppo.collector.envs.single_action_space.contains(np.asarray(a)) for a in actions)
    report = ppo.evaluate(0)  # raised "action array([...]) is not in Box(-2.0, 2.0, (), float32)"
    assert set(report) == {"eval/return_mean", "eval/return_std"} and np.isfinite(report["eval/return_mean"])


# ------------------------------------------------- 3. DDP: PPO does not split train.batch_size
def test_ppo_under_any_process_count_is_not_refused_for_the_unused_batch_size() -> None:
    from rl_tformers.runtime.agent_registry import get_agent
    from rl_tformers.runtime.run_config import ConfigError
    from rl_tformers.runtime.trainer import check_world_size

    assert get_agent("gtrxl_ppo").local_batches is True
    ppo = compose("gtrxl/ppo_cartpole", ["train.batch_size=64"])
    for nproc in (1, 2, 3, 5, 7):
        check_world_size(ppo, nproc)  # raised ConfigError for 3, 5 and 7
    dt = compose(overrides=["agent.kind=dt", "train.batch_size=64"])  # agents that do split the batch: still refused
    assert get_agent("dt").local_batches is False
    with pytest.raises(ConfigError, match=r"train\.batch_size=64 is the global batch and must be divisible by the 3 "):
        check_world_size(dt, 3)
    check_world_size(dt, 4)


# ------------------------------------------------- 9. DDP: PPO critic warm-up
def test_ppo_critic_warmup_trains_under_two_processes(tmp_path) -> None:
    from rl_tformers.runtime.checkpoint import load_checkpoint
    from tests.runtime.ddp_helpers import read_metrics, train_cli

    args = ["-c", "gtrxl/ppo_cartpole", "agent.critic_warmup=1", "agent.n_envs=2", "agent.n_steps=8",
            "agent.n_epochs=1", "agent.n_minibatches=2", "backbone.d_model=16", "backbone.n_layers=1",
            "backbone.n_heads=2", "backbone.memory.mem_len=4", "eval.at_end=false", "eval.every=0",
            "train.log_every=1", "train.progress=false", "train.weight_decay=0.1", "train.checkpoint_every=2",
            "train.steps=4"]  # 2 updates per rollout: rollout 1 trains the value head only, rollout 2 everything
    two, one = tmp_path / "two", tmp_path / "one"
    r = train_cli("--nproc", "2", *args, "--run-dir", str(two))
    assert r.returncode == 0, r.stderr[-3000:]  # was: rank 1 ... "Expected to have finished reduction"
    assert [m["step"] for m in read_metrics(two)] == [1, 2, 3, 4]
    r = train_cli(*args, "train.steps=2", "--run-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    ddp, single = (load_checkpoint(run / "checkpoints" / "step_000000002.pt")["model"] for run in (two, one))
    for name in ddp:  # after the warm-up: encoder and actor untouched (no decay either), as in one process
        if not name.startswith("value."):
            assert torch.equal(ddp[name], single[name]), name
    end = load_checkpoint(two / "checkpoints" / "step_000000004.pt")["model"]
    assert not torch.equal(end["actor.net.0.weight"], ddp["actor.net.0.weight"])  # then the actor trains
