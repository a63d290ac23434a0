"""Exact resume, crash recovery, damaged checkpoints and signals (issue 2, "must show")."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import torch
from runtime_helpers import assert_same_weights, model_state, scalar_steps, toy_cfg
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime import toy
from rl_tformers.runtime import trainer as trainer_mod
from rl_tformers.runtime.checkpoint import list_checkpoints, load_checkpoint
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import Trainer, resume, train
from tests.bitwise import same_bits

TRAIN_KEYS = ("train/loss", "train/grad_norm", "train/lr", "train/mae")


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", *TRAIN_KEYS)} for r in rows if "train/loss" in r]


def test_split_run_is_bit_identical(tmp_path: Path) -> None:
    """N updates in one run == N/2 + resume + N/2: identical weights and logged training scalars.

    The split (23) is not a multiple of log_every (5) or checkpoint_every (10), so the partial
    logging window and the RNG state must both come back from the checkpoint; dropout is on.
    """
    cfg = toy_cfg()
    assert cfg.backbone.dropout > 0 and cfg.train.schedule.value == "warmup_cosine"
    full, split = tmp_path / "full", tmp_path / "split"
    r_full = train(cfg, full)
    r_half = train(cfg, split, stop_at=23)
    assert (r_half.step, r_half.complete) == (23, False)
    assert list_checkpoints(split)[0][0] == 23
    r_rest = resume(split)
    assert r_full.step == r_rest.step == 40 and r_rest.complete
    assert_same_weights(model_state(full, 40), model_state(split, 40))
    a, b = load_checkpoint(full / "checkpoints/step_000000040.pt"), load_checkpoint(split / "checkpoints/step_000000040.pt")
    assert a["optimizer"]["state"][0]["exp_avg_sq"].equal(b["optimizer"]["state"][0]["exp_avg_sq"])
    assert a["rng"]["torch"].equal(b["rng"]["torch"])
    assert train_rows(full) == train_rows(split)  # exact floats, every logged step
    assert [r["step"] for r in train_rows(split)] == list(range(5, 41, 5))


def test_resume_without_rng_restore_would_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the test above: dropout makes the RNG state matter, so skipping it changes the weights."""
    cfg = toy_cfg()
    train(cfg, tmp_path / "full")
    train(cfg, tmp_path / "split", stop_at=23)
    monkeypatch.setattr(trainer_mod, "restore_rng_state", lambda state: None)
    resume(tmp_path / "split")
    a, b = model_state(tmp_path / "full", 40), model_state(tmp_path / "split", 40)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_resume_after_crash_never_goes_backwards(run_dir: Path) -> None:
    """A crash after logging up to step 150 with the last checkpoint at 100: resume drops steps > 100."""
    cfg = toy_cfg("train.steps=200", "train.checkpoint_every=100", "train.log_every=10", "eval.every=50",
                  "train.batch_size=2", "agent.seq_len=4")
    train(cfg, run_dir, stop_at=150)
    (run_dir / "checkpoints" / "step_000000150.pt").unlink()  # the crash happened before this save
    before = scalar_steps(run_dir)
    assert max(s for _, s in before) == 150  # the files really hold steps after the checkpoint

    result = resume(run_dir)
    assert result.step == 200
    after = scalar_steps(run_dir)
    steps = [s for _, s in after]
    assert steps == sorted(steps), "a step goes backwards in the event files"
    first_new = next(i for i, (_, s) in enumerate(after) if s > 100)
    assert all(s <= 100 for _, s in after[:first_new])
    assert after[first_new][1] == 110  # the next scalar after resuming from 100
    per_tag: dict[str, list[int]] = {}
    for tag, s in after:
        per_tag.setdefault(tag, []).append(s)
    assert per_tag["train/loss"] == list(range(10, 201, 10))  # each step exactly once
    assert per_tag["eval/mse"] == [50, 100, 150, 200]
    jsonl_steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert jsonl_steps == sorted(jsonl_steps)
    assert [s for s in jsonl_steps if s == 110] == [110]


def test_truncated_latest_checkpoint_falls_back(tmp_path: Path) -> None:
    """A half-truncated latest checkpoint beside a valid older one: warn naming it, resume from the older."""
    cfg = toy_cfg()
    train(cfg, tmp_path / "full")
    run = tmp_path / "run"
    train(cfg, run, stop_at=23)  # checkpoints at 10, 20, 23
    bad = run / "checkpoints" / "step_000000023.pt"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    with pytest.warns(UserWarning, match=r"step_000000023\.pt") as record:
        result = resume(run)
    assert any("skipping unusable checkpoint" in str(w.message) for w in record)
    assert result.step == 40
    assert (run / "checkpoints" / "step_000000023.pt.corrupt").exists()  # kept for inspection
    assert_same_weights(model_state(tmp_path / "full", 40), model_state(run, 40))  # resumed from 20, exactly


