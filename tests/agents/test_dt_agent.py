"""DT and BC through the shared trainer, checkpoint contents, the eval / plot commands, the demo."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
import yaml
from rl_tformers.agents.common.offline import DatasetInfo
from rl_tformers.agents.common.scripted import collect_delayed_expert
from rl_tformers.agents.decision_transformer.config import DTAgentConfig
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.recording import EpisodeRecorder
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import checkpoint as ckpt
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.resolved import read_resolved
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import resume, train
from tests.datafiles import write_d4rl_h5
from tests.runs import TINY_DT, train_dt

TINY_BB = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1"]
FAST = ["train.steps=6", "train.batch_size=8", "train.warmup_steps=2", "train.progress=false", "train.log_every=3",
        "device=cpu", "eval.episodes=2", "eval.n_envs=2", "agent.env_kwargs={max_episode_steps: 25}"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small per-step forward passes: one intra-op thread is as fast on an idle machine and far
    faster on a busy one (no waiting for a descheduled OpenMP worker)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

@pytest.fixture(scope="module")
def cartpole_data(tmp_path_factory):
    ds = collect_delayed_expert(20, seed=0, n_envs=10)
    return ds, save_d4rl_hdf5(ds, tmp_path_factory.mktemp("data") / "cartpole.hdf5")


@pytest.fixture(scope="module")
def dt_run(cartpole_data, tmp_path_factory):
    _, path = cartpole_data
    run_dir = tmp_path_factory.mktemp("runs") / "dt"
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY_BB, *FAST, "agent.targets=[20,200]"])
    train(cfg, run_dir)
    return run_dir


def test_checkpoint_stores_reward_scale_and_observation_stats(dt_run, cartpole_data):
    ds, _ = cartpole_data
    state = ckpt.find_latest_valid(dt_run).state
    extra = state["extra"]
    assert state["step"] == 6
    assert extra["reward_scale"] == 100.0  # power of ten below the largest |return| (<= 500)
    obs = np.asarray(ds.observations, np.float64)
    np.testing.assert_allclose(extra["obs_mean"].numpy(), obs.mean(0), rtol=0, atol=1e-5)
    np.testing.assert_allclose(extra["obs_std"].numpy(), obs.std(0), rtol=0, atol=1e-5)
    assert extra["env_id"] == "CartPole-v1"
    assert extra["dataset_return_max"] == pytest.approx(float(ds.episode_returns.max()))


def test_periodic_evaluation_is_logged(dt_run):
    recs = [json.loads(line) for line in (dt_run / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in recs if "eval/return_mean" in r]
    assert len(ev) == 1 and ev[0]["step"] == 6
    assert ev[0]["eval/target"] == 20.0 and ev[0]["eval/target_target1"] == 200.0
    assert 1 <= ev[0]["eval/return_mean"] <= 25  # evaluation episodes are cut at 25 steps


def test_eval_command_json_is_exact_and_reproducible(dt_run):
    runner = CliRunner()
    args = ["eval", str(dt_run), "--targets", "20,200", "--episodes", "3", "--envs", "2", "--seed", "7", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [r["target_return"] for r in out["results"]] == [20.0, 200.0]
    for r in out["results"]:
        assert set(r) >= {"target_return", "returns", "return_mean", "return_std", "normalized_score"}
        assert len(r["returns"]) == 3 and r["seeds"] == [7, 8, 9] and max(r["lengths"]) <= 25
        assert r["returns"] == [float(n) for n in r["lengths"]]  # CartPole: reward 1 per step
        assert r["return_mean"] == pytest.approx(float(np.mean(r["returns"])), abs=1e-9)
        assert r["normalized_score"] is None  # CartPole has no D4RL reference returns
    again = json.loads(runner.invoke(app, args).output)
    assert [r["returns"] for r in again["results"]] == [r["returns"] for r in out["results"]]


def test_eval_command_errors_are_clear(dt_run, tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["eval", str(tmp_path)])
    assert res.exit_code == 2 and "no checkpoint" in res.output
    res = runner.invoke(app, ["eval", str(dt_run), "--targets", "1,x"])
    assert res.exit_code == 2 and "'x' is not a number" in res.output


def test_plot_command_writes_png_and_tensorboard_image(dt_run, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "plot.png"
    res = CliRunner().invoke(app, ["plot", str(dt_run), "--out", str(out), "--targets", "200,20", "--episodes", "2"])
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 10_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    acc = EventAccumulator(str(dt_run), size_guidance={"images": 0})
    acc.Reload()
    assert "plot/return_conditioning" in acc.Tags()["images"]
    assert "eval/return_conditioning" in acc.Tags()["images"]  # logged by evaluate() during training


def test_load_run_rebuilds_the_policy_without_the_dataset(dt_run, cartpole_data):
    _, path = cartpole_data
    run = load_run(dt_run)
    assert run.kind == "dt" and run.step == 6 and run.agent.dataset is None
    state = ckpt.find_latest_valid(dt_run).state
    for k, v in run.agent.model.state_dict().items():
        torch.testing.assert_close(v, state["model"][k], rtol=0, atol=0)


def test_bc_and_filtered_bc_train_in_the_same_trainer(cartpole_data, tmp_path):
    ds, path = cartpole_data
    for frac in (1.0, 0.1):
        cfg = compose(None, ["agent.kind=bc", f"dataset.path={path}", f"agent.top_fraction={frac}", *FAST])
        res = train(cfg, tmp_path / f"bc{frac}")
        assert res.step == 6 and "eval/return_mean" in res.last_eval
        run = load_run(tmp_path / f"bc{frac}")
        kept = math.ceil(frac * ds.num_episodes)
        best = np.sort(ds.episode_returns)[::-1][:kept]
        assert run.extra["dataset_return_max"] == pytest.approx(best.max())
        assert run.extra["dataset_return_mean"] == pytest.approx(best.mean())
        res = CliRunner().invoke(app, ["eval", str(tmp_path / f"bc{frac}"), "--episodes", "2", "--json"])
        assert json.loads(res.output)["results"][0]["target_return"] is None


def test_last_action_mode_trains_on_end_aligned_windows(cartpole_data, tmp_path):
    _, path = cartpole_data
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY_BB, *FAST, "agent.mode=last_action",
                                       "backbone.causal=false", "eval.at_end=false"])
    from rl_tformers.agents.decision_transformer.agent import DTAgent

    agent = DTAgent(cfg, None, "cpu")
    batch = agent.batches(0)[0]
    assert batch["mask"][:, -1].all()  # every window ends at a real step: its action is the target
    assert res_ok(train(cfg, tmp_path / "la"))


def res_ok(res) -> bool:
    return res.step == 6 and math.isfinite(res.last_train["train/loss"])


def test_causal_mode_with_bidirectional_backbone_is_refused(cartpole_data, tmp_path):
    _, path = cartpole_data
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY_BB, *FAST, "backbone.causal=false"])
    with pytest.raises(ValueError, match="agent.mode=causal needs backbone.causal=true"):
        train(cfg, tmp_path / "bad")


def test_swapping_the_backbone_is_one_override(cartpole_data, tmp_path):
    _, path = cartpole_data
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY_BB, *FAST, "eval.at_end=false",
                                       "backbone.position.kind=rotary"])
    res = train(cfg, tmp_path / "rot")
    assert res_ok(res)
    assert load_run(tmp_path / "rot").agent.model.backbone.config.position.kind == "rotary"


def test_demo_smoke_writes_a_png(tmp_path):
    from rl_tformers.agents.common.demo import run_demo

    lines = []
    res = run_demo(tmp_path / "demo", steps=4, n_episodes=10, eval_episodes=2, targets=[20.0, 200.0],
                   extra_overrides=[*TINY_BB, "train.batch_size=8", "train.warmup_steps=1",
                                    "agent.env_kwargs={max_episode_steps: 25}"], echo=lines.append)
    assert res.plot.stat().st_size > 10_000 and res.plot.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(res.eval_json.read_text())
    assert [r["target_return"] for r in data["results"]] == [20.0, 200.0]
    assert all([len(x) for x in r["rewards"]] == r["lengths"] for r in data["results"])
    assert lines[0].startswith("[1/4]") and any(s.startswith("[4/4]") for s in lines)
    # the run's own targets are the demo's, and the printed eval line repeats eval.json exactly
    again = next(s for s in lines if "(repeat: rl-tformers eval" in s)
    args = again.split("rl-tformers ", 1)[1].rstrip(")").split()
    assert args[:2] == ["eval", str(res.run_dir)]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    rerun = json.loads(r.stdout[r.stdout.index("{"):])["results"]
    assert [x["target_return"] for x in rerun] == [20.0, 200.0]
    assert [x["returns"] for x in rerun] == [x["returns"] for x in data["results"]]


@pytest.mark.slow
def test_full_demo_follows_every_target(tmp_path):
    """``make demo``'s job end to end with its defaults: the DT achieves each target return
    (CartPole: return = episode length) within 15% + 15 steps, and the plot is written.
    Its wall time (87 s on 2 idle cores) is measured by the README's command, not asserted here."""
    from rl_tformers.agents.common.demo import run_demo

    res = run_demo(tmp_path / "demo", echo=lambda s: None)
    data = json.loads(res.eval_json.read_text())
    for r in data["results"]:
        assert len(r["returns"]) == 10
        assert abs(r["return_mean"] - r["target_return"]) <= 0.15 * r["target_return"] + 15, r["target_return"]
    assert res.plot.stat().st_size > 10_000


