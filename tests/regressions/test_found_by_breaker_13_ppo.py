"""Faults found by breaker 13 in the GTrXL agent's online training (PPO, agents/gtrxl/ppo.py)."""

from __future__ import annotations

import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5

from rl_tformers.backbone_config import ConfigAdviceWarning
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

TINY_BACKBONE = [
    "backbone.d_model=16",
    "backbone.n_layers=1",
    "backbone.n_heads=2",
    "backbone.memory.mem_len=4",
]
BOX2 = "rl_tformers_test/Box2Actions-v0"  # 2-dim observations, 2-dim continuous actions in [-1, 1]
WIDE2 = "rl_tformers_test/WideBox2Actions-v0"  # the same with actions in [-2, 2]


class _Box2(gym.Env):
    def __init__(self, bound: float = 1.0) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-bound, bound, (2,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        return np.zeros(2, np.float32), 0.0, False, False, {}


for _id, _bound in ((BOX2, 1.0), (WIDE2, 2.0)):
    if _id not in gym.registry:
        gym.register(_id, entry_point=_Box2, kwargs={"bound": _bound}, max_episode_steps=20)


def _ppo(**agent) -> GTrXLPPO:
    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"n_envs": 2, "n_steps": 8, "n_minibatches": 2, **agent})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    return GTrXLPPO(cfg, None, torch.device("cpu"))


# -- advantage normalisation over a minibatch of one row ------------------------------------------------
def test_ppo_refuses_advantage_normalisation_over_one_row_minibatches() -> None:
    """1 x 3 samples in 2 minibatches are minibatches of 2 and 1 rows: the one-row minibatch's advantage
    was used unnormalised (normalize_advantages returns a single row unchanged) next to normalised ones."""
    with pytest.raises(
        ValueError,
        match=r"agent\.norm_adv=true .* agent\.n_minibatches=2 .* 3 samples .* "
        r"one row.*agent\.n_minibatches <= 1 or agent\.norm_adv=false",
    ):
        _ppo(n_envs=1, n_steps=3, n_minibatches=2)
    with pytest.raises(ValueError, match=r"agent\.n_envs x agent\.n_steps >= 2"):
        _ppo(n_envs=1, n_steps=1, n_minibatches=1)
    _ppo(n_envs=1, n_steps=3, n_minibatches=2, norm_adv=False)  # without normalisation any split works
    _ppo(n_envs=1, n_steps=4, n_minibatches=2)  # minibatches of 2 rows


# -- fine-tuning an offline run in an environment of other spaces ----------------------------------------
@pytest.fixture(scope="module")
def continuous_offline_run(tmp_path_factory) -> Path:
    """An offline GTrXL BC run (one update) on 2-dim observations and 2-dim continuous actions."""
    root = tmp_path_factory.mktemp("offline")
    rng = np.random.default_rng(0)
    env = gym.make(BOX2)
    eps = [
        {
            "observations": rng.normal(size=(9, 2)).astype(np.float32),
            "actions": rng.uniform(-1, 1, (8, 2)).astype(np.float32),
            "rewards": rng.normal(size=8),
            "terminations": np.eye(1, 8, 7, dtype=bool)[0],
            "truncations": np.zeros(8, bool),
        }
        for _ in range(4)
    ]
    ds = EpisodeDataset.from_episodes(
        eps,
        observation_space=env.observation_space,
        action_space=env.action_space,
        metadata=DatasetMetadata(env_id=BOX2),
    )
    save_d4rl_hdf5(ds, root / "box2.hdf5")
    cfg = compose(
        overrides=[
            "agent.kind=gtrxl",
            "agent.seq_len=4",
            "agent.burn_in=2",
            f"dataset.path={root / 'box2.hdf5'}",
            "train.steps=1",
            "train.batch_size=2",
            "train.warmup_steps=0",
            "train.progress=false",
            "eval.at_end=false",
            "device=cpu",
            *TINY_BACKBONE,
        ]
    )
    train(cfg, root / "run")
    return root / "run"


def _fine_tune(run: Path, env_id: str) -> GTrXLPPO:
    cfg = compose(
        overrides=[
            "agent.kind=gtrxl_ppo",
            f"agent.env_id={env_id}",
            f"agent.init_checkpoint={run}",
            "agent.head_hidden=0",
            "agent.n_envs=2",
            "agent.n_steps=4",
            "agent.n_minibatches=1",
            "device=cpu",
            *TINY_BACKBONE,
        ]
    )
    return GTrXLPPO(cfg, None, "cpu")