def test_sigterm_in_process_saves_at_the_interrupted_step(run_dir: Path) -> None:
    cfg = toy_cfg("train.checkpoint_every=0")
    trainer = Trainer(trainer_mod._with_run_dir(cfg, run_dir), run_dir)
    loss = trainer.agent.loss
    calls = {"n": 0}

    def loss_then_signal(batch):
        calls["n"] += 1
        if calls["n"] == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss(batch)

    trainer.agent.loss = loss_then_signal
    result = trainer.fit()
    assert result.interrupted == signal.SIGTERM and result.step == 7
    assert [s for s, _ in list_checkpoints(run_dir)] == [7]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler removed again
    assert resume(run_dir).step == 40


def test_sigint_subprocess_checkpoint_and_resume(tmp_path: Path) -> None:
    """Ctrl-C on the real command: checkpoint at the interrupted step, exit 130, resume finishes exactly."""
    run = tmp_path / "run"
    common = ["agent.kind=toy", "device=cpu", "train.batch_size=4", "train.log_every=5", "train.schedule=constant",
              "train.checkpoint_every=1000000", "train.progress=false", "eval.at_end=false"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_tformers.cli", "train", *common, "train.steps=1000000", "--run-dir", str(run)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    (step, path), = list_checkpoints(run)
    assert step >= 10 and load_checkpoint(path)["step"] == step
    assert f"stopped at step {step}" in err and "--resume" in err

    result = resume(run, [f"train.steps={step + 12}"])
    assert result.complete and result.step == step + 12
    reference = train(compose(None, [*common, f"train.steps={step + 12}"]), tmp_path / "ref")
    assert reference.step == step + 12
    assert_same_weights(model_state(tmp_path / "ref", step + 12), model_state(run, step + 12))


def test_resume_refuses_trajectory_changes(tmp_path: Path) -> None:
    from rl_tformers.runtime.run_config import ConfigError

    run = tmp_path / "run"
    train(toy_cfg(), run, stop_at=10)
    with pytest.raises(ConfigError, match=r"train\.lr: 0\.003 -> 0\.1"):
        resume(run, ["train.lr=0.1"])
    assert resume(run, ["train.steps=20", "train.log_every=2"]).step == 20


def test_fresh_run_refuses_existing_run_dir(run_dir: Path) -> None:
    train(toy_cfg("train.steps=5"), run_dir)
    with pytest.raises(trainer_mod.RunDirError, match="--resume"):
        train(toy_cfg("train.steps=5"), run_dir)


def test_resume_of_finished_run_is_a_no_op(run_dir: Path) -> None:
    train(toy_cfg("train.steps=10"), run_dir)
    n = len((run_dir / "metrics.jsonl").read_text().splitlines())
    result = resume(run_dir)
    assert result.complete and result.step == 10
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == n


def test_run_dir_with_logs_but_no_checkpoint(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 5, "train/loss": 1.0}\n')
    with pytest.raises(trainer_mod.RunDirError, match="stopped before its first checkpoint"):
        train(toy_cfg(), run_dir)
    from rl_tformers.runtime.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="no checkpoint in"):
        resume(run_dir)


runner = CliRunner()


# ------------------------------------------------------------------- a hand-edited config.yaml
TOY = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=8", "train.batch_size=4",
       "backbone.n_layers=1", "backbone.d_model=16", "train.log_every=2", "train.checkpoint_every=0",
       "train.warmup_steps=1", "eval.every=0", "eval.at_end=false"]


@pytest.fixture
def stopped_run(tmp_path) -> Path:
    run = tmp_path / "run"
    train(compose(None, TOY), run, stop_at=4)
    return run


def _edit(run: Path, old: str, new: str) -> str:
    path = run / "config.yaml"
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    return path.read_text()


def test_resume_refuses_an_edited_config_yaml(stopped_run):
    edited = _edit(stopped_run, "d_model: 16", "d_model: 32")
    with pytest.raises(ConfigError) as info:
        resume(stopped_run, ["train.steps=10"])
    msg = str(info.value)
    assert msg.startswith(f"{stopped_run / 'config.yaml'} differs from the config of checkpoint step_000000004.pt")
    assert "backbone.d_model: 16 (checkpoint) -> 32 (config.yaml); cannot change when resuming: start a new run" in msg
    assert "as KEY=VALUE overrides on the command line" in msg
    assert (stopped_run / "config.yaml").read_text() == edited  # not rewritten
    r = runner.invoke(app, ["train", "--resume", str(stopped_run), "train.steps=10"])
    assert r.exit_code == 2 and r.output.startswith(f"error: {stopped_run / 'config.yaml'} differs"), r.output
    assert sorted(p.name for p in (stopped_run / "checkpoints").glob("*.pt")) == ["step_000000004.pt"]