def test_demo_refuses_a_run_directory_that_holds_a_run(dt_run):
    from rl_tformers.agents.common.demo import run_demo

    from rl_tformers.runtime.trainer import RunDirError

    before = sorted(p.name for p in dt_run.iterdir())
    with pytest.raises(RunDirError, match="already holds a run"):
        run_demo(dt_run, steps=1, echo=lambda s: None)
    assert sorted(p.name for p in dt_run.iterdir()) == before  # nothing written


def test_gaussian_head_trains_and_evaluates_on_continuous_actions(tmp_path):
    from tests.pendulum import random_pendulum_dataset

    ds = random_pendulum_dataset([30] * 6)  # random-action episodes of 30 steps
    path = save_d4rl_hdf5(ds, tmp_path / "pendulum.hdf5")
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY_BB, *FAST, "agent.head=gaussian",
                                       "agent.max_ep_len=30", "agent.targets=[-100]"])
    res = train(cfg, tmp_path / "gauss")
    assert res.step == 6 and {"train/nll", "train/entropy", "train/temperature"} <= set(res.last_train)
    assert -25 * 16.3 <= res.last_eval["eval/return_mean"] <= 0  # 25 steps, reward in [-16.3, 0]
    with pytest.raises(ValueError, match="gaussian needs continuous actions"):
        from rl_tformers.agents.decision_transformer.model import DTConfig

        DTConfig(obs_dim=4, act_dim=2, discrete=True, head="gaussian")


MUJOCO_LEVELS = [(t, lvl) for t in ("hopper", "walker2d", "halfcheetah")
                 for lvl in ("medium", "medium_replay", "medium_expert")]


def test_shipped_mujoco_configs_are_the_papers_setting():
    """Chen et al. 2021, table 8 (MuJoCo), with GPT-2's dropout placement (none on the FFN hidden layer)."""
    for task, level in MUJOCO_LEVELS:
        name = f"dt/{task}_{level}"
        cfg = compose(name, [])
        assert cfg.dataset.path == f"rlt/{task}-v5/{level.replace('_', '-')}-v1", name
        bb, tr, ag = cfg.backbone, cfg.train, cfg.agent
        assert (bb.d_model, bb.n_layers, bb.n_heads, bb.activation) == (128, 3, 1, "relu"), name
        assert (bb.dropout, bb.attn_dropout, bb.ffn_dropout, ag.embed_dropout) == (0.1, 0.1, 0.0, 0.1), name
        assert (ag.context_len, ag.max_ep_len) == (20, 1000), name
        assert (tr.lr, tr.weight_decay, tr.grad_clip, tr.batch_size) == (1e-4, 1e-4, 0.25, 64), name
        assert (tr.schedule, tr.warmup_steps, tr.steps) == ("linear_warmup", 10000, 100000), name


def test_shipped_bc_configs_match_their_dt_configs():
    """Every DT results row has its BC and %BC (best 10% of episodes) baseline on the same dataset."""
    for task, level in MUJOCO_LEVELS:
        dt = compose(f"dt/{task}_{level}", [])
        bc, top = compose(f"bc/{task}_{level}", []), compose(f"bc/{task}_{level}_top10", [])
        assert (bc.agent.kind, top.agent.kind) == ("bc", "bc")
        assert bc.dataset.path == top.dataset.path == dt.dataset.path
        assert (bc.agent.top_fraction, top.agent.top_fraction) == (1.0, 0.1)
        assert (bc.train.steps, bc.train.lr, bc.train.batch_size) == (dt.train.steps, dt.train.lr, dt.train.batch_size)


def test_runs_saved_before_an_agent_option_existed_still_load(dt_run):
    """A checkpoint whose config predates ``agent.embed_init`` (added later) loads, as gpt2."""
    from omegaconf import OmegaConf
    from rl_tformers.agents.decision_transformer.agent import load_for_inference

    state = ckpt.find_latest_valid(dt_run).state
    cfg = OmegaConf.create(state["config"])
    del cfg.agent["embed_init"]
    agent = load_for_inference(cfg, state)
    assert agent.model_cfg.embed_init == "gpt2"
    for k, v in agent.model.state_dict().items():
        torch.testing.assert_close(v, state["model"][k], rtol=0, atol=0)


runner = CliRunner()


FAST_AGENTS = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.progress=false", "device=cpu",
        "eval.every=0", "eval.at_end=false", "eval.episodes=2", "eval.n_envs=2"]


