"""Defects of Online DT fine-tuning (``agent.kind=odt``) found by the ODT breaker pass:

1. once every offline episode has left the replay buffer (``agent.online.buffer_size`` reached
   by online trajectories), saving a checkpoint crashes (``RuntimeError: self.stride(-1) must
   be 1 ...`` from hashing the empty ``offline_returns`` tensor): no checkpoint, the run is lost;
2. ``--resume`` rebuilds the model from ``agent.init_from``'s *current* newest checkpoint: an
   offline run retrained there with another ``agent.context_len`` silently changes the resumed
   run's K (and the saved ``extra.odt.agent``); another ``backbone.d_model`` ends in a raw
   ``RuntimeError`` (state-dict size mismatch) instead of an error naming ``agent.init_from``;
3. a run started with a relative ``agent.init_from`` cannot be resumed from another folder, and
   passing the absolute path is refused ("these keys cannot change when resuming");
4. an offline episode longer than the offline run's ``agent.max_ep_len`` is reported with its
   position in the replay buffer ("episode 0"), not its dataset index, and no option is named;
5. no up-front warning when the environment's time limit exceeds the offline run's
   ``agent.max_ep_len`` (the DT warns; the ODT run fails only at its final evaluation);
6. ``agent.online=null`` ends in ``AttributeError: 'NoneType' object has no attribute 'get'``.

Data: random-action Pendulum-v1 episodes written as a D4RL file in tmp_path; the offline runs
are tiny gaussian-head DTs trained for a few updates.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from rl_tformers.agents.decision_transformer.agent import DTAgent
from rl_tformers.agents.decision_transformer.online import ODTAgent
from rl_tformers.envs.loaders import save_d4rl_hdf5

from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train
from tests.pendulum import random_pendulum_dataset
from tests.threads import one_thread

TINY_BB = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1"]
ENV = ["agent.max_ep_len=30", "agent.env_kwargs={max_episode_steps: 25}"]
OFFLINE = ["train.steps=4", "train.batch_size=8", "train.warmup_steps=1", "train.progress=false", "device=cpu",
           "eval.at_end=false", "agent.targets=[-100]", "agent.head=gaussian"]
ONLINE = ["agent.kind=odt", "train.steps=4", "train.batch_size=8", "train.progress=false", "train.warmup_steps=0",
          "train.checkpoint_every=0", "device=cpu", "eval.at_end=false", "agent.targets=[-100]",
          "agent.online.updates_per_round=2", "agent.online.rollouts_per_round=2", "agent.online.n_envs=2",
          "agent.online.buffer_size=10", "agent.online.target_return=-50"]


_one_thread = one_thread  # autouse, module scope: one torch thread


def _data(path: Path, lengths: list[int]) -> Path:
    return save_d4rl_hdf5(random_pendulum_dataset(lengths), path)


@pytest.fixture(scope="module")
def pendulum(tmp_path_factory) -> Path:
    return _data(tmp_path_factory.mktemp("data") / "pendulum.hdf5", [30, 18, 25, 22, 30, 20])


def _offline(data: Path, run: Path, *extra: str) -> Path:
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_BB, *OFFLINE, *ENV, *extra]), run)
    return run


@pytest.fixture(scope="module")
def offline_run(pendulum, tmp_path_factory) -> Path:
    return _offline(pendulum, tmp_path_factory.mktemp("runs") / "dt-gauss")


def _cfg(init: Path | str, data: Path, *extra: str, env: tuple[str, ...] = tuple(ENV)):
    return compose("dt/cartpole_demo", [f"dataset.path={data}", f"agent.init_from={init}", *TINY_BB, *ONLINE,
                                        *env, *extra])


def _newest(run: Path) -> dict:
    return torch.load(sorted((run / "checkpoints").glob("*.pt"))[-1], weights_only=True)


# -- 1 ------------------------------------------------------------------------------------------

def test_checkpoint_is_saved_once_every_offline_episode_left_the_buffer(pendulum, offline_run, tmp_path):
    """buffer_size=1 with 2 rollouts per round: after round 0 the buffer holds one online
    episode and no offline one. The final checkpoint must still be written (today: RuntimeError
    while hashing the empty ``offline_returns`` tensor, no checkpoint at all)."""
    run = tmp_path / "odt"
    res = train(_cfg(offline_run, pendulum, "agent.online.buffer_size=1", "train.steps=2"), run)
    assert res.step == 2 and res.checkpoint is not None and res.checkpoint.exists()
    buf = _newest(run)["trainer"]["process_ranks"][0]["buffer"]
    assert buf["order"].tolist() == [-1]  # one online trajectory, no offline one


def test_checkpoint_is_saved_when_the_default_sized_run_fills_its_buffer(pendulum, offline_run, tmp_path):
    """The shipped test's setting (6 offline episodes, buffer 10, 2 episodes a round), just one
    round longer than the buffer lasts: every later checkpoint used to crash."""
    run = tmp_path / "odt"
    res = train(_cfg(offline_run, pendulum, "agent.online.buffer_size=4", "train.steps=6"), run)
    assert res.step == 6 and res.checkpoint is not None and res.checkpoint.exists()


# -- 2 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changed", [["agent.context_len=5"], ["backbone.d_model=32"]], ids=["context_len", "d_model"])
def test_resume_does_not_adopt_a_changed_init_run(pendulum, tmp_path, changed):
    """The odt checkpoint holds the model options and backbone it was built with
    (``extra.odt``). A resume after the offline run at ``agent.init_from`` was retrained with
    other options must either continue the run as it was, or refuse naming agent.init_from;
    today K silently becomes 5 (context_len) or a raw RuntimeError (size mismatch) ends it."""
    init = _offline(pendulum, tmp_path / "offline")
    run = tmp_path / "odt"
    train(_cfg(init, pendulum), run)
    before = _newest(run)["extra"]["odt"]
    shutil.rmtree(init)
    _offline(pendulum, init, *changed)  # the same folder now holds another offline run
    try:
        resume(run, ["train.steps=6"])
    except ValueError as exc:  # a refusal is fine when it says why
        assert "agent.init_from" in str(exc)
        return
    after = _newest(run)["extra"]["odt"]
    assert after["agent"] == before["agent"] and after["backbone"] == before["backbone"]


# -- 3 ------------------------------------------------------------------------------------------

def test_relative_init_from_resumes_from_another_folder(pendulum, tmp_path, monkeypatch):
    """``dataset.path`` relative to the start folder can be passed as an absolute override on
    resume; ``agent.init_from`` can neither be found from another folder nor be overridden."""
    start = tmp_path / "start"
    start.mkdir()
    _offline(pendulum, start / "offrun")
    run = tmp_path / "odt"
    monkeypatch.chdir(start)
    train(_cfg("offrun", pendulum), run)
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


# -- 4 ------------------------------------------------------------------------------------------

def test_too_long_offline_episode_is_named_by_its_dataset_index(offline_run, tmp_path):
    """Dataset episode 2 (60 steps) exceeds the offline run's agent.max_ep_len=30; it is the
    worst episode, so it sits first in the buffer. The DT's error names the dataset episode
    (``check_max_ep_len``); the ODT's says "episode 0" and names no option."""
    long = _data(tmp_path / "long.hdf5", [30, 18, 60, 22])
    with pytest.raises(ValueError) as info:  # raised when the run's batches are set up
        train(_cfg(offline_run, long), tmp_path / "odt")
    msg = str(info.value)
    assert "episode 2" in msg and "episode 0" not in msg, msg
    assert "dataset.path" in msg or "agent.max_ep_len" in msg or "agent.init_from" in msg, msg


