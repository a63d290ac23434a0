"""Plots of a run (rl_tformers.runtime.plots, rl-tformers plot): the return-conditioning figure, targets,
output paths, evaluations from JSON."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
from matplotlib import pyplot as plt
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.evaluation import TargetResult
from rl_tformers.runtime.plots import plot_return_conditioning
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train
from tests.datafiles import write_cartpole_h5
from tests.runs import TINY_DT_OVERRIDES, tripwire


def _plot(*args: str):
    return CliRunner().invoke(app, ["plot", *args, "--no-tensorboard", "--episodes", "1", "--envs", "1"])


@pytest.mark.parametrize(
    ("targets", "why"),
    [
        ("100,100", "items 1 and 2"),
        ("5,100,1e2", "items 2 and 3: 100 and 1e2 are the same number"),
        ("0,-0", "items 1 and 2: 0 and -0 are the same number"),
    ],
)
def test_plot_refuses_a_target_given_twice(tiny_dt_run: Path, tmp_path: Path, no_evaluation, targets, why) -> None:
    out = tmp_path / "fig.png"
    res = _plot(str(tiny_dt_run), "--out", str(out), "--targets", targets)
    value = "100" if "100" in targets else "0"
    assert res.exit_code == 2, res.output
    assert res.output == (
        f"error: --targets {targets}: the target {value} is given twice ({why}); give each target once: "
        f"each is one point of the plot\n"
    )
    assert not out.exists() and no_evaluation == []


def test_plot_from_json_with_a_target_twice_is_refused(tiny_dt_run: Path, tmp_path: Path) -> None:
    saved = tmp_path / "eval.json"
    results = [{"target_return": t, "returns": [float(r)]} for t, r in ((10, 3), (20.0, 4), (10.0, 5))]
    saved.write_text(json.dumps({"results": results, "env_id": "CartPole-v1"}))
    out = tmp_path / "fig.png"
    res = _plot_from_json(tiny_dt_run, out, saved)
    assert res.exit_code == 2, res.output
    assert res.output == (
        f"error: --from-json {saved}: results[0] and results[2] both have target_return 10; a plot has one "
        f"point per target (evaluate each target once: `rl-tformers eval RUN_DIR --targets ...` with distinct "
        f"targets)\n"
    )
    assert not out.exists()
    results[2]["target_return"] = 30  # distinct targets: plotted
    saved.write_text(json.dumps({"results": results, "env_id": "CartPole-v1"}))
    res = _plot_from_json(tiny_dt_run, out, saved)
    assert res.exit_code == 0 and res.output == f"wrote {out}\n", res.output


def _plot_from_json(run_dir: Path, out: Path, saved: Path):
    return CliRunner().invoke(
        app, ["plot", str(run_dir), "--out", str(out), "--no-tensorboard", "--from-json", str(saved)]
    )


def test_the_default_sweep_never_repeats_a_target() -> None:
    """Many default targets over a short range stay unrounded (rounded, 1000 targets over
    10 .. 598 would give 589 distinct ones); few targets are rounded."""
    from rl_tformers.runtime.plots import default_sweep, repeated_target

    many = default_sweep(500.0, 10.0, 1000)
    assert len(many) == 1000 and len(set(many)) == 1000 and repeated_target(many) is None
    assert many[0] == 10.0 and many[-1] == pytest.approx(598.0) and many[1] == pytest.approx(10 + 588 / 999)
    assert default_sweep(500.0, 10.0, 6) == [10.0, 128.0, 245.0, 363.0, 480.0, 598.0]
    assert default_sweep(500.0, 10.0, 589) == [float(x) for x in range(10, 599)]  # 1 apart: rounded
    assert repeated_target([1.0, 2.0, 1e0]) == (0, 2) and repeated_target([0.0, -0.0]) == (0, 1)


@pytest.mark.parametrize("name", ["dir.png/", "dir.png/.", "figs/", "new/.."])
def test_plot_refuses_an_out_that_names_a_directory(
    tiny_dt_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_evaluation, name: str
) -> None:
    """A path object drops the trailing '/' (or '/.'), which would write the figure to a *file*
    dir.png: an --out that names a directory is refused before anything is evaluated, as an existing
    directory is (docs/dt.md), and nothing is created."""
    monkeypatch.chdir(tmp_path)
    res = _plot(str(tiny_dt_run), "--out", name, "--targets", "10")
    tail = "/" if name.endswith("/") else name.rsplit("/", 1)[-1]
    example = {"dir.png/": "dir.png", "dir.png/.": "dir.png", "figs/": "figs", "new/..": "new/.."}[name]
    assert res.exit_code == 2, res.output
    assert res.output == (
        f"error: --out {name} names a directory (it ends with {tail!r}); give a file name, e.g. "
        f"{example}/return_conditioning.png\n"
    )
    assert list(tmp_path.iterdir()) == [] and no_evaluation == []


def test_plot_out_with_a_tilde_is_written_where_its_parents_were_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``~`` in --out (``--out=~/fig.png`` is not expanded by the shell) is expanded both where it
    is checked and where it is written (not written to a folder named '~' in the current directory)."""
    from rl_tformers.runtime.plots import figure_path

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert figure_path("~/figs/fig.png") == home / "figs" / "fig.png"
    assert figure_path("~/fig") == home / "fig.png"