def test_resume_with_a_resumable_key_edited_in_config_yaml_says_to_pass_it(stopped_run):
    _edit(stopped_run, "steps: 8", "steps: 6")
    with pytest.raises(ConfigError, match=r"train\.steps: 8 \(checkpoint\) -> 6 \(config.yaml\); to resume with "
                                          r"it, pass train\.steps=6 on the command line"):
        resume(stopped_run)
    assert resume(stopped_run, ["train.steps=6"]).step == 6  # the command line decides the keys it sets
    assert "steps: 6" in (stopped_run / "config.yaml").read_text()


def test_resume_without_config_yaml_or_with_an_older_one_still_works(stopped_run, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(stopped_run, other)
    # written before a key existed: the key is absent, and loads with its default (TOY leaves it so)
    line = next(ln for ln in (other / "config.yaml").read_text().splitlines(True) if "keep_last:" in ln)
    _edit(other, line, "")
    assert resume(other).step == 8
    (stopped_run / "config.yaml").unlink()
    assert resume(stopped_run).step == 8
    assert (stopped_run / "config.yaml").is_file()


TINY_DT = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1", "train.batch_size=4",
           "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu"]


def test_plot_from_json_does_not_refuse_the_run_it_evaluated_when_run_from_another_directory(
        tmp_path: Path, cartpole_h5, monkeypatch: pytest.MonkeyPatch) -> None:
    """`eval runs/x --out e.json` records extra.run_dir / extra.checkpoint as typed (relative);
    `plot --from-json` resolves them against *its* working directory. Plotting the very run the
    file evaluated (by absolute path) from a directory that has another ./dt1 is refused with
    "is an evaluation of the run dt1, but RUN_DIR is /.../dt1"."""
    work = tmp_path / "a"
    work.mkdir()
    data = cartpole_h5(tmp_path / "cp.hdf5")
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, "train.steps=1"]), work / "dt1")
    monkeypatch.chdir(work)
    saved = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", "dt1", "--targets", "20", "--episodes", "1", "--envs", "1", "--out", str(saved)])
    assert r.exit_code == 0, r.output
    other = tmp_path / "b"
    other.mkdir()  # another project directory with its own (different) run called dt1
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, "train.steps=1", "seed=7"]), other / "dt1")
    monkeypatch.chdir(other)
    r = runner.invoke(app, ["plot", str(work / "dt1"), "--from-json", str(saved), "--out", str(tmp_path / "f.png"),
                            "--no-tensorboard"])
    assert r.exit_code == 0, r.output  # the file evaluated exactly this run


def test_resume_refuses_another_dataset_that_has_the_same_statistics(tmp_path: Path, cartpole_h5) -> None:
    """dataset.path is resumable because "the offline agents refuse data whose statistics differ
    ... so another dataset cannot slip in this way" (config.RESUMABLE_KEYS). A file with the same
    observations, rewards and episode ends but other actions (other behaviour data) has equal
    statistics and is trained on without a word."""
    data = cartpole_h5(tmp_path / "cp.hdf5")
    other = cartpole_h5(tmp_path / "other.hdf5")
    with h5py.File(other, "r+") as f:
        acts = f["actions"][:]
        f["actions"][...] = 1 - acts  # every action flipped
    run = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, "train.steps=1"]), run)
    with pytest.raises(Exception, match="not the data this run was trained on"):
        resume(run, [f"dataset.path={other}", "train.steps=2"])
    assert not (run / "checkpoints" / "step_000000002.pt").exists()


def test_plot_from_json_with_an_out_of_range_step_is_a_clean_error_not_a_traceback(tmp_path: Path, cartpole_h5) -> None:
    """`_saved_step` takes any int in extra.step (a hand-edited file) and `plot` logs the figure to
    TensorBoard at it: 10**30 crashes in SummaryWriter.add_event with an uncaught
    ``ValueError: Value out of range`` (a negative step is logged and titled "(step -3)")."""
    run = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={cartpole_h5(tmp_path / 'cp.hdf5')}", *TINY_DT, "train.steps=1"]),
          run)
    saved = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", str(run), "--targets", "20", "--episodes", "1", "--envs", "1", "--out", str(saved)])
    assert r.exit_code == 0, r.output
    data = json.loads(saved.read_text())
    data["extra"]["step"] = 10**30
    saved.write_text(json.dumps(data))
    r = runner.invoke(app, ["plot", str(run), "--from-json", str(saved), "--out", str(tmp_path / "f.png")])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)


