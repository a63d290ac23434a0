"""PPO-GTrXL (rl_tformers.agents.gtrxl.ppo): rollout and update options, actions and observations, fine-tuning from an offline run, dropout, positions, processes."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from omegaconf import OmegaConf
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO
from rl_tformers.agents.gtrxl.rollout import RunningMeanStd
from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5

from rl_tformers.backbone_config import ConfigAdviceWarning
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import resume, train
from tests.runtime.ddp_helpers import two_ranks

SHORT = "rl_tformers_test/ShortCartPole-v1"  # time limit 10: a truncation in every rollout below


if SHORT not in gym.registry:
    gym.register(SHORT, entry_point=CartPoleEnv, max_episode_steps=10)


PPO_TINY = ["agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=12", "agent.n_epochs=1", "agent.n_minibatches=1",
            "train.steps=2", "train.progress=false", "train.log_every=1", "eval.at_end=false", "eval.every=0",
            "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
            "backbone.memory.mem_len=4", f"agent.env_id={SHORT}"]


# ------------------------------------------------- PPO: learned positions and the truncation bootstrap
def test_ppo_learned_positions_need_a_row_for_the_bootstrapped_final_observation(tmp_path) -> None:
    """max_position == time limit is refused up front, naming the option and the size it needs
    (it would crash at the first truncation: "position.learned: positions must lie in [0, 10) but
    got [10, 10]"); time limit + 1 rows train."""
    from rl_tformers.runtime.agent_registry import AgentBuildError

    learned = ["backbone.position.kind=learned"]
    with pytest.raises(AgentBuildError, match=r"backbone\.max_position=10 but .* episodes run up to 10 steps .*"
                                              r"set backbone\.max_position >= 11"):
        train(compose(overrides=[*PPO_TINY, *learned, "backbone.max_position=10"]), tmp_path / "ten")
    state = train(compose(overrides=[*PPO_TINY, *learned, "backbone.max_position=11"]), tmp_path / "eleven")
    assert state.step == 2


# ------------------------------------------------- PPO: a scalar Box action space
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


SCALAR = "rl_tformers_test/ScalarAction-v0"


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


# ------------------------------------------------- DDP: PPO does not split train.batch_size
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


# ------------------------------------------------- DDP: PPO critic warm-up
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
    assert r.returncode == 0, r.stderr[-3000:]  # not rank 1 ... "Expected to have finished reduction"
    assert [m["step"] for m in read_metrics(two)] == [1, 2, 3, 4]
    r = train_cli(*args, "train.steps=2", "--run-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    ddp, single = (load_checkpoint(run / "checkpoints" / "step_000000002.pt")["model"] for run in (two, one))
    for name in ddp:  # after the warm-up: encoder and actor untouched (no decay either), as in one process
        if not name.startswith("value."):
            assert torch.equal(ddp[name], single[name]), name
    end = load_checkpoint(two / "checkpoints" / "step_000000004.pt")["model"]
    assert not torch.equal(end["actor.net.0.weight"], ddp["actor.net.0.weight"])  # then the actor trains


# ------------------------------------------------- PPO trains without dropout: the ratio starts at 1
def _ppo_with(dropout: float):
    from omegaconf import OmegaConf
    from rl_tformers.agents.gtrxl.model import gtrxl_backbone
    from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO

    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"n_envs": 2, "n_steps": 8, "n_epochs": 1, "n_minibatches": 1})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4, dropout=dropout)
    torch.manual_seed(0)
    return GTrXLPPO.for_training(cfg, None, torch.device("cpu"))


