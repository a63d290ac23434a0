"""Defects found by the tester (second pass): sweep reruns, signals and duplicates, the run lock,
eval option checks, DT memory, plot --from-json, dataset.env_id, --targets, config typos, %BC.

Every test is tiny (a few rows of crafted data, a few updates of a toy model) and runs in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_found_by_tester import TINY_DT, _train, _write_h5
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import sweep as sw
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.runlock import hold_run, lock_holder
from rl_tformers.runtime.trainer import RunDirError, resume, train

runner = CliRunner()

TOY = ["agent.kind=toy", "train.steps=4", "train.batch_size=4", "backbone.n_layers=1", "train.log_every=2",
       "train.checkpoint_every=0", "train.warmup_steps=1", "eval.every=0"]


def _train_as_sweep_would(run: sw.SweepRun) -> None:
    """Train ``run`` in this process with exactly the config the sweep would give it."""
    train(compose(None, [*run.overrides, "device=cpu", "train.progress=false"]), run.run_dir)


# ------------------------------------------------------------------- 1, 5: sweep rerun rules
def test_sweep_rerun_with_another_config_is_refused_naming_run_and_keys(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    grid = {"backbone.n_layers": ["1"]}
    run = sw.expand(grid, [0], out, [*TOY, "eval.at_end=false"])[0]
    _train_as_sweep_would(run)
    res = sw.sweep(None, grid, [0], out, [*TOY, "eval.at_end=false"], device="cpu", echo=lambda m: None)
    assert [r["status"] for r in res.rows] == ["skipped"]  # the same config: complete, skipped
    with pytest.raises(sw.SweepError) as info:
        sw.sweep(None, grid, [0], out, [*TOY, "eval.at_end=false", "train.steps=6"], device="cpu",
                 echo=lambda m: None)
    msg = str(info.value)
    assert f"{run.run_dir} holds a complete run with another config" in msg
    assert "train.steps: 4 (stored) -> 6 (requested)" in msg


def test_sweep_resumes_an_unfinished_run_only_with_its_own_config(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    run = sw.expand({}, [0], out, [*TOY, "eval.at_end=false", "train.steps=8"])[0]
    train(compose(None, [*run.overrides, "device=cpu", "train.progress=false"]), run.run_dir, stop_at=4)
    assert sw.run_state(run.run_dir) == "partial"
    with pytest.raises(sw.SweepError, match=r"holds a partial run with another config:\n    train.lr: "):
        sw.sweep(None, {}, [0], out, [*TOY, "eval.at_end=false", "train.steps=8", "train.lr=0.01"], device="cpu",
                 echo=lambda m: None)
    assert sw.train_command(run, None, "partial", "cpu")[4:] == [
        "--resume", str(run.run_dir), "device=cpu", "train.progress=false"]


def test_sweep_run_without_its_final_evaluation_is_not_complete(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.runtime import toy

    out = tmp_path / "sweep"
    run = sw.expand({}, [0], out, [*TOY, "eval.at_end=true"])[0]

    def boom(self, step):
        raise RuntimeError("evaluation environment broke")

    monkeypatch.setattr(toy.ToyAgent, "evaluate", boom)
    with pytest.raises(RuntimeError, match="evaluation environment broke"):
        _train_as_sweep_would(run)
    assert sw.run_state(run.run_dir) == "unevaluated"
    lines: list[str] = []
    res = sw.sweep(None, {}, [0], out, [*TOY, "eval.at_end=true"], device="cpu", echo=lines.append)
    assert [r["status"] for r in res.rows] == ["incomplete"]
    assert any(ln.startswith("incomplete base/seed0") and "has no final evaluation" in ln for ln in lines)
    assert not any("skipped" in ln for ln in lines)
    assert any("no run logged an evaluation metric" in ln for ln in lines)


# ------------------------------------------------------------------- 8, 11 and grid validation
def test_sweep_refuses_grid_values_that_share_a_run_directory(tmp_path: Path) -> None:
    with pytest.raises(sw.SweepError, match="map to the same run directory 'betas=_0.9_0.95' \\(a duplicate value"):
        sw.expand(sw.parse_grid(["train.betas=[0.9,0.95],[0.9, 0.95]"]), [0], tmp_path)
    with pytest.raises(sw.SweepError, match="value '1e-3' is given twice"):
        sw.parse_grid(["train.lr=1e-3,1e-3"])


def test_sweep_checks_every_grid_point_before_starting(tmp_path: Path) -> None:
    with pytest.raises(sw.SweepError, match=r"n_layrs=1/seed0 .*did you mean backbone.n_layers"):
        sw.sweep(None, {"backbone.n_layrs": ["1"]}, [0], tmp_path / "s", TOY, echo=lambda m: None)
    assert not (tmp_path / "s").exists()


def test_sweep_results_metric_warnings_and_stale_plot(tmp_path: Path) -> None:
    runs = sw.expand({"train.lr": ["1e-3", "3e-3"]}, [0], tmp_path)
    for i, run in enumerate(runs):
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "metrics.jsonl").write_text(json.dumps({"step": 4, "train/loss": 1.0 + i}) + "\n")
    outcomes = {r.name: sw.RunOutcome("ok", 0) for r in runs}
    warned: list[str] = []
    res = sw.write_results(tmp_path, runs, outcomes, warn=warned.append)
    assert res.metric == "train/loss" and (tmp_path / "results.png").is_file()
    assert warned == ["warning: no run logged an evaluation metric (eval.at_end=false, eval.every=0, or the "
                      "evaluations failed); the summary and plot use train/loss"]
    header = next(ln for ln in (tmp_path / "results.md").read_text().splitlines() if ln.startswith("| run |"))
    assert header == "| run | seed | status | step | seconds | train/loss |"
    warned.clear()
    res = sw.write_results(tmp_path, runs, outcomes, metric="eval/nonexistent", warn=warned.append)
    assert warned == ["warning: --metric eval/nonexistent: no run logged it (logged: train/loss); "
                      "no summary values and no plot"]
    assert not (tmp_path / "results.png").exists()
    assert str(tmp_path / "results.png") not in res.files


# ------------------------------------------------------------------- 2: signals reach the runs
_CHILD = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def handler(signum, frame):
    out.write_text(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, handler)
signal.signal(signal.SIGINT, handler)
pathlib.Path(sys.argv[2]).write_text("ready")
time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sweep_forwards_sigterm_and_sighup_to_its_runs(tmp_path: Path, sig: int) -> None:
    runs = sw.expand({"train.lr": ["1", "2"]}, [0], tmp_path)
    cmds = [(r, [sys.executable, "-c", _CHILD, str(tmp_path / f"got{i}"), str(tmp_path / f"ready{i}")])
            for i, r in enumerate(runs)]

    def kill_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), sig)

    killer = threading.Thread(target=kill_when_ready)
    killer.start()
    outcomes = sw.run_local(cmds, jobs=1, threads=1, log_dir=tmp_path / "logs", echo=lambda m: None)
    killer.join()
    assert sw.stop_signal() == sig
    assert (tmp_path / "got0").read_text() == str(int(signal.SIGTERM))  # SIGHUP arrives as SIGTERM
    assert outcomes[runs[0].name].status == "stopped" and outcomes[runs[0].name].returncode == 143
    assert outcomes[runs[1].name].status == "not run" and not (tmp_path / "ready1").exists()
    assert signal.getsignal(sig) is not None and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


# ------------------------------------------------------------------- 3: one trainer per run directory
def test_a_run_directory_being_trained_is_refused(tmp_path: Path) -> None:
    cfg = compose(None, [*TOY, "eval.at_end=false", "device=cpu", "train.progress=false"])
    train(cfg, tmp_path / "run", stop_at=2)
    with hold_run(tmp_path / "run"):
        assert lock_holder(tmp_path / "run") == os.getpid()
        with pytest.raises(RunDirError, match=f"run is being trained by pid {os.getpid()}"):
            resume(tmp_path / "run")
        with pytest.raises(RunDirError, match=f"run is being trained by pid {os.getpid()}"):
            train(cfg, tmp_path / "run")
        r = runner.invoke(app, ["train", "--resume", str(tmp_path / "run")])
        assert r.exit_code == 2 and f"is being trained by pid {os.getpid()}" in r.output
    assert lock_holder(tmp_path / "run") is None
    assert resume(tmp_path / "run").complete


def test_the_run_lock_is_released_when_its_process_dies(tmp_path: Path) -> None:
    code = ("import sys, time; from rl_tformers.runtime.runlock import hold_run\n"
            "with hold_run(sys.argv[1]):\n    print('locked', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        assert lock_holder(tmp_path / "run") == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert lock_holder(tmp_path / "run") is None
    with hold_run(tmp_path / "run"):
        pass


def test_a_refused_run_leaves_no_directory_behind(tmp_path: Path) -> None:
    r = _train(f"dataset.path={tmp_path / 'nope.hdf5'}", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2 and not (tmp_path / "run").exists()


# ------------------------------------------------------------------- 4: eval options checked up front
@pytest.mark.parametrize("key", ["eval.episodes", "eval.n_envs"])
def test_eval_counts_must_be_positive(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{key} must be >= 1, got 0$"):
        compose(None, ["agent.kind=toy", f"{key}=0"])
    h5 = _write_h5(tmp_path / "ok.hdf5")
    r = _train(f"dataset.path={h5}", f"{key}=-1", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2 and f"error: {key} must be >= 1, got -1" in r.output
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------- 6: DT and backbone memory
@pytest.mark.parametrize("kind", ["xl", "compressive", "knn"])
def test_dt_refuses_a_backbone_memory_it_would_ignore(tmp_path: Path, kind: str) -> None:
    h5 = _write_h5(tmp_path / "ok.hdf5")
    r = _train(f"dataset.path={h5}", f"backbone.memory.kind={kind}", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2, r.output
    assert f"backbone.memory.kind={kind!r}: the Decision Transformer" in r.output
    assert "agent.kind=gtrxl" in r.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------- 7: plot --from-json
@pytest.mark.parametrize("content, expected", [
    (None, "cannot read it"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "got list"),
    ('{"results": [{"returns": [1.0]}]}', "results[0] is not a per-target result"),
])
def test_plot_from_json_errors_name_the_file(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "eval.json"
    if content is not None:
        path.write_text(content)
    r = runner.invoke(app, ["plot", str(tmp_path / "no_run"), "--out", str(tmp_path / "p.png"),
                            "--from-json", str(path)])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and f"error: --from-json {path}: {expected}" in r.output


# ------------------------------------------------------------------- 9: dataset.env_id
def test_hdf5_without_a_task_name_says_how_to_set_it(tmp_path: Path) -> None:
    from rl_tformers.agents.common.offline import load_offline_dataset

    h5 = _write_h5(tmp_path / "data.hdf5", obs_dim=3, env_id=None, discrete=False)
    r = _train(f"dataset.path={h5}", "--run-dir", str(tmp_path / "run"))
    assert r.exit_code == 2
    assert "continuous actions need a bounded Box action space" in r.output
    assert "guessed from the file name" in r.output and "dataset.env_id=" in r.output and "env_id attribute" in r.output
    ds = load_offline_dataset({"path": str(h5), "env_id": "Pendulum-v1"})
    assert ds.metadata.env_id == "Pendulum-v1" and ds.action_space.high.tolist() == [2.0]
    with pytest.raises(ValueError, match="dataset.env_id='Pendulum-v1' applies to HDF5 files only"):
        load_offline_dataset({"path": "rlt/pendulum-v1/x-v0", "env_id": "Pendulum-v1"})
    assert compose("dt/cartpole_demo", ["dataset.env_id=Pendulum-v1"]).dataset.env_id == "Pendulum-v1"


# ------------------------------------------------------------------- 10: --targets ""
@pytest.mark.parametrize("text", ["", " "])
def test_empty_targets_are_refused(text: str) -> None:
    from rl_tformers.runtime.evaluation import parse_targets

    with pytest.raises(ValueError, match=r"^--targets: '.*' is empty"):
        parse_targets(text)


# ------------------------------------------------------------------- 12: typos get a suggestion
@pytest.mark.parametrize("override, expected", [
    ("backbone.attention.knd=sdpa", "backbone.attention.knd: unknown key: attention kind 'sdpa' (the default: "
                                    "backbone.attention.kind is not set) has no field 'knd'; did you mean "
                                    "backbone.attention.kind?"),
    ("backbone.attention.window=4", "backbone.attention.window: unknown key: attention kind 'sdpa' (the default: "
                                    "backbone.attention.kind is not set) has no field 'window'; set "
                                    "backbone.attention.kind to a kind that has it"),
    ("backbone.dmodel=32", "backbone.dmodel: unknown backbone field; did you mean backbone.d_model?"),
])
def test_backbone_typos_name_the_key_and_suggest(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose(None, ["agent.kind=toy", override])
    assert str(info.value).startswith(expected)


# ------------------------------------------------------------------- 13: %BC fraction
def test_bc_top_fraction_out_of_range_names_the_key(tmp_path: Path) -> None:
    h5 = _write_h5(tmp_path / "ok.hdf5")
    r = runner.invoke(app, ["train", "agent.kind=bc", f"dataset.path={h5}", "agent.top_fraction=0",
                            *[a for a in TINY_DT if not a.startswith(("backbone.", "agent."))],
                            "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2
    assert "error: agent.top_fraction must be in (0, 1] (0.1 = %BC, 1 = BC), got 0" in r.output


def test_short_run_warns_that_warmup_never_ends_and_pctbc_says_what_it_kept(tmp_path, caplog):
    """Fresh-user pass: a 300-step run of a 10k-warmup config learned nothing without saying why;
    %BC did not say which episodes it kept."""
    import logging

    import numpy as np
    from rl_tformers.agents.common.scripted import collect_delayed_expert
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    ds = collect_delayed_expert(20, seed=0, n_envs=10)
    path = save_d4rl_hdf5(ds, tmp_path / "cp.hdf5")
    ret = np.sort(ds.episode_returns)[::-1]
    common = [f"dataset.path={path}", "train.steps=3", "train.batch_size=4", "train.progress=false",
              "eval.every=0", "eval.at_end=false", "device=cpu", "agent.kind=bc", "agent.top_fraction=0.1"]
    lg = logging.getLogger("rl_tformers")  # the CLI sets propagate=False: listen on it directly
    level = lg.level
    lg.addHandler(caplog.handler)
    lg.setLevel(logging.INFO)
    try:
        train(compose(None, [*common, "train.warmup_steps=10", "train.schedule=linear_warmup"]), tmp_path / "a")
        text = caplog.text
        caplog.clear()
        train(compose(None, [*common, "train.warmup_steps=2"]), tmp_path / "b")
    finally:
        lg.removeHandler(caplog.handler)
        lg.setLevel(level)
    assert "train.warmup_steps=10 >= train.steps=3: the learning rate stays in its linear warmup" in text
    assert "agent.top_fraction=0.1: training on 2 of 20 episodes" in text and f"returns >= {ret[1]:.1f}" in text
    assert "warmup" not in caplog.text