def test_plot_refuses_an_out_name_longer_than_the_file_system_takes(
    tiny_dt_run: Path, tmp_path: Path, no_evaluation
):
    """An --out whose name is too long is an error line, not an OSError traceback (from the directory check)."""
    out = tmp_path / ("x" * 300 + ".png")
    res = _plot(str(tiny_dt_run), "--out", str(out), "--targets", "10")
    assert res.exit_code == 2, res.output
    assert res.output == f"error: --out {out}: cannot be written here (File name too long)\n"
    assert no_evaluation == []


def test_plot_n_targets_is_capped(tiny_dt_run: Path, tmp_path: Path, no_evaluation) -> None:
    """A typo such as --n-targets 6000000 built a list of millions of targets and evaluated them."""
    res = _plot(str(tiny_dt_run), "--out", str(tmp_path / "fig.png"), "--n-targets", "6000000")
    assert res.exit_code == 2 and "--n-targets" in res.output and "1000" in res.output, res.output
    assert not (tmp_path / "fig.png").exists() and no_evaluation == []


def test_plot_refuses_to_log_another_runs_checkpoint_to_run_dir(
    tiny_dt_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_evaluation
) -> None:
    """``plot RUN --checkpoint OTHER_RUN/checkpoints/...`` evaluated the other run's model and
    logged its figure into RUN's TensorBoard files, as RUN's own (--from-json refuses another
    run's evaluation for that reason)."""
    from rl_tformers.runtime.tracking import event_files

    other = tmp_path / "other"
    train(compose("dt/cartpole_demo", [f"dataset.path={write_cartpole_h5(tmp_path / 'cp.hdf5')}", *TINY_DT_OVERRIDES]), other)
    ckpt = other / "checkpoints" / "step_000000002.pt"
    before = {p: p.stat().st_size for p in event_files(tiny_dt_run)}
    res = CliRunner().invoke(
        app,
        [
            "plot",
            str(tiny_dt_run),
            "--out",
            str(tmp_path / "fig.png"),
            "--targets",
            "10",
            "--checkpoint",
            str(ckpt),
        ],
    )
    assert res.exit_code == 2, res.output
    assert res.output == (
        f"error: --checkpoint {ckpt} is not inside RUN_DIR {tiny_dt_run}: the figure is logged to RUN_DIR's "
        f"TensorBoard files; give the run directory that holds the checkpoint, or --no-tensorboard\n"
    )
    assert {p: p.stat().st_size for p in event_files(tiny_dt_run)} == before and no_evaluation == []
    assert not (tmp_path / "fig.png").exists()


runner = CliRunner()


def test_plot_refuses_a_target_beyond_the_rtg_embedding_up_front(cartpole_dt_run: Path, tmp_path: Path,
                                                                 monkeypatch) -> None:
    from rl_tformers.runtime import evaluation

    monkeypatch.setattr(evaluation, "evaluate", tripwire)
    r = runner.invoke(app, ["plot", str(cartpole_dt_run), "--out", str(tmp_path / "p.png"), "--targets", "10,1e30",
                            "--episodes", "1", "--envs", "1", "--no-tensorboard"])
    assert r.exit_code == 2 and r.stderr.startswith("error: --targets: 1e+30 is beyond what this model takes")
    assert not (tmp_path / "p.png").exists()