def test_ppo_with_dropout_configured_recomputes_the_rollout_s_log_probabilities() -> None:
    """The first update of a rollout must see the log-probabilities and values the rollout stored
    (ratio 1), in train mode as the trainer runs it. With dropout 0.3 they would differ by
    0.0099, so the model has no dropout at all, the config's is warned about, and they agree to
    float rounding (the rollout ran N rows per forward, the update all S x N at once)."""
    from rl_tformers.agents.gtrxl.ppo_update import state_from_rows

    from rl_tformers.backbone_config import ConfigAdviceWarning

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ppo = _ppo_with(0.3)
    ppo.model.train()  # as in the trainer's loop, for the rollout and the update
    ro = ppo.collector.collect()
    mb = next(ppo.minibatches(ro))
    assert mb["x"].shape[0] == 16  # the whole rollout: S x N = 8 x 2
    m = {k: v for k, v in mb.items() if isinstance(v, torch.Tensor)}
    st = state_from_rows(m["mem"], m["mem_pos"], m["mem_valid"], m["mem_seg"], m["episode"], m["pos"])
    h = ppo.model.encoder(m["x"][:, None], m["pos"][:, None], state=st).features[:, 0]
    torch.testing.assert_close(ppo.model.actor.log_prob(h, m["actions"]), m["logp"], atol=1e-6, rtol=0)
    torch.testing.assert_close(ppo.model.state_value(h), m["values"], atol=1e-6, rtol=0)
    _, logs = ppo.loss(mb)
    assert abs(logs["approx_kl"]) < 1e-7 and logs["clipfrac"] == 0.0
    assert all(m.p == 0.0 for m in ppo.model.modules() if isinstance(m, torch.nn.Dropout))
    assert all(m.dropout_p == 0.0 for m in ppo.model.modules() if hasattr(m, "dropout_p"))
    assert ppo.model_cfg.backbone["dropout"] == ppo.model_cfg.backbone["attn_dropout"] == 0.0
    advice = [str(w.message) for w in said if issubclass(w.category, ConfigAdviceWarning)]
    assert len(advice) == 1 and advice[0].startswith(
        "gtrxl_ppo trains without dropout: backbone.dropout=0.3, backbone.attn_dropout=0.3 set to 0. ")
    with warnings.catch_warnings():  # a config without dropout (the default) is not warned about
        warnings.simplefilter("error", ConfigAdviceWarning)
        _ppo_with(0.0)


# ------------------------------------------------- PPO: learned positions, no time limit
class _EndlessEnv(gym.Env):
    """Episodes that never end (and no TimeLimit: registered without max_episode_steps)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), 1.0, False, False, {}


ENDLESS = "rl_tformers_test/Endless-v0"


if ENDLESS not in gym.registry:
    gym.register(ENDLESS, entry_point=_EndlessEnv)


# one update per rollout of 6 steps: rollout 3 covers episode steps 12..17, past a 16-row table
ENDLESS_PPO = ["agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=6", "agent.n_epochs=1",
               "agent.n_minibatches=1", "train.steps=4", "train.checkpoint_every=1", "train.progress=false",
               "train.log_every=1", "eval.at_end=false", "eval.every=0", "device=cpu", "backbone.d_model=16",
               "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4", f"agent.env_id={ENDLESS}",
               "backbone.position.kind=learned", "backbone.max_position=16"]


def test_ppo_learned_positions_without_a_time_limit_stop_with_a_clear_error_and_stay_resumable(tmp_path) -> None:
    """A ConfigError (the command line's one ``error:`` line, not "position.learned: positions
    must lie in [0, 16) but got [16, 16]" from inside the rollout) at the step that would need
    row 16, naming the option, the environment, the step and the fixes; the checkpoints of the
    updates before that rollout are intact and a resume continues from them exactly (to the same
    step of the same episode). The time limit the message suggests is checked before training
    when it is too long, and trains when it fits."""
    from rl_tformers.runtime import checkpoint as ckpt
    from rl_tformers.runtime.agent_registry import AgentBuildError
    from rl_tformers.runtime.run_config import ConfigError

    run = tmp_path / "endless"
    with pytest.raises(ConfigError) as err:  # (not a plain ValueError from the position table)
        train(compose(overrides=ENDLESS_PPO), run)
    msg = str(err.value)
    assert type(err.value).__name__ == "EpisodeLengthError"
    assert msg.startswith(f"gtrxl_ppo: an episode of {ENDLESS} (environment 0 of 2) reached episode step 16 in "
                          f"rollout 3, but backbone.position.kind=learned has table rows for episode steps 0..15 "
                          f"only (backbone.max_position=16) and {ENDLESS} has no time limit. ")
    assert "the checkpoints it wrote are intact" in msg
    assert msg.endswith("Fix it in a new run: agent.env_kwargs.max_episode_steps=15 (or less: a time limit whose "
                        "cuts are bootstrapped), backbone.max_position > the longest episode, or a relative "
                        "position kind (backbone.position.kind=xl_relative)")
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 1]  # the two rollouts trained before
    with pytest.raises(ConfigError) as again:  # exact continuation: the same episode, the same step
        resume(run)
    assert str(again.value) == msg
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 1]
    # the suggested time limit: one too long is refused before anything is written, one that fits trains
    with pytest.raises(AgentBuildError, match=r"backbone\.max_position=16 but .* episodes run up to 16 steps"):
        train(compose(overrides=[*ENDLESS_PPO, "agent.env_kwargs={max_episode_steps: 16}"]), tmp_path / "sixteen")
    assert not (tmp_path / "sixteen").exists()
    state = train(compose(overrides=[*ENDLESS_PPO, "agent.env_kwargs={max_episode_steps: 15}"]), tmp_path / "fifteen")
    assert state.step == 4


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
    return GTrXLPPO.for_training(cfg, None, torch.device("cpu"))


# -- advantage normalisation over a minibatch of one row ------------------------------------------------
def test_ppo_refuses_advantage_normalisation_over_one_row_minibatches() -> None:
    """1 x 3 samples in 2 minibatches are minibatches of 2 and 1 rows: refused, since the one-row
    minibatch's advantage would be used unnormalised (normalize_advantages returns a single row
    unchanged) next to normalised ones."""
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
    return GTrXLPPO.for_training(cfg, None, "cpu")


def test_ppo_fine_tuning_refuses_an_environment_whose_spaces_the_offline_run_does_not_fit(
    continuous_offline_run: Path,
) -> None:
    """PositionOnlyCartPole has 2-dim observations and 2 discrete actions: refused, since the offline
    continuous actor's 2 tanh-mean outputs would load as the logits of a discrete policy (same
    parameter shapes)."""
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
    assert not ppo.spec.discrete and ppo.model_cfg.act_dim == 2


# -- train.compile ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("critic", ["value", "iql"])
def test_train_compile_compiles_the_modules_gtrxl_calls(critic: str) -> None:
    """The trainer's train.compile=true compiles the modules GTrXL calls: GTrXLModel has no forward
    (the losses and policies call the encoder and heads), so model.compile() alone would compile
    nothing that runs."""
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
        GTrXLPPO.for_training(cfg, None, "cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=ConfigAdviceWarning)
        GTrXLPPO.for_training(
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
        GTrXLPPO.for_training(cfg, None, "cpu")


def test_ppo_says_early_exit_runs_at_full_depth() -> None:
    """PPO trains at full depth: an early-exit depth kind is accepted with a warning saying it
    never exits, and the run's policy runs every layer."""
    cfg = compose(
        overrides=[
            "agent.kind=gtrxl_ppo",
            "backbone.depth.kind=early_exit",
            "agent.n_envs=2",
            "agent.n_steps=4",
            "agent.n_minibatches=1",
            "device=cpu",
        ]
    )
    with pytest.warns(ConfigAdviceWarning, match=r"backbone\.depth\.kind=early_exit runs every layer here: PPO's "
                      r"loss trains the policy and value at full depth.*use backbone\.depth\.kind=fixed"):
        agent = GTrXLPPO.for_training(cfg, None, "cpu")
    # the depth module's exit threshold stays +inf (GTrXL refuses backbone.depth.threshold), so
    # no token ever exits: every layer runs
    assert [float(m.exit_threshold) for m in agent.model.modules() if hasattr(m, "exit_threshold")] == [math.inf]