#: evaluations every 2 updates, checkpoints every 4: step 4 is both, step 6 an evaluation step only
TOY_12_STEPS = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=12", "train.batch_size=4",
       "train.warmup_steps=2", "train.log_every=2", "train.checkpoint_every=4", "train.keep_last=10",
       "backbone.d_model=16", "backbone.n_layers=1", "backbone.dropout=0.1", "eval.every=2", "eval.at_end=true"]


def _rows(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if k not in ("time", "eval/time_s") and not k.startswith("perf/")})
    return out


def _final(run: Path) -> dict:
    state = load_checkpoint(run / "checkpoints" / "step_000000012.pt")
    return {k: state[k] for k in ("model", "optimizer", "rng", "scheduler")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    train(compose(None, TOY_12_STEPS), run)
    return run


@pytest.mark.parametrize("bad_step", [4, 6], ids=["at-a-checkpoint-step", "between-checkpoints"])
def test_a_mid_run_evaluation_that_failed_is_logged_by_the_resume(straight: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  bad_step: int) -> None:
    """An evaluation that raises mid-run saves its step and names `--resume`; the resume runs that
    step's evaluation before training on, so metrics.jsonl has the row an uninterrupted run has
    (and equal weights)."""
    real = toy.ToyAgent.evaluate

    def broken(self, step):
        if step == bad_step:
            raise RuntimeError("evaluation environment broke")
        return real(self, step)

    monkeypatch.setattr(toy.ToyAgent, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation environment broke"):
        train(compose(None, TOY_12_STEPS), tmp_path / "run")
    monkeypatch.setattr(toy.ToyAgent, "evaluate", real)
    result = resume(tmp_path / "run")
    assert result.complete
    assert same_bits(_final(straight), _final(tmp_path / "run"))
    assert any(r["step"] == bad_step and "eval/mse" in r for r in _rows(straight))
    assert _rows(tmp_path / "run") == _rows(straight)


def test_a_mid_run_evaluation_aborted_by_a_second_signal_is_logged_by_the_resume(straight: Path,
                                                                                 tmp_path: Path) -> None:
    """A second Ctrl-C during the evaluation of a checkpoint step (4) aborts it; the resume
    continues from that checkpoint and must run the evaluation it cut short."""
    run = tmp_path / "run"
    trainer = Trainer(compose(None, TOY_12_STEPS), run)
    real = trainer.agent.evaluate

    def evaluate_with_two_ctrl_c(step: int):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises KeyboardInterrupt here
        return real(step)

    trainer.agent.evaluate = evaluate_with_two_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert not any(r["step"] == 4 and "eval/mse" in r for r in _rows(run))
    resume(run)
    assert same_bits(_final(straight), _final(run))
    assert _rows(run) == _rows(straight)


def test_a_run_stopped_at_an_evaluation_step_is_not_evaluated_twice(straight: Path, tmp_path: Path) -> None:
    """Control: --stop-at an evaluation step evaluates before stopping; the resume does not repeat it."""
    run = tmp_path / "run"
    train(compose(None, TOY_12_STEPS), run, stop_at=4)
    resume(run)
    assert _rows(run) == _rows(straight)


TINY_DT_DEFAULT_WARMUP = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1", "train.batch_size=4",
           "train.progress=false", "eval.at_end=false", "device=cpu"]


def test_a_refused_resume_does_not_first_warn_that_the_schedule_is_re_stretched(
        tmp_path: Path, cartpole_h5, caplog: pytest.LogCaptureFixture) -> None:
    """`train --resume RUN train.steps=N` with a warmup_cosine schedule on changed data is refused
    without first warning "train.steps ... re-stretches the warmup_cosine schedule ..." (a warning
    about a run that never continues): the warning follows the data and agent checks."""
    data = cartpole_h5(tmp_path / "cp.hdf5", seed=0)
    cfg = ["train.schedule=warmup_cosine", "train.warmup_steps=1", "train.steps=4", "train.lr=1e-2"]
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT_DEFAULT_WARMUP, *cfg]), tmp_path / "run")
    cartpole_h5(data, seed=1)  # other episodes at the same path
    with caplog.at_level(logging.INFO), pytest.raises(Exception, match="dataset|data"):
        resume(tmp_path / "run", ["train.steps=40"])
    assert not any("re-stretches" in r.getMessage() for r in caplog.records), caplog.text
    cartpole_h5(data, seed=0)  # the data back: the resume goes on and says the schedule jumps
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert resume(tmp_path / "run", ["train.steps=8"]).step == 8
    assert any("re-stretches" in r.getMessage() for r in caplog.records), caplog.text