# -- 5 ------------------------------------------------------------------------------------------

def test_time_limit_beyond_max_ep_len_is_warned_up_front(pendulum, tmp_path, caplog):
    """The offline run has agent.max_ep_len=30 in Pendulum-v1's own 200-step episodes. The DT
    warns when it is built; the odt run builds its agent without a word and fails at the first
    evaluation after training."""
    init = tmp_path / "offline"
    offline_cfg = compose("dt/cartpole_demo", [f"dataset.path={pendulum}", *TINY_BB, *OFFLINE, "agent.max_ep_len=30"])
    train(offline_cfg, init)

    def warned(build) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            build()
        return " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)

    dt = warned(lambda: DTAgent(offline_cfg, None, "cpu"))
    assert "max_ep_len" in dt and "200" in dt, dt  # the DT's warning (the capture works)
    odt = warned(lambda: ODTAgent(_cfg(init, pendulum, env=("agent.max_ep_len=30",)), None, "cpu"))
    assert "max_ep_len" in odt and "200" in odt, odt


# -- 6 ------------------------------------------------------------------------------------------

def test_online_null_is_refused_naming_the_option(pendulum, offline_run):
    with pytest.raises(ValueError, match=r"agent\.online"):
        ODTAgent(_cfg(offline_run, pendulum, "agent.online=null"), None, "cpu")