class MatrixActionEnv(gym.Env):
    """A Box(2, 2) action; the observation echoes the action it received (flattened)."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
        self.action_space = spaces.Box(-1.0, 1.0, (2, 2), np.float32)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        action = np.asarray(action)
        if action.shape != (2, 2):
            raise AssertionError(f"MatrixActionEnv got an action of shape {action.shape}")
        self.t += 1
        return action.reshape(-1).astype(np.float32), 0.0, False, self.t >= 5, {}


class PixelEnv(gym.Env):
    """uint8 observations of 0..255 (an image of 2 x 2 pixels), 3 actions."""

    def __init__(self) -> None:
        self.observation_space = spaces.Box(0, 255, (2, 2), np.uint8)
        self.action_space = spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.array([[0, 50], [200, 255]], np.uint8), {}

    def step(self, action):
        return np.array([[0, 50], [200, 255]], np.uint8), 0.0, False, False, {}


for _env_id, _env_cls in (("rl_tformers_test/MatrixAction-v0", MatrixActionEnv), ("rl_tformers_test/Pixels-v0", PixelEnv)):
    if _env_id not in gym.registry:
        gym.register(_env_id, entry_point=_env_cls)


def _ppo_two_envs(**agent) -> GTrXLPPO:
    cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
    cfg.agent.update({"n_envs": 2, "n_steps": 6, "n_minibatches": 1, **agent})
    cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    return GTrXLPPO.for_training(cfg, None, torch.device("cpu"))


# ------------------------------------------------- Box actions of more than one axis
def test_ppo_and_its_policy_send_box_actions_in_the_environments_shape() -> None:
    """A Box(2, 2) action space got flat (4,) actions from the rollout and the evaluation policy."""
    torch.manual_seed(0)
    ppo = _ppo_two_envs(env_id="rl_tformers_test/MatrixAction-v0")
    ro = ppo.collector.collect()  # raised in the environment: "got an action of shape (4,)"
    assert ro["actions"].shape == (6, 2, 4)
    env_a = ppo.spec.to_env(ro["actions"][0])
    assert env_a.shape == (2, 2, 2) and env_a.dtype == np.float32
    np.testing.assert_allclose(env_a.reshape(2, 4), ro["actions"][0].clamp(-1, 1).numpy(), rtol=0, atol=1e-6)
    policy = ppo.policy()
    actions, _ = policy.act(np.zeros((3, 4), np.float32), policy.initial_state(3), np.ones(3, bool))
    assert actions.shape == (3, 2, 2)


# ------------------------------------------------- a_{t-1} input: the clamped action, as GTrXLPolicy feeds it
def test_ppo_previous_action_input_is_the_action_the_environment_took() -> None:
    """The rollout feeds the clamped action the environment got (1.0, not the Gaussian sample 4.5)
    as a_{t-1}, as GTrXLPolicy does: the rollout policy is the evaluated one."""
    env_id = "rl_tformers/PositionOnlyPendulum-v1"
    torch.manual_seed(0)
    ppo = _ppo_two_envs(env_id=env_id, n_envs=2, n_steps=12, prev_action=True, prev_reward=True, reward_scale=0.5)
    ppo.model.actor.log_std.data.fill_(0.5)
    policy = ppo.policy(deterministic=False)  # the statistics the rollout normalises with
    torch.manual_seed(1)
    ro = ppo.collector.collect()
    assert ro["actions"].abs().max() > 1.0  # samples beyond the bounds happen
    assert not ro["dones"].any()  # no reset in 12 steps: a_{t-1} is the previous step's action
    prev_in = ro["x"][1:, :, 2]  # inputs [obs (2) ; a_{t-1} (1) ; r_{t-1} (1)]
    assert torch.equal(prev_in, ro["actions"][:-1, :, 0].clamp(-1.0, 1.0))
    # GTrXLPolicy (sampling, same generator) takes exactly the rollout's actions
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(env_id) for _ in range(2)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=[0, 1])
    state, start, last = policy.initial_state(2), np.ones(2, bool), None
    torch.manual_seed(1)
    for t in range(12):
        a, state = policy.act(obs, state, start, last)
        np.testing.assert_allclose(a, ppo.spec.to_env(ro["actions"][t]), rtol=0, atol=1e-5)
        obs, last, term, trunc, _ = envs.step(a)
        start = term | trunc


# ------------------------------------------------- DDP: one set of observation statistics
def test_ppo_ranks_keep_the_observation_statistics_of_all_ranks(tmp_path: Path) -> None:
    """Each rank updated its running mean/std with its own rollout only: the ranks normalised
    their inputs differently and only rank 0's statistics reached the checkpoint."""
    outs = two_ranks(tmp_path, """
        import numpy as np
        from omegaconf import OmegaConf
        from rl_tformers.agents.gtrxl.model import gtrxl_backbone
        from rl_tformers.agents.gtrxl.ppo import PPO_DEFAULTS, GTrXLPPO
        cfg = OmegaConf.create({"seed": 0, **PPO_DEFAULTS})
        cfg.agent.update({"n_envs": 2, "n_steps": 5, "n_minibatches": 1})
        cfg.backbone = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
        torch.manual_seed(0)
        ppo = GTrXLPPO.for_training(cfg, None, "cpu")
        seen = []
        gather = ppo.collector.rollout_observations
        ppo.collector.rollout_observations = lambda raw: (seen.append(np.asarray(raw).tolist()), gather(raw))[1]
        ppo.collector.collect()
        out.update(mean=ppo.obs_rms.mean.tolist(), var=ppo.obs_rms.var.tolist(), count=ppo.obs_rms.count,
                   own=seen[0])
    """)
    own = [np.asarray(o["own"], np.float64) for o in outs]  # each rank's (S, N, O) observations
    assert not np.array_equal(own[0], own[1])
    expected = RunningMeanStd((2,))
    expected.update(np.stack(own, 1).reshape(-1, 2))  # one process with 4 envs: (S, W, N, O)
    for o in outs:
        assert o["count"] == expected.count == 20 + 1e-4
        np.testing.assert_array_equal(o["mean"], expected.mean)
        np.testing.assert_array_equal(o["var"], expected.var)


