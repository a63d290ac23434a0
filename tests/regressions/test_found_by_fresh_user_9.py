"""Defects found by the ninth fresh-user pass (README walkthrough: Python API, a small Hopper set,
resume, backbone swaps, GTrXL on recall, a sweep, the docs' commands).

Every test is tiny (CPU, seconds) and needs neither ./data nor ../shared.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

TINY_DT = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1", "train.batch_size=4",
           "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu"]


def _cartpole_dt(data: Path, run_dir: Path, *extra: str):
    return train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, *extra]), run_dir)


# ------------------------------------------------------------------- 1: plot --from-json
def test_plot_from_json_labels_the_saved_evaluation_not_the_runs_newest_checkpoint(
        tmp_path: Path, cartpole_h5, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plot RUN --from-json FILE` titled (and logged to TensorBoard) the figure with the run's
    *newest* checkpoint step, whatever step the saved evaluation came from: an `eval --checkpoint
    step_400 --out` file plotted after a resume to 500 read "(step 500)"."""
    from rl_tformers.agents.common import plots

    run = tmp_path / "run"
    _cartpole_dt(cartpole_h5(tmp_path / "cp.hdf5"), run, "train.steps=2", "train.checkpoint_every=1")
    first = run / "checkpoints" / "step_000000001.pt"
    assert first.is_file()
    saved = tmp_path / "e1.json"
    r = runner.invoke(app, ["eval", str(run), "--checkpoint", str(first), "--targets", "20", "--episodes", "1",
                            "--envs", "1", "--out", str(saved)])
    assert r.exit_code == 0, r.output
    assert json.loads(saved.read_text())["extra"]["step"] == 1

    titles: list[str] = []
    real = plots.plot_return_conditioning

    def spy(*args, **kwargs):
        titles.append(kwargs.get("title", ""))
        return real(*args, **kwargs)

    monkeypatch.setattr(plots, "plot_return_conditioning", spy)
    r = runner.invoke(app, ["plot", str(run), "--from-json", str(saved), "--out", str(tmp_path / "f.png"),
                            "--no-tensorboard"])
    assert r.exit_code == 0, r.output
    assert titles and "step 1" in titles[0], titles  # was "dt on CartPole-v1 (step 2)"


def test_plot_from_json_refuses_an_evaluation_of_another_environment(tmp_path: Path, cartpole_h5) -> None:
    """A Hopper evaluation plotted onto a CartPole run gave a figure titled "dt on CartPole-v1"
    with the CartPole dataset's best/mean lines over Hopper returns (and logged it into the
    CartPole run's TensorBoard)."""
    run = tmp_path / "run"
    _cartpole_dt(cartpole_h5(tmp_path / "cp.hdf5"), run, "train.steps=1")
    saved = tmp_path / "e.json"
    r = runner.invoke(app, ["eval", str(run), "--targets", "20", "--episodes", "1", "--envs", "1", "--out", str(saved)])
    assert r.exit_code == 0, r.output
    other = json.loads(saved.read_text())
    other["env_id"] = "Hopper-v5"
    other["extra"]["run_dir"] = "runs/some-hopper-run"
    (tmp_path / "hopper.json").write_text(json.dumps(other))
    r = runner.invoke(app, ["plot", str(run), "--from-json", str(tmp_path / "hopper.json"),
                            "--out", str(tmp_path / "f.png")])
    assert r.exit_code != 0, r.output
    assert "Hopper-v5" in r.output


# ------------------------------------------------------------------- 2: collect --skip-existing
def test_skip_existing_does_not_silently_keep_a_recipe_built_with_another_size(tmp_path: Path) -> None:
    """The README's path: `collect --recipe hopper-medium --recipe-steps 5000` (a small set to
    try things), later `collect --recipe 'hopper-*'`, which stops and suggests --skip-existing.
    That keeps the 5k-step set under the full recipe's id with a bare "exists ..., skipped",
    although the dataset's metadata records the size it was built with."""
    args = ["collect", "--recipe", "hopper-random", "--root", str(tmp_path), "--no-progress"]
    r = runner.invoke(app, [*args, "--recipe-steps", "6"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*args, "--skip-existing"])  # the recipe's own 100k steps
    line = next((ln for ln in r.output.splitlines() if "random-v0" in ln), r.output)
    assert any(s in line for s in ("--recipe-steps", "--overwrite", "100k", "100000")), r.output