def test_a_ppo_fine_tuning_run_resumes_without_reading_its_offline_run_again(tmp_path: Path) -> None:
    """`--resume` of a PPO fine-tuning run (agent.init_checkpoint) rebuilds its model from its own
    checkpoint (model config, weights and statistics) and continues exactly as an uninterrupted
    run, without reading the offline run again: retrained with another backbone, or deleted, the
    offline run does not matter."""
    import shutil

    import torch
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    recall_file = save_d4rl_hdf5(scripted_dataset("recall", 30, delay=2, seed=0), tmp_path / "recall-d2.hdf5")

    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]
    offline = ["agent.kind=gtrxl", "agent.seq_len=4", "agent.burn_in=2", f"dataset.path={recall_file}",
               "train.steps=2", "train.batch_size=4", "train.progress=false", "eval.at_end=false", "device=cpu"]
    train(compose(None, [*offline, *tiny]), tmp_path / "offline")
    ppo = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d2-v0",
           f"agent.init_checkpoint={tmp_path / 'offline'}", "agent.n_envs=2", "agent.n_steps=4", "agent.n_epochs=1",
           "agent.n_minibatches=1", "train.steps=4", "train.progress=false", "eval.at_end=false", "device=cpu",
           "train.checkpoint_every=1", *tiny]
    train(compose(None, ppo), tmp_path / "whole")
    train(compose(None, ppo), tmp_path / "cut", stop_at=2)
    shutil.rmtree(tmp_path / "offline")  # gone: the resume must not need it
    assert resume(tmp_path / "cut").step == 4
    a = torch.load(tmp_path / "whole" / "checkpoints" / "step_000000004.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "checkpoints" / "step_000000004.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # retrained with another width at the same path: still the run's own model
    train(compose(None, [*offline, *[t.replace("d_model=16", "d_model=8") for t in tiny]]), tmp_path / "offline")
    assert resume(tmp_path / "cut", ["train.steps=6"]).step == 6


def test_resume_from_another_folder_names_the_relative_dataset_path(tmp_path: Path, cartpole_h5,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A run started on a relative dataset.path and resumed from another folder gets an error
    that says the path is relative, read from which folder, and how to pass the absolute one
    (dataset.path may change on resume), not only "no such HDF5 file: cp.hdf5"."""
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    cartpole_h5(work / "cp.hdf5")
    monkeypatch.chdir(work)
    runner = CliRunner()
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", "dataset.path=cp.hdf5", "train.steps=1",
                            "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=3",
                            "eval.at_end=false", "train.progress=false", "--run-dir", str(work / "run")])
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(other)
    r = runner.invoke(app, ["train", "--resume", str(work / "run"), "train.steps=2"])
    assert r.exit_code == 2, r.output
    assert (f"error: dataset.path: no such HDF5 file: cp.hdf5 (the run's dataset.path=cp.hdf5 is relative and is read from the "
            f"current folder {other}: resume from the folder the run was started in, or pass the absolute path") in r.output
    r = runner.invoke(app, ["train", "--resume", str(work / "run"), "train.steps=2", f"dataset.path={work / 'cp.hdf5'}"])
    assert r.exit_code == 0, r.output


# -- resume refuses a kind's field set to the value the run already used --------------------------
def test_resume_accepts_a_slot_field_given_its_default_value(tmp_path, cartpole_h5) -> None:
    data = cartpole_h5(tmp_path / "cp.h5")
    run = tmp_path / "run"
    base = ["-c", "dt/cartpole_demo", f"dataset.path={data}", "train.steps=2", "train.batch_size=4",
            "train.warmup_steps=1", "train.progress=false", "backbone.d_model=16", "backbone.n_layers=1",
            "backbone.attn_dropout=0", "agent.context_len=3", "agent.max_ep_len=20", "eval.at_end=false",
            "device=cpu", "backbone.attention.kind=performer"]
    r = runner.invoke(app, ["train", *base, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    # Performer's default is orthogonal=true: the resumed run builds exactly the same backbone
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3", "backbone.attention.orthogonal=true"])
    assert r.exit_code == 0, r.output  # not "backbone.attention.orthogonal: <unset> -> True" cannot change