# ------------------------------------------------- options that poison or silently change training
@pytest.mark.parametrize("option, value, message", [
    ("ent_coef", float("nan"), "agent.ent_coef must be a number >= 0, got nan (float)"),
    ("vf_coef", -1.0, "agent.vf_coef must be a number >= 0, got -1.0"),
    ("reward_scale", 0.0, "agent.reward_scale must be a number > 0, got 0.0"),
    ("reward_scale", "abc", "agent.reward_scale must be a number > 0, got 'abc' (str)"),
    ("head_hidden", -3, "agent.head_hidden must be an integer >= 0, got -3"),
])
def test_ppo_refuses_bad_loss_and_scale_options(monkeypatch, option, value, message) -> None:
    """Refused naming the option: ent_coef=nan would train on a NaN loss, vf_coef < 0 ascend the
    value error, reward_scale=0 zero every reward, head_hidden < 0 silently give linear heads."""
    monkeypatch.setattr(gym, "make", lambda *a, **k: pytest.fail("an environment was made before the check"))
    with pytest.raises(ValueError) as info:
        _ppo_two_envs(**{option: value})
    assert str(info.value) == message


# ------------------------------------------------- obs_norm=false: raw observations, not clipped to 10
def test_ppo_without_observation_normalisation_feeds_the_raw_observations() -> None:
    ppo = _ppo_two_envs(env_id="rl_tformers_test/Pixels-v0", obs_norm=False)
    ro = ppo.collector.collect()
    assert ro["x"][0, 0].tolist() == [0.0, 50.0, 200.0, 255.0]  # not [0, 10, 10, 10]
    policy = ppo.policy()
    assert policy.obs_clip is None and policy.obs_mean.tolist() == [0.0] * 4 and policy.obs_std.tolist() == [1.0] * 4
    assert _ppo_two_envs(env_id="rl_tformers_test/Pixels-v0").policy().obs_clip == 10.0  # obs_norm=true still clips


