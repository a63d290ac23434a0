"""Defects found by the third fresh-user pass: where collect finds the policies, collecting a
recipe suite with some datasets already built, and the benches' quiet profiler.

Every test is tiny and runs in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rl_tformers.envs.recipes import policies_dir
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()


# ------------------------------------------------------------------- 1: RL_TFORMERS_SHARED
def test_policies_are_found_through_rl_tformers_shared(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "shared" / "policies").mkdir(parents=True)
    monkeypatch.delenv("RL_TFORMERS_POLICIES", raising=False)
    monkeypatch.setenv("RL_TFORMERS_SHARED", str(tmp_path / "shared"))
    assert policies_dir() == tmp_path / "shared" / "policies"
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "elsewhere"))  # the more specific one wins
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        policies_dir()


def test_policies_not_found_lists_each_place_once(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RL_TFORMERS_POLICIES", raising=False)
    monkeypatch.delenv("RL_TFORMERS_SHARED", raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        policies_dir()
    except FileNotFoundError as exc:
        listed = str(exc).split("looked in ", 1)[1].split(")", 1)[0].split(", ")
        assert len(listed) == len(set(listed))
        assert "RL_TFORMERS_SHARED" in str(exc)
    # (when the repository sits next to a shared/ folder, the policies are found: nothing to check)


# ------------------------------------------------------------------- 2: suites with existing datasets
def _fake_existing(root: Path, dataset_id: str) -> Path:
    d = root / dataset_id
    d.mkdir(parents=True)
    (d / "keep.txt").write_text("not touched")
    return d


def test_recipe_suite_with_an_existing_dataset_stops_before_building_anything(tmp_path: Path) -> None:
    _fake_existing(tmp_path, "rlt/hopper-v5/medium-v0")
    r = runner.invoke(app, ["collect", "--recipe", "hopper-random", "--recipe", "hopper-medium", "--root",
                            str(tmp_path), "--recipe-steps", "100", "--no-progress"])
    assert r.exit_code == 1
    assert "rlt/hopper-v5/medium-v0" in r.output and "--skip-existing" in r.output and "--overwrite" in r.output
    assert "nothing was built" in r.output
    assert not (tmp_path / "rlt/hopper-v5/random-v0").exists()


def test_skip_existing_builds_only_the_missing_recipes(tmp_path: Path) -> None:
    kept = _fake_existing(tmp_path, "rlt/hopper-v5/medium-v0")
    r = runner.invoke(app, ["collect", "--recipe", "hopper-random", "--recipe", "hopper-medium", "--root",
                            str(tmp_path), "--recipe-steps", "100", "--no-progress", "--json", "--skip-existing"])
    assert r.exit_code == 0, r.output
    lines = [json.loads(x) for x in r.stdout.strip().splitlines() if x.startswith("{")]
    by_id = {x["dataset_id"]: x for x in lines}
    assert by_id["rlt/hopper-v5/medium-v0"]["skipped"] == "exists"
    assert by_id["rlt/hopper-v5/random-v0"]["steps"] >= 100
    assert (kept / "keep.txt").read_text() == "not touched"


@pytest.mark.parametrize("args, msg", [
    (["--recipe", "hopper-random", "--overwrite", "--skip-existing"], "exclude each other"),
    (["--env", "Hopper-v5", "--steps", "10", "--skip-existing"], "--recipe only"),
])
def test_skip_existing_misuse(tmp_path: Path, args, msg) -> None:
    r = runner.invoke(app, ["collect", *args, "--root", str(tmp_path), "--no-progress"])
    assert r.exit_code == 1 and msg in r.output


# ------------------------------------------------------------------- 5: a missing scripted-task file
def test_missing_memory_task_file_names_the_command_that_builds_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # no data/ here
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", "train.steps=2"])
    assert r.exit_code != 0
    assert "python -m rl_tformers.envs.memory_tasks recall --delay 8 --episodes 2000 --out data/memory/recall-d8.hdf5" \
        in r.output
    assert not (tmp_path / "runs").exists()  # no run directory (nor its runs/ parent) left behind
    # another file on the command line does not get recall-d8's recipe
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", "dataset.path=other.hdf5", "train.steps=2"])
    assert r.exit_code != 0 and "other.hdf5" in r.output and "memory_tasks" not in r.output


def test_every_config_with_a_data_memory_file_says_how_to_build_it() -> None:
    import re

    from rl_tformers.runtime.run_config import available_configs, compose

    checked = 0
    for name in available_configs():
        cfg = compose(name, [])
        path = str(cfg.get("dataset", {}).get("path") or "")
        if path.startswith("data/memory/"):
            build = str(cfg.dataset.get("build") or "")
            assert re.search(rf"--out {re.escape(path)}$", build), (name, build)
            checked += 1
    assert checked >= 9


def _tiny_cartpole_run(tmp_path: Path, *overrides: str):
    """Train a tiny DT on a crafted CartPole file into ``tmp_path/run``; returns (run, CLI output)."""
    from test_found_by_tester import _write_h5

    h5 = _write_h5(tmp_path / "cp.hdf5")
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "train.batch_size=4",
                            "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4", "eval.every=0",
                            "train.progress=false", *overrides, "--device", "cpu", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    return run, r.output


# ------------------------------------------------------------------- 3: final evaluation vs `eval`
def test_the_printed_eval_command_repeats_the_final_evaluation_exactly(tmp_path: Path) -> None:
    import re

    run, output = _tiny_cartpole_run(tmp_path, "train.steps=3", "agent.targets=[20]", "eval.at_end=true",
                                     "eval.episodes=3", "eval.n_envs=2")
    m = re.search(r"repeat it exactly: rl-tformers eval (\S+) --seed (\d+) --episodes 3 --envs 2;", output)
    assert m and Path(m.group(1)) == run, output
    final = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    final = [x for x in final if "eval/return_mean" in x][-1]
    e = runner.invoke(app, ["eval", str(run), "--seed", m.group(2), "--episodes", "3", "--envs", "2", "--json"])
    assert e.exit_code == 0, e.output
    res = json.loads(e.stdout[e.stdout.index("{"):])["results"]
    assert [x["target_return"] for x in res] == [20]
    assert res[0]["return_mean"] == pytest.approx(final["eval/return_mean"], abs=1e-9)


# ------------------------------------------------------------------- 4: -h like every rl-tformers command
def test_rtg_probe_has_the_short_help_option() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rl_tformers.agents.decision_transformer.rtg_probe", "-h"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--group" in r.stdout


# ------------------------------------------------------------------- 10: our warnings as one line
def test_package_warnings_print_as_one_line_without_source(tmp_path: Path) -> None:
    import subprocess
    import sys

    run, _ = _tiny_cartpole_run(tmp_path, "train.steps=2", "eval.at_end=false", "train.checkpoint_every=1")
    newest = sorted((run / "checkpoints").glob("step_*.pt"))[-1]
    data = bytearray(newest.read_bytes())
    data[200:204] = b"\x00\x01\x02\x03"
    newest.write_bytes(bytes(data))
    cli = Path(sys.executable).parent / "rl-tformers"
    e = subprocess.run([str(cli), "eval", str(run), "--episodes", "1", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert e.returncode == 0, e.stderr
    lines = [x for x in e.stderr.splitlines() if "skipping unusable checkpoint" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: skipping unusable checkpoint"), e.stderr
    assert "UserWarning" not in e.stderr and "find_latest_valid" not in e.stderr


# ------------------------------------------------------------------- huge agent.targets: before training
def test_agent_targets_beyond_the_return_embedding_are_refused_before_training(tmp_path: Path) -> None:
    from test_found_by_tester import _write_h5

    h5 = _write_h5(tmp_path / "cp.hdf5")
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "train.steps=3",
                            "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4",
                            "agent.targets=[20,1e30]", "eval.every=0", "eval.at_end=true", "train.progress=false",
                            "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "agent.targets: 1e+30 is beyond what this model takes" in r.output
    assert not list((tmp_path / "run").glob("checkpoints/*.pt"))
