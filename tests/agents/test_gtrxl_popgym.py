"""GTrXL on POPGym's tasks: PPO (configs/gtrxl/popgym_ppo.yaml), BC and IQL evaluated on a POPGym id,
`rl-tformers eval` of the runs, and the refusal without the popgym extra."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from rl_tformers.envs.environments import POPGYM_INSTALL, make_task
from typer.testing import CliRunner

from rl_tformers.cli import app
from tests.runs import assert_clean_exit

runner = CliRunner()

TASK = "popgym-RepeatPreviousEasy-v0"  # Discrete(4) observations (one-hot: 4 inputs), Discrete(4) actions, 51 steps
TINY_BACKBONE = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=8"]
TINY_PPO = ["agent.n_envs=4", "agent.n_steps=32", "agent.n_epochs=1", "agent.n_minibatches=1", "train.steps=3",
            "train.checkpoint_every=3", "eval.every=0", "eval.episodes=2", "eval.n_envs=2", "train.progress=false",
            *TINY_BACKBONE, "--device", "cpu"]


def _eval_json(run: Path) -> dict:
    r = runner.invoke(app, ["eval", str(run), "--episodes", "2", "--envs", "2", "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _episode_returns_are_the_task_s(report: dict) -> None:
    """RepeatPreviousEasy: 51-step episodes (a deck of 52 cards) scored +-1/48 at each of the 48 steps
    with a card 4 steps earlier, so the return lies in [-1, 1] on the 1/24 grid."""
    (result,) = report["results"]
    assert report["env_id"] == TASK and result["lengths"] == [51, 51]
    for ret in result["returns"]:
        assert -1.0 <= ret <= 1.0 and ret * 24 == pytest.approx(round(ret * 24), abs=1e-9)


def test_ppo_gtrxl_trains_on_a_popgym_task_and_evaluates_through_the_cli(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("popgym")
    run = tmp_path / "ppo"
    r = runner.invoke(app, ["train", "-c", "gtrxl/popgym_ppo", *TINY_PPO, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(m.get("train/env_steps", 0) for m in metrics) == 3 * 4 * 32  # one rollout of 4 x 32 per update
    _episode_returns_are_the_task_s(_eval_json(run))

    monkeypatch.setitem(sys.modules, "popgym", None)  # the same run evaluated where popgym is not installed
    r = runner.invoke(app, ["eval", str(run), "--episodes", "2", "--envs", "2", "--json"])
    assert_clean_exit(r, 2)
    assert r.stderr.startswith(f"error: {TASK} is a POPGym task and popgym is not installed: {POPGYM_INSTALL} ("), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def _popgym_h5(path: Path, episodes: int = 3) -> Path:
    """Random-action episodes of :data:`TASK` in the D4RL layout, observations one-hot as the agents see them."""
    env = make_task(TASK)
    rng = np.random.default_rng(0)
    data = {k: [] for k in ("observations", "actions", "rewards", "terminals", "timeouts")}
    for ep in range(episodes):
        obs, _ = env.reset(seed=ep)
        done = False
        while not done:
            a = int(rng.integers(4))
            nxt, rew, term, trunc, _ = env.step(a)
            for k, v in zip(data, (obs, a, rew, term, trunc)):
                data[k].append(v)
            obs, done = nxt, term or trunc
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f.create_dataset(k, data=np.asarray(v, np.float32 if k in ("observations", "rewards") else None))
        f.attrs["env_id"] = TASK
    return path


@pytest.mark.parametrize("objective", ["bc", "iql"])
def test_offline_gtrxl_on_popgym_data_evaluates_on_the_popgym_task(tmp_path: Path, objective: str) -> None:
    pytest.importorskip("popgym")
    h5 = _popgym_h5(tmp_path / "repeat_previous.hdf5")
    run = tmp_path / objective
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", f"dataset.path={h5}", "dataset.build=null",
                            f"agent.env_id={TASK}", f"agent.objective={objective}", "agent.seq_len=4", "agent.burn_in=2",
                            "train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.checkpoint_every=2",
                            "eval.every=0", "eval.episodes=2", "eval.n_envs=2", "train.progress=false", *TINY_BACKBONE,
                            "--device", "cpu", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    _episode_returns_are_the_task_s(_eval_json(run))


def test_a_popgym_id_without_the_extra_is_refused_in_one_line_naming_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "popgym", None)  # `import popgym` raises ImportError
    r = runner.invoke(app, ["train", "-c", "gtrxl/popgym_ppo", *TINY_PPO, "--run-dir", str(tmp_path / "run")])
    assert_clean_exit(r, 2)
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: {TASK} is a POPGym task and popgym is not installed: {POPGYM_INSTALL} ("), r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