# ------------------------------------------------- fine-tuning an offline run whose memory PPO cannot store
def test_ppo_fine_tuning_refuses_an_offline_run_whose_memory_ppo_cannot_store(tmp_path: Path) -> None:
    """An offline run with a learned compressive memory (conv, the default) is refused up front,
    naming the checkpoint: PPO's rollouts would never train its compressor."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=2, seed=0), data)
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", f"dataset.path={data}", "train.steps=1",
        "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu",
        "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.kind=compressive",
    ]), tmp_path / "offline")
    cfg = compose(overrides=["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d2-v0",
                             f"agent.init_checkpoint={tmp_path / 'offline'}", "agent.n_envs=1", "agent.n_steps=4",
                             "agent.n_minibatches=1", "device=cpu"])
    with pytest.raises(ValueError, match=rf"backbone\.memory\.compression='conv' \(agent\.init_checkpoint="
                                         rf"{tmp_path / 'offline'}\); PPO collects its rollouts without gradient "
                                         r".*; train the offline run with backbone\.memory\.compression=max or mean$"):
        GTrXLPPO.for_training(cfg, None, "cpu")


def test_ppo_fine_tuning_refuses_a_plain_window_offline_run_with_or_without_agent_window(tmp_path: Path) -> None:
    """An offline run without memory (agent.window=2, memory kind none) cannot be fine-tuned: the
    error names the checkpoint and says what to do, with agent.window set or not (no advice that
    leads to the other refusal)."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=2, seed=0), data)
    offline = tmp_path / "offline"
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.window=2", "agent.seq_len=2", "agent.burn_in=0", f"dataset.path={data}",
        "train.steps=1", "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false",
        "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.kind=none",
    ]), offline)
    ppo = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d2-v0", f"agent.init_checkpoint={offline}",
           "agent.n_envs=1", "agent.n_steps=4", "agent.n_minibatches=1", "device=cpu"]
    said = (rf"^gtrxl_ppo: agent\.init_checkpoint={offline} is a plain-window run \(backbone\.memory\.kind='none'\); "
            r"PPO fine-tunes offline runs with memory \('xl', 'spalm', 'compressive'\) only: train the offline run "
            r"with one of them, or start PPO's plain window without agent\.init_checkpoint")
    for extra in ([], ["agent.window=2", "backbone.memory.kind=none"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the ignored config settings of fine-tuning)
            with pytest.raises(ValueError, match=said):
                GTrXLPPO.for_training(compose(overrides=[*ppo, *extra]), None, "cpu")


# ------------------------------------------------- fine-tuning: r_{t-1} in the offline run's units
def test_ppo_fine_tuning_feeds_the_previous_reward_in_the_offline_units(tmp_path: Path) -> None:
    """The offline encoder learned r_{t-1} as raw / 10 (the recall data's reward scale); PPO feeds
    it in those units, not raw * agent.reward_scale (10x larger here, off the distribution it was
    trained on)."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.loading import load_run
    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=1, seed=0), data)
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", "agent.prev_reward=true", f"dataset.path={data}",
        "train.steps=1", "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false",
        "device=cpu", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4",
    ]), tmp_path / "offline")
    offline = load_run(tmp_path / "offline")
    mult = offline.extra["reward_mult"]
    assert mult == 0.1  # 1 / the recall data's reward scale (10)
    cfg = compose(overrides=["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d1-v0",
                             f"agent.init_checkpoint={tmp_path / 'offline'}", "agent.n_envs=2", "agent.n_steps=12",
                             "agent.n_minibatches=1", "agent.reward_scale=1.0", "device=cpu"])
    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(cfg, None, "cpu")
    ro = ppo.collector.collect()
    prev_r = ro["x"][1:, :, -1]  # inputs [obs (4) ; r_{t-1}]
    assert (ro["rewards"] == 1.0).any() and not ro["dones"].any()
    assert torch.equal(prev_r, ro["rewards"][:-1] * torch.tensor(mult, dtype=torch.float32))
    assert ppo.policy().reward_mult == mult
    assert ppo.extra_state()["input_reward_mult"] == mult  # and a reloaded policy keeps it


@pytest.mark.parametrize("option, message", [
    ("agent.n_minibatches=4", "agent.n_minibatches=4 is more than the agent.n_envs x agent.n_steps = 2 samples of a "
                              "rollout (a minibatch would be empty); use at most 2"),
    ("agent.n_envs=0", "agent.n_envs must be an integer >= 1, got 0"),
    ("agent.n_steps=0", "agent.n_steps must be an integer >= 1, got 0"),
    ("agent.n_epochs=0", "agent.n_epochs must be an integer >= 1, got 0"),
    ("agent.gae_lambda=1.5", "agent.gae_lambda must be a number in [0, 1], got 1.5"),
    ("agent.clip_coef=0", "agent.clip_coef must be a number > 0, got 0"),
])
def test_ppo_refuses_rollout_options_that_crash_mid_run(monkeypatch, option, message) -> None:
    """n_minibatches above the rollout's samples and n_envs/n_steps/n_epochs = 0 are refused naming
    the option (they would crash mid-run with "min(): Expected reduction dim", IndexError, stack or
    modulo-by-zero tracebacks)."""
    monkeypatch.setattr(gym, "make", lambda *a, **k: pytest.fail("an environment was made before the check"))
    with pytest.raises(ConfigError) as info:
        compose(None, ["agent.kind=gtrxl_ppo", "agent.n_envs=1", "agent.n_steps=2", "agent.n_minibatches=1",
                       option, "device=cpu"])
    assert str(info.value) == message


# ------------------------------------------------------------------- PPO fine-tuning inputs
def test_ppo_fine_tuning_says_which_agent_inputs_it_takes_from_the_checkpoint(tmp_path: Path) -> None:
    """`train -c gtrxl/ppo_cartpole_finetune` records `agent.head_hidden: 64` (inherited from
    ppo_cartpole.yaml) in config.yaml, but builds the offline run's head_hidden=0 (207,491
    parameters, not 224,131), without a word; a changed backbone setting is warned about
    (tests/agents/test_gtrxl_training.py), a changed head_hidden / prev_reward is not."""
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=1, seed=0), data)
    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4",
            "backbone.dropout=0", "backbone.attn_dropout=0", "backbone.ffn_dropout=0"]
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", f"dataset.path={data}", "train.steps=1",
        "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu",
        *tiny,
    ]), tmp_path / "offline")
    over = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d1-v0", f"agent.init_checkpoint={tmp_path / 'offline'}",
            "agent.n_envs=2", "agent.n_steps=6", "agent.n_minibatches=1", "device=cpu", *tiny,
            "agent.head_hidden=32", "agent.prev_reward=true"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ppo = GTrXLPPO.for_training(compose(overrides=over), None, "cpu")
    assert ppo.model_cfg.head_hidden == 0  # the checkpoint's, as docs/gtrxl.md says
    said = " ".join(str(w.message) for w in caught)
    assert "agent.head_hidden" in said and "agent.prev_reward" in said, said


# ------------------------------------------------- PPO: the plain window (agent.window, no memory)
NO_MEM_LEN = [o for o in PPO_TINY if not o.startswith("backbone.memory.mem_len")]
WINDOW_PPO = [*NO_MEM_LEN, "agent.window=4", "backbone.memory.kind=none"]


def test_ppo_says_a_plain_window_longer_than_the_time_limit_is_padding(caplog) -> None:
    """ShortCartPole's episodes run at most 10 steps: a window of 12 holds 2 slots of padding
    forever, and the warning names the window that acts the same; a window of 4 says nothing."""
    import logging

    over = [o for o in WINDOW_PPO if not o.startswith("agent.window")]
    lg = logging.getLogger("rl_tformers")  # the CLI sets propagate=False: listen on it directly, once
    propagate, lg.propagate = lg.propagate, False
    lg.addHandler(caplog.handler)
    try:
        GTrXLPPO.for_training(compose(overrides=[*over, "agent.window=12"]), None, "cpu")
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        caplog.clear()
        GTrXLPPO.for_training(compose(overrides=WINDOW_PPO), None, "cpu")
        quiet = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        lg.removeHandler(caplog.handler)
        lg.propagate = propagate
    assert said == [
        f"gtrxl_ppo: agent.window=12 but {SHORT} episodes run at most 10 steps, so the window never holds more "
        f"than 10 valid steps and the other 2 slots are masked padding; agent.window=10 acts the same (up to "
        f"rounding) re-encoding 10 tokens per step instead of 12"]
    assert quiet == []


def test_ppo_plain_window_stores_each_step_s_window_and_the_update_recomputes_its_log_probabilities() -> None:
    """With ``agent.window=4`` a rollout keeps, per step, the window the step acted with: its own
    inputs in slot 3 and, before them, the inputs of the same episode's previous steps (none
    from before an episode start, in ShortCartPole's 10-step episodes); the update re-encodes
    those windows and gets back the rollout's log-probabilities and values (ratio 1)."""
    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(compose(overrides=WINDOW_PPO), None, "cpu")
    assert not ppo.model.encoder.stateful and ppo.model_cfg.window == 4
    ro = ppo.collector.collect()
    assert {"window_x", "window_pos", "window_valid"} <= set(ro) and not {"mem", "episode"} & set(ro)
    x, pos, wx, wp, wv = ro["x"], ro["pos"], ro["window_x"], ro["window_pos"], ro["window_valid"]
    assert tuple(wx.shape) == (12, 2, 4, x.shape[-1])
    for s in range(12):
        for n in range(2):
            for k in range(4):  # slot 3 - k holds step s - k while it is in the same episode
                same = s - k >= 0 and int(pos[s, n]) - k >= 0
                assert bool(wv[s, n, 3 - k]) == same
                if same:
                    assert torch.equal(wx[s, n, 3 - k], x[s - k, n]) and int(wp[s, n, 3 - k]) == int(pos[s - k, n])
    assert bool((pos[:, 0] == 0)[1:].any())  # an episode started inside the rollout (the check above saw it)
    mb = next(ppo.minibatches(ro))
    _, logs = ppo.loss(mb)
    assert abs(float(logs["approx_kl"])) < 1e-7 and float(logs["clipfrac"]) == 0.0
    h = ppo.model.encoder.encode_window(mb).features[:, -1]
    torch.testing.assert_close(ppo.model.state_value(h), mb["values"], atol=1e-6, rtol=0)
    torch.testing.assert_close(ppo.model.actor.log_prob(h, mb["actions"]), mb["logp"], atol=1e-6, rtol=0)