def test_plot_from_json_with_nan_returns_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "eval.json"
    path.write_text('{"results": [{"target_return": 10, "returns": [NaN, 2.0]}]}')
    r = runner.invoke(app, ["plot", str(tmp_path / "no_run"), "--out", str(tmp_path / "p.png"),
                            "--from-json", str(path)])
    assert r.exit_code == 2 and f"error: --from-json {path}: results[0] is not a per-target result" in r.stderr
    assert "must be finite numbers" in r.stderr


# ------------------------------------------------------------- plot / eval --out paths
def test_plot_out_without_extension_writes_and_prints_the_png(cartpole_dt_run: Path, tmp_path: Path) -> None:
    r = runner.invoke(app, ["plot", str(cartpole_dt_run), "--out", str(tmp_path / "noext"), "--targets", "10,20",
                            "--episodes", "1", "--envs", "1", "--no-tensorboard"])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1] == f"wrote {tmp_path / 'noext.png'}"
    assert (tmp_path / "noext.png").is_file() and not (tmp_path / "noext").exists()


def test_save_figure_returns_the_file_it_wrote(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    from rl_tformers.runtime.plots import figure_path, save_figure

    assert save_figure(plt.figure(), tmp_path / "a") == tmp_path / "a.png" and (tmp_path / "a.png").is_file()
    assert save_figure(plt.figure(), tmp_path / "b.svg") == tmp_path / "b.svg"
    assert figure_path(tmp_path / "c.PDF") == tmp_path / "c.PDF"
    with pytest.raises(ValueError, match="is a directory"):
        save_figure(plt.figure(), tmp_path)


@pytest.mark.parametrize("make_out, expected", [
    (lambda t: t, "is a directory; give a file name"),
    (lambda t: t / "x.jpgx", "matplotlib cannot write '.jpgx' files; use one of the extensions "),
    (lambda t: t / "afile" / "p.png", "afile is a file, not a directory"),
])
def test_plot_out_is_checked_before_loading_or_evaluating(tmp_path: Path, monkeypatch, make_out, expected) -> None:
    from rl_tformers.runtime import evaluation

    monkeypatch.setattr(evaluation, "evaluate", tripwire)
    (tmp_path / "afile").write_text("hi")
    out = make_out(tmp_path)
    r = runner.invoke(app, ["plot", str(tmp_path / "no_run"), "--out", str(out), "--targets", "10"])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --out {out}"), r.output
    assert expected in r.stderr
    if "jpgx" in str(out):
        assert ".png" in r.stderr and ".pdf" in r.stderr and ".svg" in r.stderr
    assert not (tmp_path.parent / f"{tmp_path.name}.png").exists()


TINY_DT = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1", "train.batch_size=4",
           "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu"]


def _cartpole_dt(data: Path, run_dir: Path, *extra: str):
    return train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, *extra]), run_dir)