def test_ppo_fine_tuning_refuses_an_environment_whose_spaces_the_offline_run_does_not_fit(
    continuous_offline_run: Path,
) -> None:
    """PositionOnlyCartPole has 2-dim observations and 2 discrete actions: the offline continuous actor's
    2 tanh-mean outputs were loaded silently as the logits of a discrete policy (same parameter shapes)."""
    with pytest.raises(
        ValueError,
        match=r"agent\.init_checkpoint=.* was trained on rl_tformers_test/Box2Actions-v0 "
        r"with 2-dim observations and 2-dim continuous actions, but agent\.env_id="
        r"rl_tformers/PositionOnlyCartPole-v1 has 2-dim observations and 2 discrete",
    ):
        _fine_tune(continuous_offline_run, "rl_tformers/PositionOnlyCartPole-v1")
    # other sizes failed with a list of parameter names ("missing ['encoder.embed.weight']"); now the same message
    with pytest.raises(
        ValueError, match=r"but agent\.env_id=Pendulum-v1 has 3-dim observations and 1-dim continuous"
    ):
        _fine_tune(continuous_offline_run, "Pendulum-v1")


def test_ppo_fine_tuning_says_when_the_environment_maps_the_actions_to_other_bounds(
    continuous_offline_run: Path,
) -> None:
    with pytest.warns(
        UserWarning,
        match=r"actions in \[-1, 1\] were the bounds \[\[-1\.0, -1\.0\], \[1\.0, 1\.0\]\].*"
        r"maps them to its bounds \[\[-2\.0, -2\.0\], \[2\.0, 2\.0\]\]",
    ):
        _fine_tune(continuous_offline_run, WIDE2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*bounds.*")
        ppo = _fine_tune(continuous_offline_run, BOX2)  # its own environment: no warning
    assert not ppo.discrete and ppo.model_cfg.act_dim == 2


# -- train.compile ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("critic", ["value", "iql"])
def test_train_compile_compiles_the_modules_gtrxl_calls(critic: str) -> None:
    """The trainer's train.compile=true calls model.compile(); GTrXLModel has no forward (the losses and
    policies call the encoder and heads), so nothing that runs was compiled."""
    model = GTrXLModel(
        GTrXLConfig(
            obs_dim=3,
            act_dim=2,
            critic=critic,
            backbone=gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4),
        )
    )
    keys = list(model.state_dict())
    model.compile(backend="eager")
    called = [model.encoder, model.actor, model.value] + (
        [model.critic_encoder, model.q] if critic == "iql" else []
    )
    assert all(getattr(m, "_compiled_call_impl", None) is not None for m in called)
    assert list(model.state_dict()) == keys  # checkpoints unchanged


# -- bfloat16 autocast -----------------------------------------------------------------------------------
def test_ppo_under_bf16_autocast_says_the_ratio_does_not_start_at_1() -> None:
    cfg = compose(
        overrides=[
            "agent.kind=gtrxl_ppo",
            "train.amp=bf16",
            "agent.n_envs=2",
            "agent.n_steps=4",
            "agent.n_minibatches=1",
            "device=cpu",
        ]
    )
    with pytest.warns(
        ConfigAdviceWarning, match=r"train\.amp=bf16.*ratio does not start at 1.*train\.amp=none"
    ):
        GTrXLPPO(cfg, None, "cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=ConfigAdviceWarning)
        GTrXLPPO(
            compose(
                overrides=[
                    "agent.kind=gtrxl_ppo",
                    "agent.n_envs=2",
                    "agent.n_steps=4",
                    "agent.n_minibatches=1",
                    "device=cpu",
                ]
            ),
            None,
            "cpu",
        )


# -- backbone.memory.detach=false --------------------------------------------------------------------------
def test_ppo_says_memory_detach_false_has_no_effect() -> None:
    cfg = compose(
        overrides=[
            "agent.kind=gtrxl_ppo",
            "backbone.memory.detach=false",
            "agent.n_envs=2",
            "agent.n_steps=4",
            "agent.n_minibatches=1",
            "device=cpu",
        ]
    )
    with pytest.warns(ConfigAdviceWarning, match=r"backbone\.memory\.detach=false has no effect"):
        GTrXLPPO(cfg, None, "cpu")