def test_ppo_plain_window_acts_as_its_policy_does() -> None:
    """The rollout's features of a step equal the deterministic policy's over the same episode
    (GTrXLPolicy's window, built the same way): the actions PPO learns are the ones it evaluates."""
    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(compose(overrides=WINDOW_PPO), None, "cpu")
    policy = ppo.policy(deterministic=True)  # with the observation statistics the rollout acts with
    ro = ppo.collector.collect()
    state = policy.initial_state(2)
    env = [ppo.spec.make() for _ in range(2)]
    first = ppo.collector.seed * 10_000
    obs = np.stack([e.reset(seed=first + i)[0] for i, e in enumerate(env)])
    start = np.ones(2, bool)
    for s in range(5):  # the first 5 steps, feeding the rollout's actions (episodes of 10 steps: no reset)
        _, state = policy.act(obs, state, start)
        torch.testing.assert_close(state.window_x, ro["window_x"][s], atol=1e-6, rtol=0)
        assert torch.equal(state.window_valid, ro["window_valid"][s])
        obs = np.stack([e.step(int(a))[0] for e, a in zip(env, ro["actions"][s])])
        start[:] = False


@pytest.mark.parametrize("extra, message", [
    (["agent.window=4"], r"agent\.window=4 re-encodes a plain window of the last 4 steps at every step, but "
                         r"backbone\.memory\.kind='xl' carries memory; use agent\.window=0, or agent\.window=4 with "
                         r"backbone\.memory\.kind=none"),
    (["backbone.memory.kind=none"], r"backbone\.memory\.kind='none'; PPO stores the memory of every rollout step, "
                                    r"which it does for 'xl', 'spalm', 'compressive', or runs 'none' with a plain "
                                    r"window of W steps \(agent\.window=W"),
])
def test_ppo_refuses_a_window_with_memory_and_no_memory_without_a_window(extra, message) -> None:
    with pytest.raises(ValueError, match=message):
        GTrXLPPO.for_training(compose(overrides=[*NO_MEM_LEN, *extra]), None, "cpu")