# ------------------------------------------------------------------- plot --from-json
def test_plot_from_json_labels_the_saved_evaluation_not_the_runs_newest_checkpoint(
        tmp_path: Path, cartpole_h5, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plot RUN --from-json FILE` titled (and logged to TensorBoard) the figure with the run's
    *newest* checkpoint step, whatever step the saved evaluation came from: an `eval --checkpoint
    step_400 --out` file plotted after a resume to 500 read "(step 500)"."""
    from rl_tformers.runtime import plots

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
    assert titles and "step 1" in titles[0], titles  # not "dt on CartPole-v1 (step 2)"


def test_plot_from_json_refuses_an_evaluation_of_another_environment(tmp_path: Path, cartpole_h5) -> None:
    """A Hopper evaluation plotted onto a CartPole run is refused (it would give a figure titled
    "dt on CartPole-v1" with the CartPole dataset's best/mean lines over Hopper returns, logged
    into the CartPole run's TensorBoard)."""
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


# ------------------------------------------------------------------- resume train.steps=N, cosine
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


# ------------------------------------------------------------------- resume from another folder
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


# ------------------------------------------------------------- --from-json with odd per-episode data
@pytest.mark.parametrize(("result", "says"), [
    ({"target_return": 10, "returns": []}, "returns is empty"),
    ({"target_return": 10, "returns": [1, 2], "rewards": "ab"}, "rewards must be 2 lists (one per return), got str"),
    ({"target_return": 10, "returns": [1, 2], "rewards": [[1, None], [2]]},
     "rewards of episode 0 must be a list of finite numbers"),
    ({"target_return": 10, "returns": [5, 6], "rewards": [[1, 2, 3]]}, "rewards must be 2 lists (one per return), got 1"),
    ({"target_return": 10, "returns": [5, 6], "rewards": [[2, 3], [1, 2]]},
     "rewards of episode 1 sum to 3.0, but its return is 6"),
    ({"target_return": 10, "returns": [5], "lengths": [3], "rewards": [[2, 3]]},
     "rewards of episode 0: 2 rewards, but its length is 3"),
    ({"target_return": 10, "returns": [5, 6], "lengths": [3]}, "lengths must be 2 non-negative integers"),
])
def test_plot_from_json_checks_each_result(tmp_path: Path, monkeypatch, result: dict, says: str) -> None:
    from rl_tformers.runtime import loading

    monkeypatch.setattr(loading, "load_run", tripwire)
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"results": [result]}))
    r = runner.invoke(app, ["plot", str(tmp_path), "--from-json", str(path), "--out", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and (r.exception is None or isinstance(r.exception, SystemExit)), r.output
    assert f"error: --from-json {path}: results[0] is not a per-target result" in r.output and says in r.output, r.output
    assert not (tmp_path / "p.png").exists()


# ------------------------------------- plot --checkpoint with a RUN_DIR that is not a directory
@pytest.mark.parametrize("make", ["missing", "file"])
def test_plot_checkpoint_with_a_run_dir_that_is_not_a_directory(tmp_path: Path, monkeypatch, make: str) -> None:
    from rl_tformers.runtime import loading

    monkeypatch.setattr(loading, "load_run", tripwire)
    run_dir = tmp_path / "run"
    if make == "file":
        run_dir.write_text("x")
    r = runner.invoke(app, ["plot", str(run_dir), "--checkpoint", str(tmp_path / "c.pt"), "--out",
                            str(tmp_path / "p.png")])
    what = "does not exist" if make == "missing" else "is not a directory"
    assert r.exit_code == 2 and f"error: {run_dir} {what}: the figure is logged to RUN_DIR's TensorBoard" in r.output
    assert "--no-tensorboard" in r.output
    assert run_dir.exists() == (make == "file") and not (tmp_path / "p.png").exists()


# ------------------------------------------- plot --from-json ignored the evaluation options given
@pytest.mark.parametrize(("extra", "names"), [(["--targets", "5", "--episodes", "3"], "--targets, --episodes"),
                                              (["--seed", "0"], "--seed"), (["--n-targets", "4", "--envs", "2"],
                                                                            "--n-targets, --envs")])
def test_plot_from_json_refuses_evaluation_options(tmp_path: Path, monkeypatch, extra: list, names: str) -> None:
    from rl_tformers.runtime import loading

    monkeypatch.setattr(loading, "load_run", tripwire)
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"results": [{"target_return": 10, "returns": [5, 6]}]}))
    r = runner.invoke(app, ["plot", str(tmp_path), "--from-json", str(path), "--out", str(tmp_path / "p.png"), *extra])
    assert r.exit_code == 2, r.output
    assert f"error: --from-json {path} plots a saved evaluation: {names} would be ignored" in r.output


# ------------------------------------------------------------------- plot --from-json
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


def _results() -> list[TargetResult]:
    return [  # deliberately out of order: the plot sorts by target
        TargetResult(target_return=300.0, returns=[250.0, 310.0], lengths=[3, 2], seeds=[0, 1],
                     rewards=[[100.0, 100.0, 50.0], [200.0, 110.0]]),
        TargetResult(target_return=100.0, returns=[90.0, 110.0], lengths=[2, 2], seeds=[0, 1],
                     rewards=[[40.0, 50.0], [60.0, 50.0]]),
    ]


def _line(ax, label: str):
    return next(line for line in ax.get_lines() if line.get_label() == label)


def test_the_figure_holds_every_element_of_the_return_conditioning_plot() -> None:
    fig = plot_return_conditioning(_results(), dataset_max=400.0, dataset_mean=150.0)
    try:
        ax, ax2 = fig.axes
        oracle = _line(ax, "y = x (oracle)")
        x, y = oracle.get_data()
        assert np.array_equal(x, y) and x[0] == 0.0 and x[-1] == 400.0  # from 0 to the dataset best
        mean = _line(ax, "achieved (mean)")
        assert np.array_equal(mean.get_xdata(), [100.0, 300.0]) and np.array_equal(mean.get_ydata(), [100.0, 280.0])
        band = next(c for c in ax.collections if c.get_label() == "+- std over episodes")
        ys = band.get_paths()[0].vertices[:, 1]
        assert ys.min() == pytest.approx(90.0) and ys.max() == pytest.approx(310.0)  # mean -+ std (ddof 0)
        points = np.concatenate([c.get_offsets() for c in ax.collections if c.get_label().startswith("_")])
        assert sorted(map(tuple, points.tolist())) == [(100.0, 90.0), (100.0, 110.0), (300.0, 250.0), (300.0, 310.0)]
        assert np.array_equal(_line(ax, "dataset best (400)").get_ydata(), [400.0, 400.0])
        assert np.array_equal(_line(ax, "dataset mean (150)").get_ydata(), [150.0, 150.0])
        assert ax.get_xlabel() == "target return" and ax.get_ylabel() == "achieved return"
        # traces: per episode the remaining RTG (target - reward so far) and the cumulative reward
        traces = [line for line in ax2.get_lines() if line.get_label().startswith("_") and len(line.get_xdata())]
        by_data = {tuple(line.get_ydata().tolist()) for line in traces}
        assert (100.0, 60.0, 10.0) in by_data and (0.0, 40.0, 90.0) in by_data  # target 100, first episode
        assert (300.0, 200.0, 100.0, 50.0) in by_data and (0.0, 100.0, 200.0, 250.0) in by_data  # target 300
        assert len(traces) == 2 * 4  # 2 lines x 2 episodes x 2 targets
        labels = {line.get_label() for line in ax2.get_lines()}
        assert {"target 100", "target 300", "remaining RTG", "cumulative reward"} <= labels
    finally:
        plt.close(fig)


def test_without_recorded_rewards_the_traces_panel_says_so() -> None:
    res = [TargetResult(target_return=10.0, returns=[9.0], lengths=[1], seeds=[0])]
    fig = plot_return_conditioning(res)
    try:
        assert [t.get_text() for t in fig.axes[1].texts] == ["no per-step rewards recorded"]
        assert not any(line.get_label().startswith("dataset") for line in fig.axes[0].get_lines())
    finally:
        plt.close(fig)


def test_plot_command_on_a_return_conditioned_gtrxl_run(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rl_tformers.cli import app
    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train
    from tests.datafiles import write_cartpole_h5

    data = write_cartpole_h5(tmp_path / "cp.hdf5", n=60)
    cfg = compose("gtrxl/recall_bc", [
        f"dataset.path={data}", "agent.objective=rcbc", "agent.env_id=CartPole-v1", "backbone.d_model=16",
        "backbone.n_heads=1", "backbone.n_layers=1", "train.steps=2", "train.batch_size=4", "train.warmup_steps=1",
        "train.progress=false", "device=cpu", "eval.at_end=false"])
    train(cfg, tmp_path / "run")
    out = tmp_path / "rc.png"
    r = CliRunner().invoke(app, ["plot", str(tmp_path / "run"), "--out", str(out), "--targets", "5,10", "--episodes", "2"])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


# ------------------------------------------------------------------- a plot that tests conditioning
def test_the_default_sweep_starts_at_the_random_policys_return_when_it_is_lower() -> None:
    """A one-policy Hopper set (returns 1074 .. 1121) with D4RL's random return -20.27: the sweep
    runs from -20 to 1349, not 1074 to 1130 (one blob on the diagonal)."""
    from rl_tformers.envs.scores import D4RL_REF_SCORES

    from rl_tformers.runtime.plots import default_sweep

    random_hopper = D4RL_REF_SCORES["hopper"][0]
    assert default_sweep(1121.0, 1074.0, 6, random_return=random_hopper) == [-20.0, 254.0, 528.0, 801.0, 1075.0,
                                                                             1349.0]
    assert default_sweep(1121.0, 1074.0, 6) == [1074.0, 1085.0, 1097.0, 1108.0, 1119.0, 1130.0]
    # a random return above the data's worst changes nothing; equal returns reach down to it
    assert default_sweep(500.0, 10.0, 6, random_return=100.0) == default_sweep(500.0, 10.0, 6)
    assert default_sweep(5.0, 5.0, 3, random_return=-1.0) == pytest.approx([-1.0, 2.6, 6.2])


def test_plot_sweeps_from_the_datasets_random_reference_to_beyond_its_best(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A CartPole file whose every episode returns 30 and whose metadata gives the random policy's
    return 0 (ref_min_score): the default targets run 0 .. 36, and the figure shades 30 .. 30."""
    import h5py

    from rl_tformers.runtime import evaluation, plots

    data = write_cartpole_h5(tmp_path / "cp.hdf5", reward=3.0)
    with h5py.File(data, "a") as f:
        f.attrs["rl_tformers_metadata"] = json.dumps({"ref_min_score": 0.0, "ref_max_score": 500.0})
    run = tmp_path / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT_OVERRIDES]), run)
    asked, drawn = [], []
    real_evaluate, real_plot = evaluation.evaluate, plots.plot_return_conditioning

    def spy_evaluate(policy, make_env, targets, **kwargs):
        asked.append(list(targets))
        return real_evaluate(policy, make_env, targets, **kwargs)

    def spy_plot(results, **kwargs):
        drawn.append(kwargs)
        return real_plot(results, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", spy_evaluate)
    monkeypatch.setattr(plots, "plot_return_conditioning", spy_plot)
    res = _plot(str(run), "--out", str(tmp_path / "fig.png"))
    assert res.exit_code == 0, res.output
    assert asked == [[0.0, 7.0, 14.0, 22.0, 29.0, 36.0]]
    assert (drawn[0]["dataset_min"], drawn[0]["dataset_max"]) == (30.0, 30.0)


def _overlap(a, b) -> bool:
    """Whether two display-space boxes share an area (touching edges do not count)."""
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("n_targets", [2, 20])
def test_the_legends_lie_outside_every_axes_data_area(n_targets: int) -> None:
    from rl_tformers.runtime.plots import default_sweep

    targets = default_sweep(1121.0, 1074.0, n_targets, random_return=-20.0)
    res = [TargetResult(target_return=t, returns=[min(t, 1100.0)], lengths=[2], seeds=[0],
                        rewards=[[min(t, 1100.0) / 2] * 2]) for t in targets]
    fig = plot_return_conditioning(res, dataset_max=1121.0, dataset_mean=1100.0, dataset_min=1074.0)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        data_axes = fig.axes[:2]  # (a colour bar, with 20 targets, is a third axes)
        assert len(legends) == 2
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0  # inside the figure
            for ax in data_axes:
                assert not _overlap(box, ax.get_window_extent(renderer)), (legend, ax)
        labels = [t.get_text() for t in legends[1].get_texts()]
        assert sum(label.startswith("target ") for label in labels) == (2 if n_targets == 2 else 0)
        band = next(p for p in data_axes[0].patches if p.get_label().startswith("targets within the dataset"))
        assert (band.get_x(), band.get_x() + band.get_width()) == (1074.0, 1121.0)  # target (x) data units
        assert band.get_label() == "targets within the dataset's returns (1074 .. 1121)"
    finally:
        plt.close(fig)


def test_two_plots_at_the_same_step_keep_both_tensorboard_images(tmp_path: Path) -> None:
    from rl_tformers.runtime.plots import _image_tags, log_figure

    tags = []
    for _ in range(3):
        fig = plot_return_conditioning(_results())
        try:
            tags.append(log_figure(tmp_path, "plot/return_conditioning", fig, 7))
        finally:
            plt.close(fig)
    fig = plot_return_conditioning(_results())
    tags.append(log_figure(tmp_path, "plot/return_conditioning", fig, 8))
    plt.close(fig)
    assert tags == ["plot/return_conditioning", "plot/return_conditioning_2", "plot/return_conditioning_3",
                    "plot/return_conditioning"]
    assert _image_tags(tmp_path, 7) == set(tags[:3]) and _image_tags(tmp_path, 8) == {tags[0]}