TINY = {
    "dt": ["agent.kind=dt", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=3", "agent.max_ep_len=20"],
    "bc": ["agent.kind=bc", "agent.hidden=[8]"],
    "gtrxl": ["agent.kind=gtrxl", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1",
              "agent.seq_len=3", "agent.burn_in=1"],
}


# ------------------------------------------------- Dict observations flattened at load time
class DictObsEnv(gym.Env):
    """Dict observation {"flag": Discrete(3), "pos": Box(2)}; Discrete(2) actions; 6 steps."""

    def __init__(self):
        self.observation_space = gym.spaces.Dict({"pos": gym.spaces.Box(-10, 10, (2,), np.float32),
                                                  "flag": gym.spaces.Discrete(3)})
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def _obs(self):
        return {"pos": np.array([self.t, -self.t], np.float32), "flag": self.t % 3}

    def step(self, action):
        r = float(int(action) == self.t % 2)
        self.t += 1
        return self._obs(), r, False, self.t >= 6, {}


DICT_ENV = "B5AgentsDictObs-v0"


if DICT_ENV not in gym.registry:
    gym.register(DICT_ENV, entry_point=f"{__name__}:DictObsEnv")


@pytest.fixture(scope="module")
def dict_dataset(tmp_path_factory):
    """A Minari dataset folder of 5 random episodes of :class:`DictObsEnv` (Dict observations)."""
    import minari

    root = tmp_path_factory.mktemp("minari")
    mp = pytest.MonkeyPatch()
    mp.setenv("MINARI_DATASETS_PATH", str(root))
    try:
        env = EpisodeRecorder(gym.make(DICT_ENV))
        for e in range(5):
            env.reset(seed=e)
            env.action_space.seed(e)
            done = False
            while not done:
                *_, term, trunc, _ = env.step(env.action_space.sample())
                done = term or trunc
        env.create_dataset(dataset_id="b5agents/dict-v0", algorithm_name="random", eval_env=DICT_ENV,
                           author="rl-tformers tests", author_email="tests@example.org", description="Dict observations")
        path = root / "b5agents" / "dict-v0"
        assert minari.MinariDataset(path / "data") is not None
    finally:
        mp.undo()
    return path


@pytest.mark.parametrize("kind", ["dt", "bc", "gtrxl"])
def test_flattened_dict_observations_train_and_evaluate_in_a_flattened_env(dict_dataset, tmp_path, kind) -> None:
    """dataset.flatten_observations=true flattened the data, but the evaluation environment kept
    its Dict observations: every agent refused to train ("... not a Box; set agent.env_id")."""
    from rl_tformers.envs.loaders import load_dataset

    from rl_tformers.runtime.evaluation import evaluate
    from rl_tformers.runtime.loading import load_run

    cfg = compose(None, [*TINY[kind], f"dataset.path={dict_dataset}", "dataset.flatten_observations=true", *FAST_AGENTS])
    train(cfg, tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert run.agent.info.flatten_observations
    env = run.agent.make_env()()
    try:
        assert isinstance(env.observation_space, gym.spaces.Box) and env.observation_space.shape == (5,)
        first, _ = env.reset(seed=0)
    finally:
        env.close()
    ds = load_dataset(str(dict_dataset), flatten_observations=True)
    np.testing.assert_array_equal(first, ds.observations[0])  # the loader's layout: flag one-hot, then pos
    report = evaluate(run.agent.policy(), run.agent.make_env(), run.agent.default_targets(), episodes=2, n_envs=2)
    assert report.results[0].lengths == [6, 6]


# ------------------------------------------------- agent.targets: one number, bad forms
def _counter_h5(path, lengths=(3, 4, 5), env_id="B5AgentsBounds-v0", low=(-1.0,), high=(1.0,)):
    """A D4RL-layout file of episodes with rewards 1, 2, ... (returns 6, 10, 15), obs = step,
    actions drawn uniformly from the Box ``[low, high]`` (a fixed dimension where low == high)."""
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    space = gym.spaces.Box(np.array(low, np.float32), np.array(high, np.float32))
    rng = np.random.default_rng(0)
    eps = []
    for n in lengths:
        eps.append({"observations": np.arange(n + 1, dtype=np.float32)[:, None],
                    "actions": rng.uniform(space.low, space.high, (n, space.shape[0])).astype(np.float32),
                    "rewards": np.arange(1.0, n + 1), "terminations": np.zeros(n, bool),
                    "truncations": np.r_[np.zeros(n - 1, bool), True]})
    ds = EpisodeDataset.from_episodes(eps, action_space=space, metadata=DatasetMetadata(env_id=env_id))
    return save_d4rl_hdf5(ds, path)


class BoundsEnv(gym.Env):
    """obs = step (Box(1)); Box actions within ``[low, high]`` (asserted); reward 1; 5 steps."""

    def __init__(self, low=(-1.0,), high=(1.0,)):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
        self.action_space = gym.spaces.Box(np.array(low, np.float32), np.array(high, np.float32))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        assert self.action_space.contains(np.asarray(action, np.float32)), action
        self.t += 1
        return np.array([self.t], np.float32), 1.0, False, self.t >= 5, {}


BOUNDS = {"B5AgentsBounds-v0": ((-1.0,), (1.0,)),
          "B5AgentsFixedDim-v0": ((-1.0, 2.0), (1.0, 2.0)),  # second dimension fixed at 2
          "B5AgentsHugeBox-v0": ((-3e38,), (3e38,))}  # high - low overflows float32


for _id, (_lo, _hi) in BOUNDS.items():
    if _id not in gym.registry:
        gym.register(_id, entry_point=f"{__name__}:BoundsEnv", kwargs={"low": _lo, "high": _hi})


def _cli_train(*args: str):
    return runner.invoke(app, ["train", *TINY["dt"], *FAST_AGENTS, *args])


def test_dt_takes_a_single_number_as_agent_targets(tmp_path) -> None:
    """agent.targets=7 (documented as "target returns"; default_targets accepts a scalar) trains,
    as the list [7] does."""
    from rl_tformers.runtime.loading import load_run

    h5 = _counter_h5(tmp_path / "c.hdf5")
    r = _cli_train(f"dataset.path={h5}", "agent.targets=7", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 0, r.output
    assert load_run(tmp_path / "run").agent.default_targets() == [7.0]


@pytest.mark.parametrize("value, message", [
    ("[]", "agent.targets must be a target return or a non-empty list of them"),
    ("abc", "agent.targets must be a list of finite numbers or a finite number or null, got 'abc' (str)"),
    ("[[1,2]]", "agent.targets must be a list of finite numbers or a finite number or null, got [[1, 2]] (list)"),
    ("true", "agent.targets must be a list of finite numbers or a finite number or null, got True (bool)"),
])
def test_dt_bad_agent_targets_is_one_error_line_naming_the_option(tmp_path, value, message) -> None:
    """An empty list, a nested list, a boolean or a string is one error line naming the option
    (not an IndexError / TypeError traceback or "could not convert string to float")."""
    h5 = _counter_h5(tmp_path / "c.hdf5")
    r = _cli_train(f"dataset.path={h5}", f"agent.targets={value}", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2, r.output
    assert f"error: {message}" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------- Box actions: a fixed dimension, huge bounds
def test_action_maps_handle_fixed_dimensions_and_overflowing_widths() -> None:
    from rl_tformers.agents.decision_transformer.model import from_env_action, to_env_action

    low = torch.tensor([-1.0, 2.0, -3e38, 0.1])
    high = torch.tensor([1.0, 2.0, 3e38, 0.7])
    for a in (-1.0, -0.3, 0.0, 1.0):
        env = to_env_action(torch.full((4,), a), low, high)
        assert torch.isfinite(env).all() and (env >= low).all() and (env <= high).all(), env
        back = from_env_action(env, low, high)
        assert torch.isfinite(back).all(), back
        assert back[1] == 0.0  # the fixed dimension
        torch.testing.assert_close(back[[0, 2, 3]], torch.full((3,), a), atol=1e-6, rtol=0)
    assert to_env_action(torch.ones(4), low, high).tolist() == high.tolist()
    assert to_env_action(-torch.ones(4), low, high).tolist() == low.tolist()


@pytest.mark.parametrize("env_id", ["B5AgentsFixedDim-v0", "B5AgentsHugeBox-v0"])
@pytest.mark.parametrize("kind", ["dt", "bc", "gtrxl"])
def test_box_with_a_fixed_dimension_or_huge_bounds_trains_and_acts_in_the_box(tmp_path, kind, env_id) -> None:
    """A Box whose low == high in one dimension (gymnasium allows it), or bounds of +-3e38 (an
    infinite width), trains and acts inside the box (a plain scaling would give 0 / 0 = NaN
    targets or an infinite width: NonFiniteLossError, "try a lower train.lr")."""
    from rl_tformers.runtime.evaluation import evaluate
    from rl_tformers.runtime.loading import load_run

    lo, hi = BOUNDS[env_id]
    h5 = _counter_h5(tmp_path / "b.hdf5", env_id=env_id, low=lo, high=hi)
    cfg = compose(None, [*TINY[kind], f"dataset.path={h5}", *FAST_AGENTS])
    train(cfg, tmp_path / "run")  # trains: no NonFiniteLossError
    run = load_run(tmp_path / "run")
    report = evaluate(run.agent.policy(), run.agent.make_env(), run.agent.default_targets(), episodes=2, n_envs=2)
    assert report.results[0].lengths == [5, 5]  # BoundsEnv asserts every action is inside its Box


# ------------------------------------------------- IQL and PPO options that trained nothing or crashed
@pytest.mark.parametrize("option, message", [
    ("agent.seq_len=1", "agent.seq_len=1: IQL learns Q from (t, t+1) pairs inside the gradient window, and a window "
                        "of one step has none (the Q loss would stay 0); use agent.seq_len >= 2"),
    ("agent.gamma=2", "agent.gamma must be a number in [0, 1], got 2"),
    ("agent.expectile=1.5", "agent.expectile must be a number in (0, 1), got 1.5"),
    ("agent.tau=0", "agent.tau must be a number in (0, 1], got 0"),
    ("agent.beta=-1", "agent.beta must be a number >= 0, got -1"),
    ("agent.max_weight=0", "agent.max_weight must be a number > 0, got 0"),
])
def test_iql_refuses_options_that_train_nothing_before_reading_the_data(tmp_path, option, message) -> None:
    """Refused before the data is read: agent.seq_len=1 would leave IQL's Q loss at exactly 0 for
    the whole run (no (t, t+1) pair in a one-step window: the advantages would be noise from
    untrained Q heads); the other values would train silently into nonsense (negative expectile
    weights, a frozen target, a zero actor loss)."""
    with pytest.raises(ConfigError) as info:
        compose(None, [*TINY["gtrxl"], "agent.objective=iql", f"dataset.path={tmp_path / 'never-read.hdf5'}",
                       option, *FAST_AGENTS])
    assert str(info.value) == message


# ------------------------------------------------- learned positions shorter than an episode
def test_gtrxl_refuses_a_learned_position_table_shorter_than_an_episode(tmp_path) -> None:
    """GTrXL's positions are episode steps: with backbone.position.kind=learned and
    backbone.max_position below the longest episode, training died mid-run with a traceback
    ("position.learned: positions must lie in [0, 4)") when a batch reached a late step."""
    h5 = _counter_h5(tmp_path / "c.hdf5")  # longest episode: 5 steps
    r = runner.invoke(app, ["train", *TINY["gtrxl"], *FAST_AGENTS, f"dataset.path={h5}", "backbone.position.kind=learned",
                            "backbone.max_position=4", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "error: backbone.max_position=4 but the dataset has an episode of 5 steps" in r.output
    r = runner.invoke(app, ["train", *TINY["gtrxl"], *FAST_AGENTS, f"dataset.path={h5}", "backbone.position.kind=learned",
                            "backbone.max_position=5", "--run-dir", str(tmp_path / "run5")])
    assert r.exit_code == 0, r.output


# ------------------------------------------------- plot sweep of a dataset whose returns are all equal
def test_default_sweep_of_equal_returns_spreads_its_targets() -> None:
    """Every episode with return 5: the default targets are spread, not six targets 5, 5.0000002,
    ... (printed as six "5", six evaluations of the same target and a one-point plot)."""
    from rl_tformers.runtime.plots import default_sweep

    assert default_sweep(5.0, 5.0, 6) == pytest.approx([0.0, 1.2, 2.4, 3.6, 4.8, 6.0])
    assert default_sweep(0.0, 0.0, 3) == pytest.approx([-1.0, -0.4, 0.2])
    assert default_sweep(-1500.0, -1500.0, 2) == [-3000.0, -1200.0]
    assert default_sweep(3559.0, 1000.0, 6) == [1000.0, 1614.0, 2228.0, 2842.0, 3457.0, 4071.0]  # unchanged


# ------------------------------------------------- GTrXL rcbc: the training's evaluation line names its target
def test_gtrxl_rcbc_evaluation_reports_its_target(tmp_path) -> None:
    h5 = _counter_h5(tmp_path / "c.hdf5")
    r = runner.invoke(app, ["train", *TINY["gtrxl"], *[o for o in FAST_AGENTS if not o.startswith("eval.at_end")],
                            "eval.at_end=true", "agent.objective=rcbc", "agent.target_return=12",
                            f"dataset.path={h5}", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    assert "final evaluation at step 2: target 12: return 5.0" in r.output, r.output


# ------------------------------------------------- DT: time limit beyond agent.max_ep_len, said before training
def test_dt_warns_before_training_when_the_eval_env_outlasts_max_ep_len(tmp_path, caplog) -> None:
    """A CartPole dataset of short episodes trained with agent.max_ep_len=100 warns before
    training that its evaluation environment runs 500 steps (the first evaluation would stop, after
    all the training, as soon as an episode reaches step 100)."""
    import logging

    from rl_tformers.agents.decision_transformer.agent import DTAgent
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset

    eps = [{"observations": np.zeros((n + 1, 4), np.float32), "actions": np.zeros(n, np.int64),
            "rewards": np.ones(n), "terminations": np.r_[np.zeros(n - 1, bool), True],
            "truncations": np.zeros(n, bool)} for n in (5, 8)]
    ds = EpisodeDataset.from_episodes(eps, action_space=gym.spaces.Discrete(2),
                                      metadata=DatasetMetadata(env_id="CartPole-v1"))
    for max_ep_len, overflow, warned in ((100, "error", True), (500, "error", False), (100, "clamp", False)):
        cfg = compose(None, [*TINY["dt"], "dataset.path=unused", f"agent.max_ep_len={max_ep_len}",
                             f"agent.timestep_overflow={overflow}", *FAST_AGENTS])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rl_tformers"):
            DTAgent(cfg, None, "cpu", dataset=ds)
        text = caplog.text
        assert ("runs episodes of up to 500 steps but agent.max_ep_len=100" in text) == warned, text


# ------------------------------------------------- rtg_probe of a last_action DT
def test_rtg_probe_fit_of_a_last_action_dt_compares_the_last_action_only(tmp_path) -> None:
    """In agent.mode=last_action the model predicts one action per window (the last), and the
    probe's fit compares it with the last data action only (broadcast against all K it would
    print a wrong number, 0.40 instead of 0.49 on a Pendulum run)."""
    from rl_tformers.agents.decision_transformer.model import from_env_action
    from rl_tformers.agents.decision_transformer.rtg_probe import rtg_probe
    from rl_tformers.envs.loaders import load_dataset
    from rl_tformers.envs.trajectory import returns_to_go

    from rl_tformers.runtime.loading import load_run

    h5 = _counter_h5(tmp_path / "c.hdf5", lengths=(5, 5, 4))
    cfg = compose(None, [*TINY["dt"], f"dataset.path={h5}", "agent.mode=last_action", "backbone.causal=false",
                         "backbone.attention.kind=linformer", *FAST_AGENTS])
    train(cfg, tmp_path / "run")
    agent = load_run(tmp_path / "run").agent
    info, k = agent.info, agent.model_cfg.context_len
    ds = load_dataset(str(h5))
    rows = rtg_probe(agent, ds, {"a": [0, 1, 2]}, t0s=(1,), rtgs=(0.5,))
    obs, act, rtg = [], [], []
    for i in (0, 1, 2):
        ep = ds.episode(i)
        obs.append((np.asarray(ep.observations[1:1 + k]) - info.obs_mean) / info.obs_std)
        act.append(np.asarray(ep.actions[1:1 + k]))
        rtg.append(returns_to_go(np.asarray(ep.rewards, np.float64))[1:1 + k] / info.reward_scale)
    obs, act, rtg = (torch.tensor(np.stack(x), dtype=torch.float32) for x in (obs, act, rtg))
    act = from_env_action(act, torch.tensor(info.action_low), torch.tensor(info.action_high))
    with torch.no_grad():
        last = agent.model(obs, act, rtg, (1 + torch.arange(k)).expand(3, k), torch.ones(3, k, dtype=torch.bool)).action
    assert last.shape == (3, 1, 1)
    assert rows[0]["fit"] == pytest.approx(float(((last[:, 0] - act[:, -1]) ** 2).sum(-1).mean()), rel=1e-6)


# ------------------------------------------------- GTrXL on observations of more than one axis
class MatObsEnv(gym.Env):
    """Box(2, 3) observations, Discrete(2, start=-1) actions (asserted), reward 1 for -1; 5 steps."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2, 3), np.float32)
        self.action_space = gym.spaces.Discrete(2, start=-1)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.full((2, 3), 0.0, np.float32), {}

    def step(self, action):
        assert self.action_space.contains(action), action
        self.t += 1
        return np.full((2, 3), float(self.t), np.float32), float(int(action) == -1), False, self.t >= 5, {}


MAT_ENV = "B5AgentsMatObs-v0"


if MAT_ENV not in gym.registry:
    gym.register(MAT_ENV, entry_point=f"{__name__}:MatObsEnv")


@pytest.mark.parametrize("options", [["agent.objective=bc", "agent.prev_action=true"], ["agent.objective=iql"],
                                     ["agent.objective=rcbc", "agent.window=3", "agent.burn_in=0",
                                      "backbone.memory.kind=none"]])
def test_gtrxl_trains_on_observations_of_more_than_one_axis(tmp_path, options) -> None:
    """A Box(2, 3) observation reached GTrXL's token embedding unflattened: the first update died
    with "mat1 and mat2 shapes cannot be multiplied (8x3 and 6x16)" (or, with
    agent.prev_action, "Tensors must have same number of dimensions"). DT and BC flattened."""
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    from rl_tformers.runtime.evaluation import evaluate
    from rl_tformers.runtime.loading import load_run

    rng = np.random.default_rng(0)
    eps = [{"observations": np.repeat(np.arange(6, dtype=np.float32), 6).reshape(6, 2, 3),
            "actions": rng.integers(-1, 1, 5), "rewards": rng.integers(0, 2, 5).astype(float),
            "terminations": np.zeros(5, bool), "truncations": np.r_[np.zeros(4, bool), True]} for _ in range(3)]
    ds = EpisodeDataset.from_episodes(eps, observation_space=gym.spaces.Box(-np.inf, np.inf, (2, 3), np.float32),
                                      action_space=gym.spaces.Discrete(2, start=-1),
                                      metadata=DatasetMetadata(env_id=MAT_ENV))
    h5 = save_d4rl_hdf5(ds, tmp_path / "mat.hdf5")
    cfg = compose(None, [*TINY["gtrxl"], f"dataset.path={h5}", *options, *FAST_AGENTS])
    train(cfg, tmp_path / "run")
    run = load_run(tmp_path / "run")
    report = evaluate(run.agent.policy(), run.agent.make_env(), run.agent.default_targets(), episodes=2, n_envs=2)
    assert report.results[0].lengths == [5, 5]


STEPS = 4  # episode length of ShapedActionEnv


class ShapedActionEnv(gym.Env):
    """Box(3) observations; a Box action of ``shape`` whose components all have other bounds
    (component j of the C-order flattening: ``[-2 + j / 4, -2 + j / 4 + j + 1]``); 4 steps.

    Every action received is checked (shape and bounds) and its shape recorded in
    :attr:`received` (class level: the evaluation's vector envs are synchronous)."""

    received: list[tuple[int, ...]] = []

    def __init__(self, shape: tuple[int, ...] = (2, 2)) -> None:
        n = math.prod(shape)
        low = (-2.0 + np.arange(n) / 4).reshape(shape).astype(np.float32)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = gym.spaces.Box(low, low + np.arange(1, n + 1, dtype=np.float32).reshape(shape))
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        a = np.asarray(action)
        ShapedActionEnv.received.append(tuple(a.shape))
        if a.shape != self.action_space.shape or not self.action_space.contains(a.astype(np.float32)):
            raise AssertionError(f"ShapedActionEnv{self.action_space.shape} got the action {a!r}")
        self.t += 1
        flat = a.reshape(-1)
        return np.array([self.t, flat[0], flat[-1]], np.float32), float(flat[0]), False, self.t >= STEPS, {}


MATRIX_ENV, VECTOR_ENV = "rl_tformers_test/MatrixActions-v0", "rl_tformers_test/VectorActions-v0"


for _id_box_actions, _shape in ((MATRIX_ENV, (2, 2)), (VECTOR_ENV, (3,))):
    if _id_box_actions not in gym.registry:
        gym.register(_id_box_actions, entry_point=ShapedActionEnv, kwargs={"shape": _shape})


FAST_BOX_ACTIONS = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.progress=false", "device=cpu",
        "eval.every=0", "eval.episodes=2", "eval.n_envs=2"]


TINY_BOX_ACTIONS = {
    "dt": ["agent.kind=dt", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=3",
           "agent.max_ep_len=20", "agent.eval_figure=false"],
    "bc": ["agent.kind=bc", "agent.hidden=[8]"],
    "gtrxl": ["agent.kind=gtrxl", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1",
              "agent.seq_len=3", "agent.burn_in=1", "agent.prev_action=true"],
}


def _dataset(env_id: str, episodes: int = 4):
    """Episodes of ShapedActionEnv with actions drawn uniformly in its box, in the box's shape."""
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset

    space = gym.make(env_id).action_space
    rng = np.random.default_rng(0)
    eps = [{"observations": rng.normal(size=(STEPS + 1, 3)).astype(np.float32),
            "actions": rng.uniform(space.low, space.high, (STEPS, *space.shape)).astype(np.float32),
            "rewards": rng.normal(size=STEPS), "terminations": np.zeros(STEPS, bool),
            "truncations": np.r_[np.zeros(STEPS - 1, bool), True]} for _ in range(episodes)]
    return EpisodeDataset.from_episodes(eps, observation_space=gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                                        action_space=space, metadata=DatasetMetadata(env_id=env_id))


@pytest.fixture(scope="module")
def matrix_h5(tmp_path_factory):
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    return save_d4rl_hdf5(_dataset(MATRIX_ENV), tmp_path_factory.mktemp("data") / "matrix.hdf5")


# ------------------------------------------------- the data layer and DatasetInfo
def test_loaded_actions_keep_the_box_shape_and_dataset_info_records_it(matrix_h5) -> None:
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset

    for lazy in (False, True):
        ds = load_dataset(str(matrix_h5), lazy=lazy)
        assert ds.actions.shape == (4 * STEPS, 2, 2) and ds.action_space.shape == (2, 2)
    info = DatasetInfo.from_dataset(ds)
    assert (info.act_dim, info.action_shape, info.discrete) == (4, (2, 2), False)
    space = gym.make(MATRIX_ENV).action_space
    np.testing.assert_array_equal(info.action_low, space.low.reshape(-1))
    np.testing.assert_array_equal(info.action_high, space.high.reshape(-1))
    extra = info.to_extra()
    assert extra["action_shape"] == [2, 2]
    assert DatasetInfo.from_extra(extra).action_shape == (2, 2)


def test_extra_state_keeps_flat_box_and_scalar_discrete_shapes_and_refuses_mismatches(matrix_h5) -> None:
    """``action_shape`` in the extra state: (3,) for a 1-D Box, () for discrete actions."""
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset

    box = DatasetInfo.from_dataset(_dataset(VECTOR_ENV)).to_extra()
    assert box["action_shape"] == [3]
    assert DatasetInfo.from_extra(box).action_shape == (3,)
    from rl_tformers.envs.memory_tasks import scripted_dataset

    disc = DatasetInfo.from_dataset(scripted_dataset("recall", 4, delay=2, seed=0)).to_extra()
    assert disc["action_shape"] == []
    assert DatasetInfo.from_extra(disc).action_shape == ()
    good = DatasetInfo.from_dataset(load_dataset(str(matrix_h5))).to_extra()
    with pytest.raises(ValueError, match=r"action_shape=\(3, 2\) does not hold act_dim=4"):
        DatasetInfo.from_extra({**good, "action_shape": [3, 2]})
    with pytest.raises(ValueError, match=r"action_shape=\(2,\) for discrete actions"):
        DatasetInfo.from_extra({**disc, "action_shape": [2]})


def test_a_file_of_flat_actions_for_a_matrix_box_is_refused_naming_both_shapes(tmp_path) -> None:
    """(N, 4) actions for an environment whose actions are Box(2, 2): refused naming both shapes
    (not dropping the environment's space, which would ask to "set dataset.env_id" though it is
    set), and never reshaped silently."""
    import h5py
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_d4rl_hdf5

    ds = _dataset(MATRIX_ENV, episodes=2)
    path = tmp_path / "flat.hdf5"
    with h5py.File(path, "w") as f:
        f["observations"] = ds.observations
        f["actions"] = ds.actions.reshape(len(ds.actions), 4)
        f["rewards"] = ds.rewards
        f["terminals"] = ds.terminations
        f["timeouts"] = ds.truncations
        f.attrs["env_id"] = MATRIX_ENV
    with pytest.raises(DatasetError, match=r"stores actions of shape \(4,\) per step.*\(N, 2, 2\)") as err:
        load_d4rl_hdf5(path)
    assert err.value.field == "actions"


def test_training_batches_flatten_the_box_in_c_order_like_the_bounds(matrix_h5) -> None:
    """The models see (.., A=4) in [-1, 1]: component (i, j) goes to 2 i + j, normalised with its own bounds."""
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.agents.decision_transformer.agent import to_model_batch
    from rl_tformers.agents.gtrxl.agent import segment_batch
    from rl_tformers.envs.loaders import load_dataset

    info = DatasetInfo.from_dataset(load_dataset(str(matrix_h5)))
    low, high = gym.make(MATRIX_ENV).action_space.low, gym.make(MATRIX_ENV).action_space.high
    act = torch.as_tensor(np.stack([low, high, (low + high) / 2]))  # (3, 2, 2): -1, 1, 0 in model units
    want = torch.tensor([-1.0, 1.0, 0.0])[:, None].expand(3, 4)
    b = to_model_batch({"actions": act[None], "observations": torch.zeros(1, 3, 3),
                        "returns_to_go": torch.zeros(1, 3), "timesteps": torch.zeros(1, 3, dtype=torch.long),
                        "mask": torch.ones(1, 3, dtype=torch.bool)}, info)
    assert torch.equal(b["actions"][0], want)
    seg = segment_batch({"actions": act[None], "observations": torch.zeros(1, 3, 3), "rewards": torch.zeros(1, 3),
                         "returns_to_go": torch.zeros(1, 3), "timesteps": torch.zeros(1, 3, dtype=torch.long),
                         "mask": torch.ones(1, 3, dtype=torch.bool), "episode_start": torch.zeros(1, 3, dtype=torch.bool),
                         "terminations": torch.zeros(1, 3, dtype=torch.bool)},
                        burn_in=0, discrete=False, action_low=torch.as_tensor(info.action_low),
                        action_high=torch.as_tensor(info.action_high))
    assert torch.equal(seg.actions[0], want[1:]) and torch.equal(seg.prev_action[0], want[:2])


# ------------------------------------------------- train, resume, evaluate: the env gets (2, 2) actions
@pytest.mark.parametrize("kind", ["dt", "bc", "gtrxl"])
def test_offline_agents_train_resume_and_evaluate_with_box_actions_in_the_envs_shape(matrix_h5, tmp_path,
                                                                                     kind) -> None:
    from rl_tformers.runtime.loading import load_run

    run_dir = tmp_path / "run"
    cfg = compose(None, [*TINY_BOX_ACTIONS[kind], f"dataset.path={matrix_h5}", *FAST_BOX_ACTIONS, "eval.at_end=true"])
    train(cfg, run_dir, stop_at=1)  # checkpoint at step 1, no evaluation yet
    ShapedActionEnv.received.clear()
    resume(run_dir)  # the extra state comes back from the checkpoint; evaluates at the end (2 episodes)
    assert len(ShapedActionEnv.received) >= 2 * STEPS and set(ShapedActionEnv.received) == {(2, 2)}
    run = load_run(run_dir)
    assert run.extra["action_shape"] == [2, 2] and run.agent.info.action_shape == (2, 2)
    policy = run.agent.policy()
    actions, _ = policy.act(np.zeros((3, 3), np.float32), policy.initial_state(3), np.ones(3, bool))
    assert actions.shape == (3, 2, 2) and actions.dtype == np.float32
    ShapedActionEnv.received.clear()
    r = runner.invoke(app, ["eval", str(run_dir), "--episodes", "2", "--envs", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["results"][0]["lengths"] == [STEPS, STEPS]
    assert len(ShapedActionEnv.received) >= 2 * STEPS and set(ShapedActionEnv.received) == {(2, 2)}


def test_policies_return_the_flat_actions_in_the_envs_shape(matrix_h5) -> None:
    """Each policy's (N, 2, 2) action is its flat (N, 4) action (the policy without the shape),
    reshaped in C order; a shape that does not hold A values is refused."""
    from rl_tformers.agents.decision_transformer.policy import DTPolicy
    from rl_tformers.agents.gtrxl.agent import GTrXLPolicy

    cfgs = {k: compose(None, [*TINY_BOX_ACTIONS[k], f"dataset.path={matrix_h5}", *FAST_BOX_ACTIONS]) for k in ("dt", "gtrxl")}
    from rl_tformers.agents.decision_transformer.agent import DTAgent
    from rl_tformers.agents.gtrxl.agent import GTrXLAgent

    torch.manual_seed(0)
    obs = np.random.default_rng(1).normal(size=(3, 3)).astype(np.float32)
    start = np.ones(3, bool)
    dt = DTAgent(cfgs["dt"], None, "cpu")
    shaped = dt.policy()
    flat = DTPolicy(dt.model, dt.info.obs_mean, dt.info.obs_std, dt.info.reward_scale, dt.info.action_low,
                    dt.info.action_high, default_target=shaped.default_target)
    a, _ = shaped.act(obs, shaped.initial_state(3), start)
    b, _ = flat.act(obs, flat.initial_state(3), start)
    assert a.shape == (3, 2, 2) and b.shape == (3, 4) and np.array_equal(a.reshape(3, 4), b)
    with pytest.raises(ValueError, match=r"DTPolicy: action_shape=\(3,\) does not hold the model's 4"):
        DTPolicy(dt.model, dt.info.obs_mean, dt.info.obs_std, 1.0, dt.info.action_low, dt.info.action_high,
                 action_shape=(3,))
    g = GTrXLAgent(cfgs["gtrxl"], None, "cpu")
    shaped_g = g.policy()
    flat_g = GTrXLPolicy(g.model, obs_mean=g.info.obs_mean, obs_std=g.info.obs_std, action_low=g.info.action_low,
                         action_high=g.info.action_high, rtg_scale=g.info.reward_scale)
    a, _ = shaped_g.act(obs, shaped_g.initial_state(3), start)
    b, _ = flat_g.act(obs, flat_g.initial_state(3), start)
    assert a.shape == (3, 2, 2) and b.shape == (3, 4) and np.array_equal(a.reshape(3, 4), b)


def test_agent_targets_given_twice_are_refused() -> None:
    """``agent.targets=[100, 100.0]`` evaluated, logged and plotted one target twice."""
    def targets(value):
        return DTAgentConfig.from_dict({"targets": value}, where="agent").targets

    assert targets([100, 50]) == (100.0, 50.0) and targets(3600) == (3600.0,)
    with pytest.raises(ValueError, match=r"^agent.targets: the target 100 is given twice \(items 1 and 3\); give each "
                                         r"target once"):
        targets([100, 50, 1e2])
    with pytest.raises(ValueError, match=r"the target 0 is given twice \(items 1 and 2"):
        targets([0.0, -0.0])


TINY_DT_DATA = ["train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4",
        "eval.every=0", "eval.at_end=false", "train.progress=false", "train.warmup_steps=1", "--device", "cpu"]


# ------------------------------------------------- short episodes: training layout = acting layout
K, L = 6, 3  # an episode shorter than the window


def _short_episode():
    from rl_tformers.envs.dataset import EpisodeDataset

    rng = np.random.default_rng(0)
    obs = rng.normal(size=(L + 1, 2)).astype(np.float32)
    act = rng.uniform(-1, 1, (L, 1)).astype(np.float32)
    ds = EpisodeDataset.from_episodes([{
        "observations": obs, "actions": act, "rewards": np.array([1.0, 2.0, 3.0]),
        "terminations": np.array([False, False, True]), "truncations": np.zeros(L, bool),
    }], action_space=gym.spaces.Box(-1.0, 1.0, (1,), np.float32))
    return ds, obs, act


def test_start_aligned_window_of_a_short_episode_starts_at_slot_0() -> None:
    """The sampler put an episode shorter than K in the *last* slots (left padding), while the
    policy acting with ``align="start"`` writes step t at slot t: a model trained on such windows
    never saw, at training time, the slots it acts with."""
    from rl_tformers.envs.samplers import WindowSampler

    ds, obs, _ = _short_episode()
    b = WindowSampler(ds, K).sample(2, np.random.default_rng(0))
    assert b["mask"].tolist() == [[True] * 3 + [False] * 3] * 2
    assert b["timesteps"].tolist() == [[0, 1, 2, 0, 0, 0]] * 2
    assert b["returns_to_go"].tolist() == [[6.0, 5.0, 3.0, 0.0, 0.0, 0.0]] * 2
    np.testing.assert_array_equal(b["observations"][0, :3], obs[:3])
    assert (b["observations"][:, 3:] == 0).all()
    # end-aligned windows keep their layout: the window ends at slot K - 1, padding on the left
    e = WindowSampler(ds, K, align="end").sample(64, np.random.default_rng(1))
    assert e["mask"][:, -1].all() and not e["mask"][:, 0].any()


@pytest.mark.parametrize("backbone", [
    {"position": {"kind": "learned"}},
    {"position": {"kind": "sinusoidal"}},
    {"attention": {"kind": "fixed", "stride": 4, "summary": 1}},
], ids=["learned-positions", "sinusoidal-positions", "fixed-attention"])
def test_policy_actions_equal_the_model_on_training_windows_of_a_short_episode(backbone) -> None:
    """With absolute positions or a pattern laid over token indices, the action the policy takes at
    step t of a short episode equals the model's prediction at step t of the training window of
    that episode (a different layout would give e.g. 0.0254 vs 0.02364 with learned positions,
    0.0351 vs 0.06656 with fixed attention): the docs' "same context layout as training" holds
    below K steps."""
    from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
    from rl_tformers.agents.decision_transformer.policy import DTPolicy
    from rl_tformers.envs.samplers import WindowSampler

    torch.manual_seed(0)
    bb = {"d_model": 16, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": True,
          **backbone}
    cfg = DTConfig(obs_dim=2, act_dim=1, context_len=K, max_ep_len=50, embed_dropout=0.0, backbone=bb)
    model = DecisionTransformer(cfg).eval()
    ds, obs, act = _short_episode()
    b = {k: torch.as_tensor(v) for k, v in WindowSampler(ds, K).sample(1, np.random.default_rng(0)).items()}
    with torch.no_grad():
        train = model(b["observations"], b["actions"], b["returns_to_go"], b["timesteps"], b["mask"]).action
    train = train[0, b["mask"][0], 0].numpy()  # (L,) prediction at each real step, training layout

    pol = DTPolicy(model, np.zeros(2), np.ones(2), 1.0, np.array([-1.0]), np.array([1.0]))
    state = pol.initial_state(1, 6.0)  # the episode's return: the training window's RTG at step 0
    acted = []
    for t in range(L):
        a, state = pol.act(obs[t:t + 1], state, np.array([t == 0]), None if t == 0 else np.array([float(t)]))
        state.actions[0, t] = torch.as_tensor(act[t])  # the dataset's action, as in the training window
        acted.append(float(a[0, 0]))
    np.testing.assert_allclose(acted, train, rtol=0, atol=1e-6)


# ------------------------------------------------- resume on changed data
TINY_BC = ["train.batch_size=4", "agent.hidden=[16]", "eval.every=0", "eval.at_end=false", "train.progress=false",
           "train.warmup_steps=1", "--device", "cpu"]


@pytest.mark.parametrize(("config", "tiny"), [("dt/cartpole_demo", TINY_DT_DATA), ("bc/hopper_medium", TINY_BC)], ids=["dt", "bc"])
def test_resume_refuses_a_dataset_that_changed_since_the_checkpoint(tmp_path: Path, cartpole_h5, config, tiny) -> None:
    """The data behind dataset.path is rewritten between two parts of a run (rewards x 100, other
    observations): ``--resume`` of a DT or a BC run refuses it, instead of training on it with the
    checkpoint's reward scale, observation statistics and default target (10, the old best return)."""
    h5 = cartpole_h5(tmp_path / "d.hdf5")
    keep = tmp_path / "original.hdf5"
    shutil.copy(h5, keep)
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", config, f"dataset.path={h5}", "train.steps=2",
                            "train.checkpoint_every=2", *tiny, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3"])  # the same data: resumes
    assert r.exit_code == 0, r.output

    cartpole_h5(h5, n=50, seed=1, reward=100.0)
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the dataset {h5} is not the data this run was trained on: its statistics differ "
                           f"from the checkpoint's (obs_mean: ["), line
    assert ("reward_scale: 10 -> 1000; dataset_return_max: 10 -> 1000; dataset_return_mean: 10 -> 1000; "
            "dataset_return_min: 10 -> 1000; num_steps: 30 -> 50; action_mean: [") in line
    assert line.endswith("checkpoint -> now); resume with the original data, or start a new run on this dataset")
    assert "Traceback" not in r.output

    shutil.copy(keep, h5)  # the original data back: the run continues
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 0, r.output


def test_data_differences_of_equal_statistics_is_empty(tmp_path: Path, cartpole_h5) -> None:
    from rl_tformers.agents.common.offline import DatasetInfo, data_differences, load_offline_dataset

    spec = {"path": str(cartpole_h5(tmp_path / "d.hdf5"))}
    a = DatasetInfo.from_dataset(load_offline_dataset(spec))
    b = DatasetInfo.from_dataset(load_offline_dataset({**spec, "lazy": True}))
    assert data_differences(a, DatasetInfo.from_extra(a.to_extra())) == []
    assert data_differences(a, b) == []  # the lazy reading of the same file: equal up to rounding


# ------------------------------------------------- dataset.env_id and the file's action_space attribute
def _unbounded_file(tmp_path: Path, env_id: str | None, act_dim: int = 1) -> Path:
    """A file written by save_d4rl_hdf5 from data without bounds: its action_space attribute is
    Box(-inf, inf)."""
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    n = 12
    rng = np.random.default_rng(0)
    ds = EpisodeDataset.from_flags(
        rng.normal(size=(n, 3)).astype(np.float32), rng.uniform(-1, 1, (n, act_dim)).astype(np.float32),
        np.ones(n), np.eye(1, n, n - 1)[0], metadata=DatasetMetadata(env_id=env_id))
    assert not np.isfinite(ds.action_space.high).any()
    return save_d4rl_hdf5(ds, tmp_path / "unbounded.hdf5")


def test_dataset_env_id_bounds_the_actions_of_a_file_with_an_unbounded_action_space_attribute(tmp_path) -> None:
    """``dataset.env_id=Pendulum-v1`` (documented: the task whose action space bounds the actions)
    bounds the actions of a file whose own action_space attribute is unbounded (the attribute
    does not come first, which would ask to "set dataset.env_id=<gymnasium id>", already set)."""
    from rl_tformers.agents.common.offline import DatasetInfo, load_offline_dataset

    h5 = _unbounded_file(tmp_path, "Pendulum-v1")
    ds = load_offline_dataset({"path": str(h5), "env_id": "Pendulum-v1"})
    assert ds.action_space == gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    info = DatasetInfo.from_dataset(ds)
    assert info.action_low.tolist() == [-2.0] and info.action_high.tolist() == [2.0]

    without = load_offline_dataset({"path": str(h5)})  # the file's attribute: unbounded, and said so
    with pytest.raises(ValueError) as e:
        DatasetInfo.from_dataset(without)
    assert ("; the file's own action_space attribute (Box(-inf, inf, (1,), float32)) was read before the action "
            "space Box(-2.0, 2.0, (1,), float32) of its env_id attribute 'Pendulum-v1': set "
            "dataset.env_id=Pendulum-v1 to take that task's bounds; set dataset.env_id=") in str(e.value)


@pytest.mark.parametrize(("env_id", "act_dim", "why"), [
    ("NotRegistered-v3", 1, "; env_id 'NotRegistered-v3' gives no bounds: gym.make('NotRegistered-v3') fails here "
                            "(NameNotFound: Environment `NotRegistered` doesn't exist.)"),
    ("CartPole-v1", 1, "; env_id 'CartPole-v1' gives no bounds: its action space Discrete(2) is not a Box"),
    ("Pendulum-v1", 2, "; env_id 'Pendulum-v1' gives no bounds: its action space Box(-2.0, 2.0, (1,), float32) has "
                       "another shape than the file's actions, (2,) per step"),
])
def test_unbounded_actions_error_says_why_the_named_task_gave_no_bounds(tmp_path, env_id, act_dim, why) -> None:
    """When dataset.env_id's environment cannot be made or does not fit, the error says why it
    gave no bounds (not only "set dataset.env_id", which is set already)."""
    from rl_tformers.agents.common.offline import DatasetInfo, load_offline_dataset

    h5 = _unbounded_file(tmp_path, None, act_dim)
    with pytest.raises(ValueError) as e:
        DatasetInfo.from_dataset(load_offline_dataset({"path": str(h5), "env_id": env_id}))
    msg = str(e.value)
    assert msg.startswith(f"continuous actions need a bounded Box action space, got Box(-inf, inf, ({act_dim},), "
                          f"float32); {h5}: the action bounds come from the task the data came from (env_id "
                          f"{env_id!r}), "), msg
    assert why + "; set dataset.env_id=<gymnasium id>" in msg, msg


# ------------------------------------------------- vector evaluation: discarded filler episodes
class _SeedLengthEnv(gym.Env):
    """Episode length set by the reset seed (``lengths[seed]``), 100 steps when reset unseeded."""

    def __init__(self, lengths: dict[int, int]):
        self.lengths = lengths
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.length, self.t = 100, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.length, self.t = self.lengths.get(seed, 100), 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(2, self.t, np.float32), 1.0, self.t >= self.length, False, {}


def test_a_discarded_filler_episode_does_not_stop_a_dt_evaluation_at_max_ep_len() -> None:
    """4 episodes on 3 environments: environments 1 and 2 finish their quota after 2 steps and run
    unseeded filler episodes (results discarded) while environment 0 runs its two 10-step
    episodes; the DT policy (max_ep_len=15, timestep_overflow=error) counted the fillers' steps on
    and stopped the evaluation at step 15 of a filler ("evaluate on episodes of at most 15
    steps"), though no counted episode is longer than 10."""
    from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
    from rl_tformers.agents.decision_transformer.policy import DTPolicy

    from rl_tformers.runtime.evaluation import evaluate

    torch.manual_seed(0)
    cfg = DTConfig(obs_dim=2, act_dim=1, context_len=4, max_ep_len=15, embed_dropout=0.0,
                   backbone={"d_model": 16, "n_layers": 1, "n_heads": 1, "dropout": 0.0, "attn_dropout": 0.0})
    pol = DTPolicy(DecisionTransformer(cfg), np.zeros(2), np.ones(2), 1.0, np.array([-1.0]), np.array([1.0]))
    rep = evaluate(pol, lambda: _SeedLengthEnv({0: 10, 1: 2, 2: 2, 3: 10}), [10.0], episodes=4, n_envs=3, seed=0)
    assert rep.results[0].lengths == [10, 2, 2, 10] and rep.results[0].returns == [10.0, 2.0, 2.0, 10.0]
    assert rep.results[0].seeds == [0, 1, 2, 3]
    # a counted episode past max_ep_len is still refused
    with pytest.raises(ValueError, match=r"episode step 15 >= agent.max_ep_len=15"):
        evaluate(pol, lambda: _SeedLengthEnv({0: 16, 1: 2, 2: 2, 3: 10}), [10.0], episodes=4, n_envs=3, seed=0)


# ------------------------------------------------- a Discrete evaluation env with fewer actions
def test_an_evaluation_env_with_fewer_discrete_actions_than_the_data_is_refused_before_training(tmp_path) -> None:
    """A DT trained on 3 discrete actions with agent.env_id=CartPole-v1 (2 actions) is refused
    before training (comparing only the kind and ``start`` of the space, the environment would
    fail with an AssertionError the first time the model chose action 2, after training)."""
    n = 30
    h5 = tmp_path / "three.hdf5"
    with h5py.File(h5, "w") as f:  # no env_id: the loader infers Discrete(3) from the actions
        f["observations"] = (np.random.default_rng(0).normal(size=(n, 4)) * 0.05).astype(np.float32)
        f["actions"] = np.arange(n) % 3
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"] = np.isin(np.arange(n), [9, 19, 29])
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.env_id=CartPole-v1",
                            "train.steps=1", *TINY_DT_DATA, "--run-dir", str(run)])
    assert r.exit_code == 2, r.output
    assert (f"error: actions: the dataset {h5} has actions in Discrete(3), but the evaluation environment "
            f"CartPole-v1 (agent.env_id) has action space Discrete(2); set agent.env_id to the environment the data "
            f"came from") in r.stderr
    assert not run.exists()

    # fewer actions in the data than in the environment (one the behaviour policy never took) is fine
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset

    two = tmp_path / "two.hdf5"
    with h5py.File(two, "w") as f:  # MountainCar-shaped: 2-D observations, actions 0 and 1 of its 3
        f["observations"] = np.zeros((n, 2), np.float32)
        f["actions"] = np.arange(n) % 2
        f["rewards"] = -np.ones(n, np.float32)
        f["terminals"] = np.isin(np.arange(n), [9, 19, 29])
    ds = load_dataset(two)
    assert ds.action_space == gym.spaces.Discrete(2)
    assert DatasetInfo.from_dataset(ds, env_id="MountainCar-v0").act_dim == 2


# ------------------------------------------------------------------- DT and backbone memory
@pytest.mark.parametrize("kind", ["xl", "compressive", "knn"])
def test_dt_refuses_a_backbone_memory_it_would_ignore(tmp_path: Path, kind: str) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = train_dt(f"dataset.path={h5}", f"backbone.memory.kind={kind}", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2, r.output
    assert f"backbone.memory.kind={kind!r}: the Decision Transformer" in r.output
    assert "agent.kind=gtrxl" in r.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------- --targets ""
@pytest.mark.parametrize("text", ["", " "])
def test_empty_targets_are_refused(text: str) -> None:
    from rl_tformers.runtime.evaluation import parse_targets

    with pytest.raises(ValueError, match=r"^--targets: '.*' is empty"):
        parse_targets(text)


# ------------------------------------------------------------------- %BC fraction
def test_bc_top_fraction_out_of_range_names_the_key(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = runner.invoke(app, ["train", "agent.kind=bc", f"dataset.path={h5}", "agent.top_fraction=0",
                            *[a for a in TINY_DT if not a.startswith(("backbone.", "agent."))],
                            "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2
    assert "error: agent.top_fraction must be a number in (0, 1], got 0" in r.output


# ------------------------------------------------------------------- huge agent.targets: before training
def test_agent_targets_beyond_the_return_embedding_are_refused_before_training(tmp_path: Path) -> None:
    from tests.datafiles import write_d4rl_h5

    h5 = write_d4rl_h5(tmp_path / "cp.hdf5")
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "train.steps=3",
                            "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4",
                            "agent.targets=[20,1e30]", "eval.every=0", "eval.at_end=true", "train.progress=false",
                            "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "agent.targets: 1e+30 is beyond what this model takes" in r.output
    assert not list((tmp_path / "run").glob("checkpoints/*.pt"))


# ------------------------------------------- resolved values, wide action bounds, raw observations
def test_auto_reward_scale_and_align_are_recorded_in_config_yaml(dt_run) -> None:
    text = (dt_run / "config.yaml").read_text()
    resolved = read_resolved(text)
    assert (resolved["agent.reward_scale"], resolved["agent.align"]) == (100.0, "start")
    assert yaml.safe_load(text)["agent"]["reward_scale"] == "auto"  # the config keeps what was asked
    assert ckpt.find_latest_valid(dt_run).state["extra"]["reward_scale"] == 100.0


def _box_dataset(low: float, high: float, returns: float = 1.0) -> EpisodeDataset:
    n = 6
    actions = np.linspace(-1.0, 1.0, n, dtype=np.float32)[:, None]
    rewards = np.full(n, returns / n)
    term = np.zeros(n, bool)
    term[-1] = True
    return EpisodeDataset.from_flags(np.zeros((n, 2), np.float32), actions, rewards, term,
                                     action_space=gym.spaces.Box(low, high, (1,), np.float32))


def test_action_bounds_too_wide_for_float32_normalisation_are_refused_naming_the_dimension() -> None:
    with pytest.raises(ValueError) as info:
        DatasetInfo.from_dataset(_box_dataset(-3e38, 3e38))
    assert str(info.value) == (
        "dataset (in memory): action dimension 0 has bounds [-3e+38, 3e+38] and its actions span [-1, 1], 6.67e-39 of "
        "the half-width: normalised to [-1, 1] by those bounds they differ by less than 1.08e-19, whose square "
        "underflows float32, so the model would train on targets of about 0 and act on the scale of the bounds; give "
        "the data an action space whose bounds fit its actions (dataset.env_id for a D4RL file, the dataset's "
        "action_space for Minari)")
    assert DatasetInfo.from_dataset(_box_dataset(-1e18, 1e18)).action_high.tolist() == [float(np.float32(1e18))]  # kept
    assert DatasetInfo.from_dataset(_box_dataset(-1.0, 1.0, returns=12_000.0)).reward_scale == 1000.0  # paper's


def test_raw_observations_that_overflow_the_embedding_are_refused_naming_normalize_obs(tmp_path: Path) -> None:
    big = np.full((30, 4), 3.0e38, np.float32)
    h5 = write_d4rl_h5(tmp_path / "big.hdf5", observations=big)
    r = train_dt(f"dataset.path={h5}", "agent.normalize_obs=false", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: agent.normalize_obs=false: the dataset {h5}'s largest |observation| 3e+38 would "
                           f"overflow float32 in this model's observation embedding (its LayerNorm), which takes raw "
                           f"observations up to "), line
    assert line.endswith(": the first loss would be NaN whatever train.lr is; set agent.normalize_obs=true "
                         "(observations standardised by the dataset's mean/std) or rescale them"), line
    assert not (tmp_path / "run").exists()
    small = train_dt(f"dataset.path={write_d4rl_h5(tmp_path / 'ok.hdf5')}", "agent.normalize_obs=false",
                     "--run-dir", str(tmp_path / "ok"))
    assert small.exit_code == 0, small.output


def test_agent_deciding_step_only_reaches_the_policy_and_is_off_by_default(tmp_path) -> None:
    """``agent.deciding_step_only=true`` gives the run's policy the deciding-step forward
    (DTPolicy.deciding_step_only); without it the policy runs every window step."""
    from rl_tformers.runtime.loading import load_run

    h5 = _counter_h5(tmp_path / "c.hdf5")
    for flag, want in (([], False), (["agent.deciding_step_only=true"], True)):
        run = tmp_path / f"run-{want}"
        r = _cli_train(f"dataset.path={h5}", *flag, "--run-dir", str(run))
        assert r.exit_code == 0, r.output
        assert load_run(run).agent.policy().base.deciding_step_only is want