# ------------------------------------------------- PPO: the compressive memory (parameter-free compression)
COMPRESSIVE_PPO = [*NO_MEM_LEN, "backbone.memory.kind=compressive", "backbone.memory.mem_len=4",
                   "backbone.memory.compressed_len=2", "backbone.memory.rate=2", "backbone.memory.compression=mean"]


def test_ppo_compressive_memory_is_stored_at_its_full_width_and_recomputed_as_it_acted() -> None:
    """Rae et al.'s memory in PPO: its FIFO grows to m_m + c - 1 = 5 slots in an episode's first
    steps, so each step's memory is stored at the full width 2 + 5 (invalid slots after the
    compressed ones); compressed slots fill as ShortCartPole's episodes run, and the update's
    log-probabilities and values over the stored memories are the rollout's (ratio 1)."""
    from rl_tformers.agents.gtrxl.ppo_update import minibatch_features, pad_memory, unpad_memory

    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(compose(overrides=COMPRESSIVE_PPO), None, "cpu")
    ro = ppo.collector.collect()
    assert tuple(ro["mem"].shape) == (12, 2, 1, 7, 16) and tuple(ro["mem_valid"].shape) == (12, 2, 7)
    assert not ro["mem_valid"][0].any() and bool(ro["mem_valid"][:, :, :2].any())  # compressed slots filled
    mb = next(ppo.minibatches(ro))
    _, logs = ppo.loss(mb)
    assert abs(float(logs["approx_kl"])) < 1e-6 and float(logs["clipfrac"]) == 0.0
    with torch.no_grad():
        h, _ = minibatch_features(ppo.model.encoder, {k: v for k, v in mb.items() if isinstance(v, torch.Tensor)})
    torch.testing.assert_close(ppo.model.actor.log_prob(h, mb["actions"]), mb["logp"], atol=1e-6, rtol=0)
    torch.testing.assert_close(ppo.model.state_value(h), mb["values"], atol=1e-6, rtol=0)
    running = ppo.collector.memory
    assert running.pos.shape[1] == 7  # past the first steps: the full width itself
    early = ppo.model.encoder.initial_state(2, "cpu")
    padded = pad_memory(ppo.model.encoder, early)
    assert padded.pos.shape[1] == 7 and not padded.valid.any()
    back = unpad_memory(ppo.model.encoder, padded, early.pos.shape[1])
    assert all(torch.equal(a, b) for a, b in zip((back.pos, back.valid, back.seg), (early.pos, early.valid, early.seg)))


