"""The policies ``rl-tformers bench eval`` times: a short-trained DT, and untrained DT / BC / GTrXL
policies of the agents' default sizes on Hopper and CartPole (the profile's six cases).

A policy's cost per step does not depend on its weights, but the length of its episodes does:
the throughput comparison times a policy trained for ``--train-updates`` updates (a small DT, 64
dims, 2 layers, on ``--dataset``), or a run given with ``--run``; the profile's untrained
policies only split the cost of a step.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from rl_tformers.agents.bc.agent import BCPolicy
from rl_tformers.agents.bc.model import BCConfig, BCModel
from rl_tformers.agents.common.offline import DatasetInfo
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel
from rl_tformers.runtime.agent_registry import build_agent
from rl_tformers.runtime.cpu_matmul import apply_cpu_matmul
from rl_tformers.runtime.run_config import compose

#: the profile's environments: gymnasium id -> the DT's default target return
PROFILE_ENVS = {"Hopper-v5": 3600.0, "CartPole-v1": 500.0}
PROFILE_AGENTS = ("dt", "bc", "gtrxl")
#: the short-trained DT: its backbone and optimiser
SMALL_DT = ("backbone.d_model=64", "backbone.n_layers=2", "backbone.n_heads=1")
TRAIN_LR = 1e-3


@dataclass
class BenchPolicy:
    """A policy to evaluate: ``policy``, its environment factory, target and a description."""

    policy: Any
    make_env: Callable[[], gym.Env]
    target: float | None
    what: str
    model: torch.nn.Module | None = None


def train_small_dt(dataset: str, updates: int, seed: int, device: str,
                   log: Callable[[str], None] = lambda m: None) -> BenchPolicy:
    """A DT of 64 dims and 2 layers (``dt/hopper_medium`` otherwise) trained ``updates`` updates
    (AdamW, lr 1e-3, no warm-up, no dropout) on ``dataset``; 0 updates: the untrained model. On
    the CPU its ``nn.Linear`` products run in the library ``cpu_matmul: auto`` picks on this host,
    as a run's do in training and evaluation (named in the description).

    Raises:
        ConfigError, AgentBuildError, OSError: the dataset cannot be read or the agent built.
    """
    cfg = compose("dt/hopper_medium", [f"dataset.path={dataset}", f"device={device}", f"seed={seed}", *SMALL_DT,
                                       "backbone.dropout=0.0", "backbone.attn_dropout=0.0",
                                       "agent.embed_dropout=0.0"])
    torch.manual_seed(seed)
    agent = build_agent(cfg, Path(tempfile.mkdtemp(prefix="rlt-bench-eval-")), torch.device(device))
    lib = str(cfg.cpu_matmul)  # cpu_matmul: auto, resolved by compose
    if torch.device(device).type == "cpu":  # the GEMM library a run trains and is evaluated with (load_run)
        apply_cpu_matmul(agent.model, lib)
    if updates > 0:
        agent.model.train()
        opt = torch.optim.AdamW(agent.model.parameters(), lr=TRAIN_LR, weight_decay=1e-4)
        batches = iter(agent.batches(0))
        for step in range(updates):
            loss, _ = agent.loss(next(batches))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(agent.model.parameters(), 0.25)
            opt.step()
            if (step + 1) % 100 == 0:
                log(f"train: update {step + 1}/{updates}, loss {float(loss.detach()):.4f}")
    agent.model.eval()
    what = (f"a DT of 64 dims, 2 layers, K = 20 trained {updates} updates on {dataset} (seed {seed}; cpu_matmul {lib})"
            if updates else
            f"an untrained DT of 64 dims, 2 layers, K = 20 (dt/hopper_medium on {dataset}, seed {seed}; cpu_matmul {lib})")
    return BenchPolicy(agent.policy(), agent.make_env(), agent.default_targets()[0], what, agent.model)


def _spaces(env_id: str) -> tuple[int, int, bool, np.ndarray | None, np.ndarray | None]:
    env = gym.make(env_id)
    try:
        obs_dim = int(np.prod(env.observation_space.shape))
        space = env.action_space
        if isinstance(space, gym.spaces.Discrete):
            return obs_dim, int(space.n), True, None, None
        return obs_dim, int(np.prod(space.shape)), False, space.low.astype(np.float32), space.high.astype(np.float32)
    finally:
        env.close()


def untrained(agent: str, env_id: str, seed: int = 0, device: str = "cpu") -> BenchPolicy:
    """An untrained policy of ``agent`` (dt: the paper's 128 dims, 3 layers, K = 20; bc: two layers
    of 256; gtrxl: 128 dims, 3 layers, 4 heads, XL memory of 32) on ``env_id``'s spaces, unit
    observation statistics.

    Raises:
        ValueError: an agent not in :data:`PROFILE_AGENTS`.
    """
    obs_dim, act_dim, discrete, low, high = _spaces(env_id)
    torch.manual_seed(seed)
    dev = torch.device(device)
    mean, std = np.zeros(obs_dim, np.float32), np.ones(obs_dim, np.float32)
    target = PROFILE_ENVS.get(env_id)
    if agent == "dt":
        model = DecisionTransformer(DTConfig(obs_dim=obs_dim, act_dim=act_dim, discrete=discrete, context_len=20,
                                             max_ep_len=1000)).to(dev)
        policy: Any = DTPolicy(model, mean, std, 1000.0 if not discrete else 100.0, low, high, default_target=target)
        what = "DT (128 dims, 3 layers, K = 20)"
    elif agent == "bc":
        model = BCModel(BCConfig(obs_dim=obs_dim, act_dim=act_dim, discrete=discrete)).to(dev)
        info = DatasetInfo(obs_dim=obs_dim, act_dim=act_dim, discrete=discrete, obs_mean=mean, obs_std=std,
                           action_low=low, action_high=high, reward_scale=1.0, return_max=0.0, return_mean=0.0,
                           return_min=0.0, longest_episode=1000, env_id=env_id, env_kwargs={}, pomdp=None)
        policy, target = BCPolicy(model, info), None
        what = "BC (MLP 256 x 2)"
    elif agent == "gtrxl":
        model = GTrXLModel(GTrXLConfig(obs_dim=obs_dim, act_dim=act_dim, discrete=discrete)).to(dev)
        policy = GTrXLPolicy(model, obs_mean=mean, obs_std=std, action_low=low, action_high=high, device=dev)
        what, target = "GTrXL (128 dims, 3 layers, 4 heads, XL memory 32)", None
    else:
        raise ValueError(f"unknown agent {agent!r}; use one of {', '.join(PROFILE_AGENTS)}")
    return BenchPolicy(policy, lambda: gym.make(env_id), target, f"untrained {what} on {env_id}", model)