# ------------------------------------------------------------------- 3: resume train.steps=N, cosine
def test_resume_that_stretches_a_cosine_schedule_does_not_jump_the_learning_rate_silently(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """docs/runtime.md: `train --resume RUN train.steps=5000  # ... and train longer`. With
    warmup_cosine the schedule is re-stretched over the new length, so the decayed lr jumps back
    up at the resume step (toy: 3.2e-4 at step 20 -> 1.76e-3 at step 21, 5.5x; the README's
    Hopper "first try" 6e-5 -> 1.2e-4), and the resume says only `train.steps: 20 -> 40`."""
    base = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.batch_size=8", "train.lr=3e-3",
            "eval.at_end=false", "train.schedule=warmup_cosine", "train.warmup_steps=2", "train.log_every=1"]
    train(compose(None, [*base, "train.steps=10"]), tmp_path / "run")
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume(tmp_path / "run", ["train.steps=20"])
    said = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    said += [str(w.message) for w in caught]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lr = {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}
    jumped = lr[11] > lr[10] * 1.01
    assert not jumped or any("learning rate" in m or "lr" in m.split() or "train.lr" in m or "schedule" in m
                             for m in said), (lr[10], lr[11], said)


# ------------------------------------------------------------------- 4: resume from another folder
def test_a_run_on_a_relative_dataset_path_resumes_from_another_directory(
        tmp_path: Path, cartpole_h5, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run trained with `dataset.path=cartpole.hdf5` (the README's Python API block) resumed
    from another working directory fails with `no such HDF5 file: cartpole.hdf5`, and naming the
    same file by its absolute path is refused: `dataset.path: cartpole.hdf5 -> /abs/cartpole.hdf5
    cannot change when resuming`. A job script or a time-limited cluster job (`--stop-at`) that
    starts elsewhere cannot continue the run at all."""
    work = tmp_path / "work"
    work.mkdir()
    cartpole_h5(work / "cartpole.hdf5")
    monkeypatch.chdir(work)
    _cartpole_dt(Path("cartpole.hdf5"), work / "run", "train.steps=1")
    monkeypatch.chdir(tmp_path)
    r = resume(work / "run", ["train.steps=2", f"dataset.path={work / 'cartpole.hdf5'}"])
    assert r.step == 2


# ------------------------------------------------------------------- 5: PPO fine-tuning inputs
def test_ppo_fine_tuning_says_which_agent_inputs_it_takes_from_the_checkpoint(tmp_path: Path) -> None:
    """`train -c gtrxl/ppo_cartpole_finetune` records `agent.head_hidden: 64` (inherited from
    ppo_cartpole.yaml) in config.yaml, but builds the offline run's head_hidden=0 (207,491
    parameters, not 224,131), without a word; a changed backbone setting is warned about
    (test_found_by_breaker_8_gtrxl), a changed head_hidden / prev_reward is not."""
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
        ppo = GTrXLPPO(compose(overrides=over), None, "cpu")
    assert ppo.model_cfg.head_hidden == 0  # the checkpoint's, as docs/gtrxl.md says
    said = " ".join(str(w.message) for w in caught)
    assert "agent.head_hidden" in said and "agent.prev_reward" in said, said


# ------------------------------------------------------------------- 6: docs
def test_gtrxl_known_limits_do_not_contradict_the_default_knn_retrieval() -> None:
    """README and docs/memory_adaptive.md: kNN memory's default `retrieval: steps` makes acting
    one step at a time equal the training forward. docs/gtrxl.md "Known limits" still says
    acting does not equal the segment computation "even within mem_len steps" (the old
    `segments` rule) without naming the retrieval rule."""
    text = (ROOT / "docs" / "gtrxl.md").read_text()
    known = text[text.index("## Known limits"):]
    bullets = [b for b in known.split("\n- ") if "memory.kind=knn" in b]
    for b in bullets:
        assert "does not equal" not in b or "segments" in b, b