@pytest.mark.parametrize("attention", [["backbone.attention.kind=local", "backbone.attention.block=2",
                                        "backbone.attention.memory=2"],
                                       ["backbone.attention.kind=fixed", "backbone.attention.stride=2",
                                        "backbone.attention.summary=1"]], ids=["local", "fixed"])
def test_ppo_compressive_memory_acts_at_its_full_width_while_it_grows(attention) -> None:
    """Attention that groups keys by slot (local blocks, fixed strides) sees other keys in one block at
    another memory width: the first rollout's steps, while the FIFO grows to its full width, act over
    the memory padded to that width, the one the update recomputes them over, so their log-probabilities
    and values come back (acting over the unpadded memory, they differed by up to 2e-3 here)."""
    from rl_tformers.agents.gtrxl.ppo_update import minibatch_features

    torch.manual_seed(0)
    ppo = GTrXLPPO.for_training(compose(overrides=[*COMPRESSIVE_PPO, *attention]), None, "cpu")
    ro = ppo.collector.collect()
    assert tuple(ro["mem_valid"].shape) == (12, 2, 7) and not ro["mem_valid"][0].any()  # from empty, full width
    mb = {k: v for k, v in next(ppo.minibatches(ro)).items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        h, _ = minibatch_features(ppo.model.encoder, mb)
    torch.testing.assert_close(ppo.model.actor.log_prob(h, mb["actions"]), mb["logp"], atol=1e-6, rtol=0)
    torch.testing.assert_close(ppo.model.state_value(h), mb["values"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("compression", ["conv", "dilated_conv", "most_used"])
def test_ppo_refuses_a_compressive_memory_whose_compressor_it_cannot_run(compression) -> None:
    overrides = [o for o in COMPRESSIVE_PPO if "compression=" not in o] + [f"backbone.memory.compression={compression}"]
    with pytest.raises(ValueError, match=rf"backbone\.memory\.compression='{compression}'; PPO collects its rollouts "
                                         r"without gradient .* use backbone\.memory\.compression=max or mean"):
        GTrXLPPO.for_training(compose(overrides=overrides), None, "cpu")
