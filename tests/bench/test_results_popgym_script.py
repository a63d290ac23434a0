"""scripts/results_popgym.sh end to end on a short budget (PPO-GTrXL and RecurrentPPO on one POPGym
task: train -> eval -> JSON -> table row), its resumption, and scripts/popgym_table.py's MMER."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import script_module

REPO = Path(__file__).resolve().parents[2]
TASK = "RepeatPreviousEasy"


def _table_module():
    return script_module("popgym_table")


def _run(tmp_path: Path, config: dict, evals: list[tuple[int, float]], final: float, repeat: int = 0) -> Path:
    """A finished run folder: config.yaml, metrics.jsonl with ``evals`` (the steps from ``repeat``
    on logged twice, as a resumed run does) and eval.json with return ``final``."""
    tmp_path.mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(json.dumps(config))
    lines = [{"step": s, "eval/return_mean": r} for s, r in evals]
    lines += [{"step": s, "eval/return_mean": r} for s, r in evals[repeat:]] if repeat else []
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "eval.json").write_text(json.dumps({"results": [{"return_mean": final, "return_std": 0.0,
                                                                 "returns": [final, final]}]}))
    return tmp_path


def test_mmer_is_the_mean_over_runs_of_each_eval_curve_s_maximum_and_env_steps_follow_the_rollouts(
        tmp_path: Path) -> None:
    t = _table_module()
    config = {"agent": {"n_envs": 16, "n_steps": 128, "n_epochs": 4, "n_minibatches": 4}, "train": {"steps": 48}}
    _run(tmp_path / "lstm-X" / "seed0", config, [(16, -0.5), (32, 0.25), (48, 0.0)], 0.125, repeat=1)
    _run(tmp_path / "lstm-X" / "seed1", config, [(16, 0.5), (32, -0.25), (48, 0.75)], 0.5)
    (tmp_path / "lstm-X" / "seed1" / "wall_seconds").write_text("120")
    runs = t.agent_runs(tmp_path / "lstm-X", peer=True)
    assert [r["curve"] for r in runs] == [{"env_steps": [2048, 4096, 6144], "return_mean": [-0.5, 0.25, 0.0]},
                                          {"env_steps": [2048, 4096, 6144], "return_mean": [0.5, -0.25, 0.75]}]
    assert [r["env_steps"] for r in runs] == [6144, 6144] and [r["wall_s"] for r in runs] == [None, 120.0]
    assert t.summary(runs) == {"n": 2, "mmer": 0.5, "mmer_std": 0.25, "final_mean": 0.3125, "final_std": 0.1875,
                               "wall_s_mean": 120.0}
    assert t.env_steps_of(config, 17) == 4096  # update 17 learns from the second rollout
    assert t.table_row("X", "RecurrentPPO", t.summary(runs), 6144) == \
        "| X | RecurrentPPO | 6,144 | 2 | 0.500 +- 0.250 | 0.312 +- 0.188 | 2.0 min |"


def test_the_table_refuses_a_task_without_finished_runs(tmp_path: Path, capsys) -> None:
    t = _table_module()
    assert t.main(["CountRecallEasy", "--out-root", str(tmp_path), "--doc", str(tmp_path / "doc")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path}: no finished run of CountRecallEasy") and err.count("\n") == 1
    assert not (tmp_path / "doc").exists()


def test_the_backbone_table_gives_each_variant_its_score_training_rate_and_act_latency(tmp_path: Path) -> None:
    """``--variants xl,window``: xl reads gtrxl-<task>/base, window gtrxl-window-<task>/base; the
    rate is the env steps between the first and last logged update over the seconds between
    them (a resumed run's repeated step counted once), act() ms the in-package rows of act.json."""
    t = _table_module()
    config = {"agent": {"n_envs": 16, "n_steps": 128, "n_epochs": 4, "n_minibatches": 4}, "train": {"steps": 32}}
    for folder, secs in ((f"gtrxl-{TASK}", 4.0), (f"gtrxl-window-{TASK}", 8.0)):  # xl, window
        run = _run(tmp_path / folder / "base" / "seed0", config, [(16, -0.5), (32, 0.5)], 0.25)
        logged = [{"step": 16, "time": 100.0, "train/env_steps": 2048.0},
                  {"step": 32, "time": 100.0 + 2 * secs, "train/env_steps": 5000.0},  # (cut, resumed:)
                  {"step": 32, "time": 100.0 + secs, "train/env_steps": 4096.0}]
        with (run / "metrics.jsonl").open("a") as f:
            f.writelines(json.dumps(m) + "\n" for m in logged)
        (run / "act.json").write_text(json.dumps({"rows": [
            {"batch": 1, "path": "in-package", "ms_per_step": secs / 4},
            {"batch": 1, "path": "onnx", "ms_per_step": 0.1},
            {"batch": 16, "path": "in-package", "ms_per_step": secs / 2}]}))
    timing = tmp_path / f"gtrxl-{TASK}" / "timing"  # xl's short run, back to back with the others': it counts
    timing.mkdir()
    (timing / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [
        {"step": 16, "time": 10.0, "train/env_steps": 2048.0}, {"step": 48, "time": 12.0, "train/env_steps": 6144.0}]))
    doc = tmp_path / "doc"
    assert t.main([TASK, "--out-root", str(tmp_path), "--doc", str(doc), "--variants", "xl,window,performer"]) == 0
    assert (doc / "backbones.md").read_text().splitlines()[2:] == [
        f"| {TASK} | window | 4,096 | 1 | 0.500 +- 0.000 | 0.250 +- 0.000 | 256 | 2.00 | 4.00 | - |",
        f"| {TASK} | xl | 4,096 | 1 | 0.500 +- 0.000 | 0.250 +- 0.000 | 2048 | 1.00 | 2.00 | - |"]
    saved = json.loads((doc / f"backbones-{TASK}.json").read_text())
    assert set(saved["variants"]) == {"xl", "window"} and saved["variants"]["xl"]["act_ms"] == {"1": 1.0, "16": 2.0}


