"""Online Decision Transformer fine-tuning (``agent.kind=odt``, agents/decision_transformer/online.py):
the replay buffer (top-N start, FIFO), hindsight return relabelling, refusals, an end-to-end
fine-tune, bit-identical resume, the sampling policy and ``rl-tformers eval`` on the run.

Data: random-action Pendulum-v1 episodes of 18-30 steps written as a D4RL file in tmp_path;
the offline run is a tiny gaussian-head DT trained for 6 updates."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from rl_tformers.agents.common.scripted import collect_delayed_expert
from rl_tformers.agents.decision_transformer.agent import DTAgent
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.online import (
    ODTAgent,
    TrajectoryBuffer,
    default_online_target,
    fine_tune_changes,
    offline_default,
    top_episodes,
)
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.samplers import WindowSampler
from typer.testing import CliRunner

from rl_tformers.backbone_config import BackboneConfig, ConfigAdviceWarning
from rl_tformers.cli import app
from rl_tformers.runtime.agent_registry import AgentBuildError, get_agent
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import resume, train
from tests.bitwise import same_bits
from tests.pendulum import random_pendulum_dataset
from tests.threads import one_thread

TINY_BB = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1"]
ENV = ["agent.max_ep_len=30", "agent.env_kwargs={max_episode_steps: 25}"]
OFFLINE = ["train.steps=6", "train.batch_size=8", "train.warmup_steps=2", "train.progress=false", "device=cpu",
           "eval.at_end=false", "agent.targets=[-100]", *ENV]
# 3 rounds of 4 updates, 2 episodes per round in 2 environments
ONLINE = ["agent.kind=odt", "train.steps=12", "train.batch_size=8", "train.progress=false", "train.log_every=1",
          "train.checkpoint_every=0", "device=cpu", "eval.at_end=false", "agent.targets=[-100]",
          "agent.online.updates_per_round=4", "agent.online.rollouts_per_round=2", "agent.online.n_envs=2",
          "agent.online.buffer_size=10", "agent.online.target_return=-50", *ENV]


_one_thread = one_thread  # autouse, module scope: one torch thread


@pytest.fixture(scope="module")
def pendulum(tmp_path_factory) -> tuple[EpisodeDataset, Path]:
    ds = random_pendulum_dataset([30, 18, 25, 22, 30, 20])  # random-action episodes, truncated
    return ds, save_d4rl_hdf5(ds, tmp_path_factory.mktemp("data") / "pendulum.hdf5")


def _offline(path: Path, run: Path, *extra: str) -> Path:
    train(compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY_BB, *OFFLINE, *extra]), run)
    return run


@pytest.fixture(scope="module")
def offline_run(pendulum, tmp_path_factory) -> Path:
    return _offline(pendulum[1], tmp_path_factory.mktemp("runs") / "dt-gauss", "agent.head=gaussian")


def _cfg(offline_run: Path, data: Path, *extra: str):
    # the offline run's backbone (cartpole_demo's dropout, TINY_BB) and options: no fine-tune warning
    return compose("dt/cartpole_demo", [f"dataset.path={data}", f"agent.init_from={offline_run}", *TINY_BB,
                                        *ONLINE, *extra])


def _metrics(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k != "time" and not k.startswith("perf/")} for x in lines]


def _ckpt(run: Path, step: int = 12) -> dict:
    return torch.load(run / "checkpoints" / f"step_{step:09d}.pt", weights_only=True)


_same = same_bits


# -- the buffer ---------------------------------------------------------------------------------

def _tiny(returns: list[float], lengths: list[int] | None = None) -> EpisodeDataset:
    """One-dimensional episodes whose rewards sum to ``returns`` (the last step carries it)."""
    lengths = lengths or [2] * len(returns)
    eps = []
    for r, n in zip(returns, lengths):
        rew = np.zeros(n)
        rew[-1] = r
        eps.append({"observations": np.arange(n + 1, dtype=np.float32)[:, None], "actions": np.zeros((n, 1), np.float32),
                    "rewards": rew, "terminations": np.eye(1, n, n - 1, dtype=bool)[0], "truncations": np.zeros(n, bool)})
    return EpisodeDataset.from_episodes(eps, action_space=gym.spaces.Box(-1, 1, (1,), np.float32))


def _episode(n: int, reward: float) -> dict:
    return {"observations": np.full((n, 1), 7.0, np.float32), "actions": np.zeros((n, 1), np.float32),
            "rewards": np.full(n, reward), "terminated": False}


def test_buffer_starts_with_the_best_episodes_worst_first_and_replaces_the_oldest():
    assert top_episodes(np.array([5.0, 9.0, 5.0, 1.0]), 3).tolist() == [2, 0, 1]  # the docstring's example
    # equal returns: the earlier dataset episode ranks higher (kept at the cut, replaced later)
    assert top_episodes(np.array([5.0, 5.0, 5.0]), 2).tolist() == [1, 0]
    assert top_episodes(np.array([3.0, 1.0]), 5).tolist() == [1, 0]  # fewer than asked: all, ascending
    buf = TrajectoryBuffer(_tiny([5, 9, 5, 1]), capacity=3)
    assert [v for _, v in buf.entries] == [2, 0, 1]
    np.testing.assert_array_equal(buf.returns(), [5, 5, 9])
    buf.add([_episode(3, 1.0)])  # full: replaces the oldest (the worst offline one kept)
    assert [s for s, _ in buf.entries] == ["offline", "offline", "online"]
    assert [v for s, v in buf.entries if s == "offline"] == [0, 1]
    buf.add([_episode(1, 2.0), _episode(2, 3.0)])
    assert [s for s, _ in buf.entries] == ["online"] * 3
    np.testing.assert_array_equal(buf.returns(), [3.0, 2.0, 6.0])  # FIFO: oldest first
    np.testing.assert_array_equal(buf.dataset().lengths, [3, 1, 2])


def test_buffer_grows_until_full_and_its_state_round_trips():
    ds = _tiny([1, 2], [2, 3])
    buf = TrajectoryBuffer(ds, capacity=4)
    buf.add([_episode(2, 0.5)])
    assert len(buf) == 3 and buf.num_steps == 2 + 3 + 2
    buf.add([_episode(4, 1.5), _episode(1, -1.0)])
    assert len(buf) == 4 and [s for s, _ in buf.entries] == ["offline", "online", "online", "online"]
    other = TrajectoryBuffer(ds, capacity=4)
    other.load_state_dict(buf.state_dict())
    a, b = buf.dataset(), other.dataset()
    for name in ("observations", "actions", "rewards", "terminations", "truncations", "starts", "lengths"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    changed = TrajectoryBuffer(_tiny([1, 3], [2, 3]), capacity=4)
    with pytest.raises(ValueError, match="not the one this run's replay buffer was filled from"):
        changed.load_state_dict(buf.state_dict(), "data.hdf5")


# -- the policy ---------------------------------------------------------------------------------

def _policy(head: str = "gaussian", **kw) -> DTPolicy:
    torch.manual_seed(0)
    bb = BackboneConfig.from_dict({"d_model": 16, "n_layers": 1, "n_heads": 1, "dropout": 0.0, "attn_dropout": 0.0})
    model = DecisionTransformer(DTConfig(obs_dim=3, act_dim=2, context_len=4, max_ep_len=50, head=head, backbone=bb))
    with torch.no_grad():  # a wide Gaussian: draws reach far from the mean
        model.head.bias[2:] = 5.0
    low, high = np.array([-2.0, 0.0], np.float32), np.array([2.0, 0.5], np.float32)
    return DTPolicy(model, np.zeros(3), np.ones(3), 1.0, low, high, **kw)


def _act(policy: DTPolicy, steps: int = 6, n: int = 8) -> np.ndarray:
    obs = np.random.default_rng(1).normal(size=(steps, n, 3)).astype(np.float32)
    state = policy.initial_state(n, target_return=10.0)
    out = []
    for t in range(steps):
        a, state = policy.act(obs[t], state, np.full(n, t == 0), None if t == 0 else np.ones(n))
        out.append(a)
    return np.stack(out)  # (steps, N, A)


def test_sampling_policy_is_stochastic_seeded_and_within_the_bounds():
    mean = _act(_policy())
    a = _act(_policy(sample=True, generator=torch.Generator().manual_seed(3)))
    b = _act(_policy(sample=True, generator=torch.Generator().manual_seed(3)))
    c = _act(_policy(sample=True, generator=torch.Generator().manual_seed(4)))
    np.testing.assert_array_equal(a, b)  # a pure function of the generator's seed
    assert not np.array_equal(a, c) and not np.array_equal(a, mean)
    assert (np.abs(a - mean) > 1e-3).mean() > 0.9  # nearly every draw is away from the mean
    assert a.std(axis=(0, 1)).min() > 0.05
    for x in (a, c, mean):
        assert (x >= [-2.0, 0.0]).all() and (x <= [2.0, 0.5]).all()
    with pytest.raises(ValueError, match="needs agent.head=gaussian"):
        _policy(head="deterministic", sample=True)


# -- the agent ----------------------------------------------------------------------------------

def test_offline_runs_the_online_phase_cannot_fine_tune_are_refused(pendulum, tmp_path):
    ds, path = pendulum
    det = _offline(path, tmp_path / "det")
    with pytest.raises(AgentBuildError, match=r"agent.head='deterministic'.*agent.head=gaussian"):
        train(_cfg(det, path), tmp_path / "odt-det")
    cartpole = save_d4rl_hdf5(collect_delayed_expert(4, seed=0, n_envs=4), tmp_path / "cartpole.hdf5")
    disc = tmp_path / "disc"
    train(compose("dt/cartpole_demo", [f"dataset.path={cartpole}", *TINY_BB, "train.steps=2", "train.batch_size=4",
                                       "train.progress=false", "device=cpu", "eval.at_end=false"]), disc)
    with pytest.raises(AgentBuildError, match="discrete.*agent.head=gaussian"):
        train(_cfg(disc, path), tmp_path / "odt-disc")
    with pytest.raises(AgentBuildError, match="agent.init_from=.*no such run directory"):
        train(_cfg(tmp_path / "missing", path), tmp_path / "odt-missing")
    with pytest.raises(AgentBuildError, match="agent.init_from is required"):
        train(_cfg(det, path, "agent.init_from=null"), tmp_path / "odt-none")
    with pytest.raises(ConfigError, match=r"^agent.online.updates_per_round must be an integer >= 1, got 0$"):
        train(_cfg(det, path, "agent.online.updates_per_round=0"), tmp_path / "odt-zero")
    assert not (tmp_path / "odt-det").exists() and not (tmp_path / "odt-disc").exists()


def test_more_than_one_process_is_refused(pendulum, offline_run, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets for --nproc 2 (dist_info reads it)
    with pytest.raises(ValueError, match=r"one process.*--nproc 1"):
        ODTAgent(_cfg(offline_run, pendulum[1]), None, "cpu")


def test_more_than_one_process_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    """odt registers with single_process=True: `train --nproc 2` is refused by the launcher's
    checks (check_world_size), before torchrun starts anything (the agent's own check runs only
    once the processes are up)."""
    from rl_tformers.cli import train as commands
    from rl_tformers.runtime.trainer import check_world_size

    assert get_agent("odt").single_process and not get_agent("dt").single_process
    cfg = compose("dt/cartpole_demo", ["agent.kind=odt", "agent.init_from=nowhere"])
    check_world_size(cfg, 1)
    with pytest.raises(ConfigError, match=r"agent.kind=odt runs in one process only.*--nproc 1"):
        check_world_size(cfg, 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(commands, "_run_torchrun", lambda *a, **k: pytest.fail("torchrun was started"))
    run = tmp_path / "odt"
    res = CliRunner().invoke(app, ["train", "-c", "dt/cartpole_demo", "agent.kind=odt", "agent.init_from=nowhere",
                                   "--nproc", "2", "--run-dir", str(run)])
    assert res.exit_code == 2 and "one process only" in res.output and "--nproc 1" in res.output, res.output
    assert not run.exists()


def test_null_online_target_is_never_below_the_evaluation_target(pendulum, offline_run):
    """agent.online.target_return=null: t + |t| of the evaluation target t (2t for t >= 0, the
    paper's Hopper 7200 = 2 x 3600; 2t would explore below a negative target)."""
    assert default_online_target(3600) == 7200.0
    assert default_online_target(-100) == 0.0 and default_online_target(0) == 0.0
    agent = ODTAgent(_cfg(offline_run, pendulum[1], "agent.online.target_return=null"), None, "cpu")
    assert agent.default_targets() == [-100.0] and agent.online_target == 0.0


def test_configured_model_options_that_differ_from_the_checkpoint_are_named(pendulum, offline_run):
    with pytest.warns(ConfigAdviceWarning, match=r"agent.context_len=5 \(the checkpoint's: 20\).*backbone.d_model=32"):
        agent = ODTAgent(_cfg(offline_run, pendulum[1], "agent.context_len=5", "backbone.d_model=32"), None, "cpu")
    assert agent.model_cfg.context_len == 20 and agent.model_cfg.backbone.d_model == 16  # the checkpoint's


def test_eval_context_len_is_the_odt_run_s_own_and_reaches_rollouts_and_evaluation(pendulum, offline_run):
    """agent.eval_context_len is an inference option of the odt config (the paper's 5 on Hopper),
    not one of the offline run's model options: both the sampling policy of the rollouts and the
    evaluation policy read only that many steps; an out-of-range value is refused by name."""
    agent = ODTAgent(_cfg(offline_run, pendulum[1], "agent.eval_context_len=5"), None, "cpu")
    assert agent.model_cfg.context_len == 20
    assert agent.policy().context_steps == 5 and agent.policy(sample=True).context_steps == 5
    with pytest.raises(ValueError, match=r"^agent.eval_context_len must be at most agent.context_len=20 \(the steps "
                                         r"of context read when acting\) or null \(all K\), got 21$"):
        ODTAgent(_cfg(offline_run, pendulum[1], "agent.eval_context_len=21"), None, "cpu")


def test_collected_trajectory_is_relabelled_with_its_achieved_returns(pendulum, offline_run):
    ds, path = pendulum
    agent = ODTAgent(_cfg(offline_run, path), None, "cpu")
    state = torch.load(sorted((offline_run / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert all(torch.equal(v, state["model"][k]) for k, v in agent.model.state_dict().items())  # the offline weights
    assert len(agent.buffer) == 6  # every offline episode (buffer_size 10)
    episodes = agent.collect_round()
    assert agent.model.training and agent.rounds == 1 and len(agent.buffer) == 8
    assert [len(e["rewards"]) for e in episodes] == [25, 25] and agent.env_steps == 50  # cut by the time limit
    # the stored episode is what the environment did: replay its actions from its reset seed
    seed = agent.round_seed(0)
    for j, ep in enumerate(episodes):
        env = gym.make("Pendulum-v1", max_episode_steps=25)
        obs, _ = env.reset(seed=seed + j)
        for t in range(25):
            np.testing.assert_array_equal(ep["observations"][t], obs)
            obs, r, *_ = env.step(ep["actions"][t])
            assert ep["rewards"][t] == r
    # hindsight: returns-to-go from the achieved rewards (suffix sums), not from the target -50
    data = agent.buffer.dataset()
    sampler = WindowSampler(data, 20, reward_scale=agent.info.reward_scale)
    for e, ep in zip((6, 7), episodes):
        hand, acc = [], 0.0
        for r in reversed(ep["rewards"].tolist()):
            acc += r
            hand.append(acc)
        s = data.starts[e]
        np.testing.assert_array_equal(sampler.rtg[s:s + 25], hand[::-1])
        assert sampler.rtg[s] == pytest.approx(sum(ep["rewards"])) and sampler.rtg[s] != -50.0
    assert agent.round_stats()["online_return"] == pytest.approx(np.mean([sum(e["rewards"]) for e in episodes]))
    batch = next(iter(agent.batches(1)))  # a batch of the training stream: the DT's windows, RTG / scale
    rows = np.flatnonzero(batch["episode"].numpy() >= 6)
    assert rows.size > 0
    for i in rows:
        ep = episodes[int(batch["episode"][i]) - 6]
        t0 = int(batch["timesteps"][i, 0])
        n = int(batch["mask"][i].sum())
        want = np.array(hand_rtg(ep["rewards"])[t0:t0 + n]) / agent.info.reward_scale
        np.testing.assert_allclose(batch["returns_to_go"][i, :n].numpy(), want.astype(np.float32), rtol=0, atol=0)


def hand_rtg(rewards: np.ndarray) -> list[float]:
    out, acc = [], 0.0
    for r in reversed(rewards.tolist()):
        acc += r
        out.append(acc)
    return out[::-1]


@pytest.fixture(scope="module")
def odt_run(pendulum, offline_run, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("odt") / "full"
    res = train(_cfg(offline_run, pendulum[1]), run)
    assert res.step == 12
    return run


def test_fine_tune_end_to_end_grows_the_buffer_with_finite_loss(odt_run):
    m = _metrics(odt_run)
    assert len(m) == 12 and all(math.isfinite(x["train/loss"]) for x in m)
    assert [x["train/rounds"] for x in m] == [1.0] * 4 + [2.0] * 4 + [3.0] * 4
    assert [x["train/buffer_trajectories"] for x in m[::4]] == [8.0, 10.0, 10.0]  # 6 offline + 2 per round, max 10
    assert [x["train/env_steps"] for x in m[::4]] == [50.0, 100.0, 150.0]
    assert {"train/online_return", "train/temperature", "train/entropy", "train/nll", "train/buffer_steps"} <= set(m[0])
    st = _ckpt(odt_run)
    buf = st["trainer"]["process_ranks"][0]["buffer"]
    assert (buf["order"] == -1).sum() == 6 and buf["online"]["lengths"].tolist() == [25] * 6
    assert st["extra"]["odt"]["rounds"] == 3 and st["extra"]["odt"]["env_steps"] == 150


@pytest.mark.parametrize("stops", [(6,), (8,), (3, 8)], ids=["inside-a-round", "at-a-round-boundary", "twice"])
def test_stopped_run_resumes_bit_identically(odt_run, pendulum, offline_run, tmp_path, stops):
    split = tmp_path / "split"
    assert train(_cfg(offline_run, pendulum[1]), split, stop_at=stops[0]).step == stops[0]
    for stop in stops[1:]:
        assert resume(split, stop_at=stop).step == stop
    assert resume(split).step == 12
    assert _metrics(split) == _metrics(odt_run)
    a, b = _ckpt(odt_run), _ckpt(split)
    for key in ("model", "optimizer", "extra", "rng"):
        assert _same(a[key], b[key]), key
    assert _same(a["trainer"]["process_ranks"], b["trainer"]["process_ranks"])  # the same buffer


def test_eval_command_on_the_odt_run_acts_with_the_mean(odt_run):
    args = ["eval", str(odt_run), "--targets", "-100", "--episodes", "2", "--envs", "2", "--seed", "5", "--json"]
    runs = [CliRunner().invoke(app, args) for _ in range(2)]
    assert all(r.exit_code == 0 for r in runs), runs[0].output
    out = [json.loads(r.output) for r in runs]
    assert out[0]["results"] == out[1]["results"]  # deterministic: the Gaussian's mean
    r = out[0]["results"][0]
    assert r["target_return"] == -100.0 and r["lengths"] == [25, 25] and -25 * 16.3 <= r["return_mean"] <= 0


def test_zero_rollouts_is_the_offline_continuation_control(pendulum, offline_run, tmp_path):
    """agent.online.rollouts_per_round=0: the same training on the unchanged top-N offline buffer,
    no exploration environment, no environment steps; rounds still count (resume checks them),
    and a stopped control run resumes bit-identically. A negative count is refused by name."""
    cfg = _cfg(offline_run, pendulum[1], "agent.online.rollouts_per_round=0")
    agent = ODTAgent(cfg, None, "cpu")
    before = agent.buffer.state_dict()
    stream = agent.batches(0)
    first = next(stream)
    assert agent._envs is None and agent.rounds == 1 and agent.env_steps == 0
    assert _same(agent.buffer.state_dict(), before)  # nothing added
    want = WindowSampler(agent.buffer.dataset(), agent.model_cfg.context_len, align=agent.align,
                         reward_scale=agent.info.reward_scale, obs_stats=agent._sampler.obs_stats,
                         max_ep_len=agent.model_cfg.max_ep_len).sample(8, np.random.default_rng([agent.seed, 0]))
    for k, v in want.items():
        np.testing.assert_array_equal(first[k].numpy(), v, err_msg=k)
    run, split = tmp_path / "control", tmp_path / "control-split"
    assert train(cfg, run).step == 12
    m = _metrics(run)
    assert [x["train/rounds"] for x in m] == [1.0] * 4 + [2.0] * 4 + [3.0] * 4
    assert {x["train/env_steps"] for x in m} == {0.0} and {x["train/buffer_trajectories"] for x in m} == {6.0}
    assert "train/online_return" not in m[-1]
    assert train(cfg, split, stop_at=6).step == 6 and resume(split).step == 12
    assert _metrics(split) == m
    assert _same(_ckpt(run)["model"], _ckpt(split)["model"])
    with pytest.raises(ConfigError, match=r"^agent.online.rollouts_per_round must be an integer >= 0, got -1$"):
        train(_cfg(offline_run, pendulum[1], "agent.online.rollouts_per_round=-1"), tmp_path / "neg")


OFFLINE_ODT = ["train.steps=4", "train.batch_size=8", "train.warmup_steps=1", "train.progress=false", "device=cpu",
           "eval.at_end=false", "agent.targets=[-100]", "agent.head=gaussian"]


ONLINE_ODT = ["agent.kind=odt", "train.steps=4", "train.batch_size=8", "train.progress=false", "train.warmup_steps=0",
          "train.checkpoint_every=0", "device=cpu", "eval.at_end=false", "agent.targets=[-100]",
          "agent.online.updates_per_round=2", "agent.online.rollouts_per_round=2", "agent.online.n_envs=2",
          "agent.online.buffer_size=10", "agent.online.target_return=-50"]


def _data(path: Path, lengths: list[int]) -> Path:
    return save_d4rl_hdf5(random_pendulum_dataset(lengths), path)


@pytest.fixture(scope="module")
def pendulum_odt(tmp_path_factory) -> Path:
    return _data(tmp_path_factory.mktemp("data") / "pendulum_odt.hdf5", [30, 18, 25, 22, 30, 20])


def _offline_odt(data: Path, run: Path, *extra: str) -> Path:
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_BB, *OFFLINE_ODT, *ENV, *extra]), run)
    return run


@pytest.fixture(scope="module")
def offline_run_odt(pendulum_odt, tmp_path_factory) -> Path:
    return _offline_odt(pendulum_odt, tmp_path_factory.mktemp("runs") / "dt-gauss")


def _cfg_odt(init: Path | str, data: Path, *extra: str, env: tuple[str, ...] = tuple(ENV)):
    return compose("dt/cartpole_demo", [f"dataset.path={data}", f"agent.init_from={init}", *TINY_BB, *ONLINE_ODT,
                                        *env, *extra])


def _newest(run: Path) -> dict:
    return torch.load(sorted((run / "checkpoints").glob("*.pt"))[-1], weights_only=True)


def test_checkpoint_is_saved_once_every_offline_episode_left_the_buffer(pendulum_odt, offline_run_odt, tmp_path):
    """buffer_size=1 with 2 rollouts per round: after round 0 the buffer holds one online
    episode and no offline one. The final checkpoint must still be written (today: RuntimeError
    while hashing the empty ``offline_returns`` tensor, no checkpoint at all)."""
    run = tmp_path / "odt"
    res = train(_cfg_odt(offline_run_odt, pendulum_odt, "agent.online.buffer_size=1", "train.steps=2"), run)
    assert res.step == 2 and res.checkpoint is not None and res.checkpoint.exists()
    buf = _newest(run)["trainer"]["process_ranks"][0]["buffer"]
    assert buf["order"].tolist() == [-1]  # one online trajectory, no offline one


def test_checkpoint_is_saved_when_the_default_sized_run_fills_its_buffer(pendulum_odt, offline_run_odt, tmp_path):
    """The shipped test's setting (6 offline episodes, buffer 10, 2 episodes a round), just one
    round longer than the buffer lasts: every later checkpoint is saved."""
    run = tmp_path / "odt"
    res = train(_cfg_odt(offline_run_odt, pendulum_odt, "agent.online.buffer_size=4", "train.steps=6"), run)
    assert res.step == 6 and res.checkpoint is not None and res.checkpoint.exists()


@pytest.mark.parametrize("changed", [["agent.context_len=5"], ["backbone.d_model=32"]], ids=["context_len", "d_model"])
def test_resume_does_not_adopt_a_changed_init_run(pendulum_odt, tmp_path, changed):
    """The odt checkpoint holds the model options and backbone it was built with
    (``extra.odt``). A resume after the offline run at ``agent.init_from`` was retrained with
    other options must either continue the run as it was, or refuse naming agent.init_from (not
    silently change K to 5, the new context_len, nor end with a raw RuntimeError on a size mismatch)."""
    init = _offline_odt(pendulum_odt, tmp_path / "offline")
    run = tmp_path / "odt"
    train(_cfg_odt(init, pendulum_odt), run)
    before = _newest(run)["extra"]["odt"]
    shutil.rmtree(init)
    _offline_odt(pendulum_odt, init, *changed)  # the same folder now holds another offline run
    try:
        resume(run, ["train.steps=6"])
    except ValueError as exc:  # a refusal is fine when it says why
        assert "agent.init_from" in str(exc)
        return
    after = _newest(run)["extra"]["odt"]
    assert after["agent"] == before["agent"] and after["backbone"] == before["backbone"]


def test_relative_init_from_resumes_from_another_folder(pendulum_odt, tmp_path, monkeypatch):
    """``dataset.path`` relative to the start folder can be passed as an absolute override on
    resume; ``agent.init_from`` can neither be found from another folder nor be overridden."""
    start = tmp_path / "start"
    start.mkdir()
    _offline_odt(pendulum_odt, start / "offrun")
    run = tmp_path / "odt"
    monkeypatch.chdir(start)
    train(_cfg_odt("offrun", pendulum_odt), run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    errors = []
    for overrides in (["train.steps=6"], ["train.steps=6", f"agent.init_from={start / 'offrun'}"]):
        try:
            assert resume(run, overrides).step == 6
            return
        except ValueError as exc:
            errors.append(str(exc))
    pytest.fail("the run cannot be resumed from another folder:\n" + "\n".join(errors))


def test_too_long_offline_episode_is_named_by_its_dataset_index(offline_run_odt, tmp_path):
    """Dataset episode 2 (60 steps) exceeds the offline run's agent.max_ep_len=30; it is the
    worst episode, so it sits first in the buffer. The DT's error names the dataset episode
    (``check_max_ep_len``); the ODT's says "episode 0" and names no option."""
    long = _data(tmp_path / "long.hdf5", [30, 18, 60, 22])
    with pytest.raises(ValueError) as info:  # raised when the run's batches are set up
        train(_cfg_odt(offline_run_odt, long), tmp_path / "odt")
    msg = str(info.value)
    assert "episode 2" in msg and "episode 0" not in msg, msg
    assert "dataset.path" in msg or "agent.max_ep_len" in msg or "agent.init_from" in msg, msg


def test_time_limit_beyond_max_ep_len_is_warned_up_front(pendulum_odt, tmp_path, caplog):
    """The offline run has agent.max_ep_len=30 in Pendulum-v1's own 200-step episodes. The DT
    warns when it is built; the odt run builds its agent without a word and fails at the first
    evaluation after training."""
    init = tmp_path / "offline"
    offline_cfg = compose("dt/cartpole_demo", [f"dataset.path={pendulum_odt}", *TINY_BB, *OFFLINE_ODT, "agent.max_ep_len=30"])
    train(offline_cfg, init)

    def warned(build) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            build()
        return " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)

    dt = warned(lambda: DTAgent(offline_cfg, None, "cpu"))
    assert "max_ep_len" in dt and "200" in dt, dt  # the DT's warning (the capture works)
    odt = warned(lambda: ODTAgent(_cfg_odt(init, pendulum_odt, env=("agent.max_ep_len=30",)), None, "cpu"))
    assert "max_ep_len" in odt and "200" in odt, odt


def test_online_null_is_refused_naming_the_option(pendulum_odt, offline_run_odt):
    with pytest.raises(ValueError, match=r"agent\.online"):
        ODTAgent(_cfg_odt(offline_run_odt, pendulum_odt, "agent.online=null"), None, "cpu")


def test_fine_tuning_takes_the_offline_run_s_observation_encoder() -> None:
    """agent.encoder is a model option of the offline run: a config that sets another is named
    as ignored, and a saved run without the key had the DT's default (linear)."""
    assert offline_default("encoder") == {"kind": "linear"}
    saved = {"agent": {"encoder": {"kind": "nature_cnn", "features": 512}}, "backbone": {}}
    configured = {"agent": {"encoder": {"kind": "linear"}}, "backbone": {}}
    changes = fine_tune_changes(configured, saved)
    assert "agent.encoder={'kind': 'linear'} (the checkpoint's: {'kind': 'nature_cnn', 'features': 512})" in changes
    assert not [c for c in fine_tune_changes(configured, {"agent": {}, "backbone": {}}) if c.startswith("agent.encoder")]
