"""GTrXL on POPGym's tasks: PPO (configs/gtrxl/popgym_ppo.yaml), BC and IQL evaluated on a POPGym id,
`rl-tformers eval` of the runs, and the refusal without the popgym extra."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import typer
from rl_tformers.agents.gtrxl.recurrent_peer import PeerPlan
from rl_tformers.agents.gtrxl.recurrent_peer import main as peer_main
from rl_tformers.envs.environments import POPGYM_INSTALL, make_task
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from tests.runs import assert_clean_exit

runner = CliRunner()

TASK = "popgym-RepeatPreviousEasy-v0"  # Discrete(4) observations (one-hot: 4 inputs), Discrete(4) actions, 51 steps
TINY_BACKBONE = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=8"]
TINY_PPO = ["agent.n_envs=4", "agent.n_steps=32", "agent.n_epochs=1", "agent.n_minibatches=1", "train.steps=3",
            "train.checkpoint_every=3", "eval.every=0", "eval.episodes=2", "eval.n_envs=2", "train.progress=false",
            *TINY_BACKBONE, "--device", "cpu"]


#: the keys of `rl-tformers eval --json` (and of the recurrent peer's eval.json), and of each target's result
REPORT_KEYS = {"env_id", "episodes", "n_envs", "seed", "seconds", "extra", "results"}
RESULT_KEYS = {"target_return", "returns", "return_mean", "return_std", "normalized_score", "normalized_score_std",
               "lengths", "seeds"}


def _eval_json(run: Path) -> dict:
    r = runner.invoke(app, ["eval", str(run), "--episodes", "2", "--envs", "2", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert set(report) == REPORT_KEYS and set(report["results"][0]) == RESULT_KEYS
    return report


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


# ------------------------------------------------- the recurrent peer (sb3-contrib RecurrentPPO)
peer_app = typer.Typer()
peer_app.command()(peer_main)


def test_the_recurrent_peer_takes_the_task_budget_and_ppo_settings_of_the_gtrxl_config() -> None:
    plan = PeerPlan.from_config(compose("gtrxl/popgym_ppo"))
    assert (plan.env_id, plan.n_envs, plan.rollouts, plan.env_steps) == (TASK, 16, 488, 999_424)  # 7808 updates / 16
    assert plan.algo == {"n_steps": 128, "batch_size": 512, "n_epochs": 4, "gamma": 0.99, "gae_lambda": 0.95,
                         "clip_range": 0.2, "ent_coef": 0.01, "vf_coef": 0.5, "normalize_advantage": True,
                         "learning_rate": 3.0e-4, "max_grad_norm": 0.5}
    assert (plan.obs_norm, plan.deterministic, plan.eval_every, plan.eval_episodes) == (False, True, 976, 20)
    assert PeerPlan.from_config(compose("gtrxl/popgym_ppo", ["train.steps=17"])).rollouts == 2  # rounded up


@pytest.mark.parametrize(("every", "evaluated"), [(32, list(range(32, 993, 32))), (244, [256, 496, 736, 976]),
                                                  (48, list(range(48, 993, 48)))])
def test_the_recurrent_peer_evaluates_after_each_rollout_that_reaches_a_multiple_of_eval_every(
        tmp_path: Path, every: int, evaluated: list[int]) -> None:
    """16 updates per rollout: eval.every=244 (inside a rollout) evaluates at the end of the rollouts
    that reach 244, 488, 732 and 976 updates, as PPO-GTrXL's evaluations see the same rollouts."""
    from rl_tformers.agents.gtrxl.recurrent_peer import _Curve

    plan = PeerPlan.from_config(compose("gtrxl/popgym_ppo", [f"eval.every={every}"]))
    curve = _Curve(plan, tmp_path / "metrics.jsonl")
    seen: list[int] = []
    curve.log_eval = seen.append
    for _ in range(1 + 1000 // 16):  # rollouts collected until 992 updates are learnt
        curve._on_rollout_end()
    assert seen == evaluated


def test_the_recurrent_peer_trains_logs_and_writes_the_eval_json_of_rl_tformers_eval(tmp_path: Path) -> None:
    pytest.importorskip("popgym")
    run = tmp_path / "lstm"
    r = runner.invoke(peer_app, ["-c", "gtrxl/popgym_ppo", f"run_dir={run}", "agent.n_envs=4", "agent.n_steps=32",
                                 "agent.n_epochs=1", "agent.n_minibatches=1", "agent.obs_norm=true", "train.steps=2",
                                 "eval.every=1", "eval.episodes=2", "eval.n_envs=2", "--lstm-hidden", "16"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(x["step"], x["train/env_steps"]) for x in lines] == [(1, 128.0), (2, 256.0)]
    assert all("eval/return_mean" in x and "train/episodic_return" in x for x in lines)
    report = json.loads((run / "eval.json").read_text())
    assert report == json.loads(r.stdout)
    assert set(report) == REPORT_KEYS and set(report["results"][0]) == RESULT_KEYS
    assert {k: report["extra"][k] for k in ("kind", "step", "env_steps")} == {
        "kind": "sb3_recurrent_ppo", "step": 2, "env_steps": 256}
    assert report["results"][0]["seeds"] == [0, 1]
    _episode_returns_are_the_task_s(report)
    norm = np.load(run / "obs_norm.npz")
    assert norm["mean"].shape == (4,) and float(norm["clip_obs"]) == 10.0 and (run / "model.zip").is_file()

    r = runner.invoke(peer_app, ["-c", "gtrxl/popgym_ppo", f"run_dir={run}"])  # never over a trained peer
    assert_clean_exit(r, 2)
    assert r.stderr == f"error: run_dir={run} already holds a trained peer (model.zip); name another run_dir\n"


def test_the_recurrent_peer_refuses_a_config_of_another_agent(tmp_path: Path) -> None:
    r = runner.invoke(peer_app, ["-c", "gtrxl/recall_bc", f"run_dir={tmp_path / 'x'}"])
    assert_clean_exit(r, 2)
    assert r.stderr == ("error: agent.kind=gtrxl: the recurrent peer reads a gtrxl_ppo config "
                        "(e.g. -c gtrxl/popgym_ppo)\n")
    assert not (tmp_path / "x").exists()