@pytest.mark.slow
def test_one_short_popgym_row_trains_evaluates_and_tabulates_both_agents_and_resumes(tmp_path: Path) -> None:
    """RepeatPreviousEasy, seed 0, 2 rollouts of 16 x 128 (4,096 environment steps) per agent,
    evaluated after each rollout: both agents' JSON, figure and table rows. Run again, the
    finished runs are skipped with the same numbers; a peer run cut before its eval.json is
    trained again from zero, its metrics.jsonl holding one run's evaluations only."""
    pytest.importorskip("popgym")
    doc, out = tmp_path / "doc", tmp_path / "runs"
    env = {**os.environ, "OUT": str(out), "DOC": str(doc), "SEEDS": "0", "EPISODES": "2",
           "RLT": str(Path(sys.executable).parent / "rl-tformers"), "PY": sys.executable,
           "BUDGET": "train.steps=32 eval.every=16 eval.n_envs=2 train.checkpoint_every=16",
           "EXTRA": "backbone.d_model=32"}

    def run_script() -> dict:
        p = subprocess.run(["bash", str(REPO / "scripts/results_popgym.sh"), TASK], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads((doc / f"{TASK}.json").read_text())

    first = run_script()
    assert set(first["agents"]) == {"PPO-GTrXL", "RecurrentPPO"}
    for name, agent in first["agents"].items():
        (run,) = agent["runs"]
        assert run["env_steps"] == 4096 and run["curve"]["env_steps"] == [2048, 4096], name
        assert run["max_return"] == max(run["curve"]["return_mean"]) == agent["mmer"], name
        assert run["final_episodes"] == 2 and -1.0 <= run["final_return_mean"] <= 1.0, name
        assert run["wall_s"] > 0, name
    rows = (doc / "table.md").read_text().splitlines()
    assert [r.split(" | ")[:4] for r in rows[2:]] == [["| RepeatPreviousEasy", "PPO-GTrXL", "4,096", "1"],
                                                      ["| RepeatPreviousEasy", "RecurrentPPO", "4,096", "1"]]
    assert (doc / f"{TASK}.png").stat().st_size > 0

    peer = out / f"lstm-{TASK}" / "seed0"
    second = run_script()
    sweep = json.loads((out / f"gtrxl-{TASK}" / "results.json").read_text())
    assert [r["status"] for r in sweep["runs"]] == ["skipped"]
    for name in first["agents"]:
        assert second["agents"][name]["runs"][0]["curve"] == first["agents"][name]["runs"][0]["curve"], name
        assert second["agents"][name]["runs"][0]["wall_s"] == first["agents"][name]["runs"][0]["wall_s"], name

    (peer / "eval.json").unlink()  # cut after training, before its final evaluation
    third = run_script()
    lines = [json.loads(x) for x in (peer / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [16, 32]  # trained again: one run's evaluations, not two
    assert third["agents"]["RecurrentPPO"]["runs"][0]["curve"] == first["agents"]["RecurrentPPO"]["runs"][0]["curve"]


def test_the_backbone_script_refuses_an_unknown_variant_before_any_training(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "runs"), "DOC": str(tmp_path / "doc"), "VARIANTS": "xl,lstm",
           "RLT": "/bin/false", "PY": "/bin/false"}
    p = subprocess.run(["bash", str(REPO / "scripts/results_popgym_backbones.sh"), TASK], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr == "error: VARIANTS: unknown variant 'lstm' (xl, window, compressive, performer, spalm)\n"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "doc").exists()


@pytest.mark.slow
def test_one_short_backbone_comparison_trains_evaluates_times_and_tabulates_each_variant(tmp_path: Path) -> None:
    """RepeatPreviousEasy, seed 0, 2 rollouts per variant (xl and the plain window): eval.json,
    act.json and one backbones.md row each."""
    pytest.importorskip("popgym")
    doc, out = tmp_path / "doc", tmp_path / "runs"
    env = {**os.environ, "OUT": str(out), "DOC": str(doc), "SEEDS": "0", "EPISODES": "2", "VARIANTS": "xl,window",
           "TIMING_STEPS": "32",
           "RLT": str(Path(sys.executable).parent / "rl-tformers"), "PY": sys.executable,
           "BUDGET": "train.steps=32 eval.every=16 eval.n_envs=2 train.checkpoint_every=16",
           "EXTRA": "backbone.d_model=32"}
    p = subprocess.run(["bash", str(REPO / "scripts/results_popgym_backbones.sh"), TASK], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    saved = json.loads((doc / f"backbones-{TASK}.json").read_text())
    assert set(saved["variants"]) == {"xl", "window"}
    for v, res in saved["variants"].items():
        assert res["runs"][0]["curve"]["env_steps"] == [2048, 4096] and res["env_steps_per_s"] > 0, v
        assert set(res["act_ms"]) == {"1", "16"} and res["env_steps_per_s_from"].endswith("/timing"), v
    rows = (doc / "backbones.md").read_text().splitlines()[2:]
    assert [r.split(" | ")[1] for r in rows] == ["window", "xl"]


def test_speed_only_measures_every_variant_back_to_back_without_training(tmp_path: Path) -> None:
    """SPEED_ONLY=1: no sweep and no evaluation; per variant one ``bench act`` of the first seed's
    run and one short ``train`` into timing/, in VARIANTS order; measured ones are kept."""
    calls = tmp_path / "calls"
    rlt = tmp_path / "rlt"
    rlt.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    rlt.chmod(0o755)
    out = tmp_path / "runs"
    (out / f"gtrxl-window-{TASK}" / "base" / "seed0").mkdir(parents=True)
    (out / f"gtrxl-window-{TASK}" / "base" / "seed0" / "act.json").write_text("{}")  # measured: kept
    env = {**os.environ, "OUT": str(out), "DOC": str(tmp_path / "doc"), "SEEDS": "0", "SPEED_ONLY": "1",
           "VARIANTS": "xl,window", "RLT": str(rlt), "PY": "/bin/true"}
    p = subprocess.run(["bash", str(REPO / "scripts/results_popgym_backbones.sh"), TASK], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = calls.read_text().splitlines()
    assert [ln.split(" --")[0].split(" -c")[0] for ln in lines] == ["bench act", "train", "train"]
    assert f"--run {out}/gtrxl-{TASK}/base/seed0 " in lines[0]
    assert f"--run-dir {out}/gtrxl-{TASK}/timing " in lines[1] and "train.steps=64" in lines[1]
    assert f"--run-dir {out}/gtrxl-window-{TASK}/timing " in lines[2] and "agent.window=32" in lines[2]
