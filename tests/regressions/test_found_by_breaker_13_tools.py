"""Faults found by breaker 13 in ``rl-tformers plot`` and ``rl-tformers sweep``; each test fails
without its fix. Tiny runs only (a 2-update DT on a hand-made CartPole file, the toy agent)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_cartpole_h5

TINY = [
    "backbone.d_model=16",
    "backbone.n_heads=1",
    "backbone.n_layers=1",
    "agent.context_len=5",
    "train.steps=2",
    "train.batch_size=4",
    "train.warmup_steps=1",
    "train.progress=false",
    "device=cpu",
    "eval.every=0",
    "eval.at_end=false",
    "agent.targets=[10]",
    "backbone.dropout=0.0",
]


@pytest.fixture(scope="module")
def dt_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-update Decision Transformer run (module-wide: the plot tests only read it)."""
    root = tmp_path_factory.mktemp("dt")
    path = write_cartpole_h5(root / "cp.hdf5")
    run_dir = root / "run"
    train(compose("dt/cartpole_demo", [f"dataset.path={path}", *TINY]), run_dir)
    return run_dir


@pytest.fixture
def no_evaluation(monkeypatch: pytest.MonkeyPatch) -> list:
    """Make any evaluation fail the test: a refusal must come before anything is evaluated."""
    import rl_tformers.runtime.evaluation as evaluation

    calls: list = []

    def evaluate(*args, **kwargs):
        calls.append(args)
        raise AssertionError("evaluated although the command should have been refused first")

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    return calls


def _plot(*args: str):
    return CliRunner().invoke(app, ["plot", *args, "--no-tensorboard", "--episodes", "1", "--envs", "1"])


# -- 1. plot --targets 100,100 plotted the same target twice ------------------------------------------


@pytest.mark.parametrize(
    ("targets", "why"),
    [
        ("100,100", "items 1 and 2"),
        ("5,100,1e2", "items 2 and 3: 100 and 1e2 are the same number"),
        ("0,-0", "items 1 and 2: 0 and -0 are the same number"),
    ],
)
def test_plot_refuses_a_target_given_twice(dt_run: Path, tmp_path: Path, no_evaluation, targets, why) -> None:
    out = tmp_path / "fig.png"
    res = _plot(str(dt_run), "--out", str(out), "--targets", targets)
    value = "100" if "100" in targets else "0"
    assert res.exit_code == 2, res.output
    assert res.output == (
        f"error: --targets {targets}: the target {value} is given twice ({why}); give each target once: "
        f"each is one point of the plot\n"
    )
    assert not out.exists() and no_evaluation == []


def test_plot_from_json_with_a_target_twice_is_refused(dt_run: Path, tmp_path: Path) -> None:
    saved = tmp_path / "eval.json"
    results = [{"target_return": t, "returns": [float(r)]} for t, r in ((10, 3), (20.0, 4), (10.0, 5))]
    saved.write_text(json.dumps({"results": results, "env_id": "CartPole-v1"}))
    out = tmp_path / "fig.png"
    res = _plot_from_json(dt_run, out, saved)
    assert res.exit_code == 2, res.output
    assert res.output == (
        f"error: --from-json {saved}: results[0] and results[2] both have target_return 10; a plot has one "
        f"point per target (evaluate each target once: `rl-tformers eval RUN_DIR --targets ...` with distinct "
        f"targets)\n"
    )
    assert not out.exists()
    results[2]["target_return"] = 30  # distinct targets: plotted
    saved.write_text(json.dumps({"results": results, "env_id": "CartPole-v1"}))
    res = _plot_from_json(dt_run, out, saved)
    assert res.exit_code == 0 and res.output == f"wrote {out}\n", res.output


def _plot_from_json(run_dir: Path, out: Path, saved: Path):
    return CliRunner().invoke(
        app, ["plot", str(run_dir), "--out", str(out), "--no-tensorboard", "--from-json", str(saved)]
    )


def test_the_default_sweep_never_repeats_a_target() -> None:
    """Many default targets over a short range were rounded onto each other (1000 targets over
    10 .. 598: 589 distinct); they stay unrounded then, and few targets are rounded as before."""
    from rl_tformers.runtime.plots import default_sweep, repeated_target

    many = default_sweep(500.0, 10.0, 1000)
    assert len(many) == 1000 and len(set(many)) == 1000 and repeated_target(many) is None
    assert many[0] == 10.0 and many[-1] == pytest.approx(598.0) and many[1] == pytest.approx(10 + 588 / 999)
    assert default_sweep(500.0, 10.0, 6) == [10.0, 128.0, 245.0, 363.0, 480.0, 598.0]
    assert default_sweep(500.0, 10.0, 589) == [float(x) for x in range(10, 599)]  # 1 apart: rounded
    assert repeated_target([1.0, 2.0, 1e0]) == (0, 2) and repeated_target([0.0, -0.0]) == (0, 1)


# -- 2. plot --out dir.png/ wrote a file named dir.png -------------------------------------------------


@pytest.mark.parametrize("name", ["dir.png/", "dir.png/.", "figs/", "new/.."])
def test_plot_refuses_an_out_that_names_a_directory(
    dt_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_evaluation, name: str
) -> None:
    """A path object drops the trailing '/' (or '/.'): the figure went to a *file* dir.png. An
    --out that names a directory is refused before anything is evaluated, as an existing
    directory is (docs/dt.md), and nothing is created."""
    monkeypatch.chdir(tmp_path)
    res = _plot(str(dt_run), "--out", name, "--targets", "10")
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
    """``~`` in --out (``--out=~/fig.png`` is not expanded by the shell) was checked expanded (a
    file in the way under $HOME) but written to a folder named '~' in the current directory."""
    from rl_tformers.runtime.plots import figure_path

    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert figure_path("~/figs/fig.png") == home / "figs" / "fig.png"
    assert figure_path("~/fig") == home / "fig.png"


def test_plot_refuses_an_out_name_longer_than_the_file_system_takes(
    dt_run: Path, tmp_path: Path, no_evaluation
):
    """An --out whose name is too long stopped with an OSError traceback (from the directory check)."""
    out = tmp_path / ("x" * 300 + ".png")
    res = _plot(str(dt_run), "--out", str(out), "--targets", "10")
    assert res.exit_code == 2, res.output
    assert res.output == f"error: --out {out}: cannot be written here (File name too long)\n"
    assert no_evaluation == []


def test_plot_n_targets_is_capped(dt_run: Path, tmp_path: Path, no_evaluation) -> None:
    """A typo such as --n-targets 6000000 built a list of millions of targets and evaluated them."""
    res = _plot(str(dt_run), "--out", str(tmp_path / "fig.png"), "--n-targets", "6000000")
    assert res.exit_code == 2 and "--n-targets" in res.output and "1000" in res.output, res.output
    assert not (tmp_path / "fig.png").exists() and no_evaluation == []


def test_plot_refuses_to_log_another_runs_checkpoint_to_run_dir(
    dt_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_evaluation
) -> None:
    """``plot RUN --checkpoint OTHER_RUN/checkpoints/...`` evaluated the other run's model and
    logged its figure into RUN's TensorBoard files, as RUN's own (--from-json refuses another
    run's evaluation for that reason)."""
    from rl_tformers.runtime.tracking import event_files

    other = tmp_path / "other"
    train(compose("dt/cartpole_demo", [f"dataset.path={write_cartpole_h5(tmp_path / 'cp.hdf5')}", *TINY]), other)
    ckpt = other / "checkpoints" / "step_000000002.pt"
    before = {p: p.stat().st_size for p in event_files(dt_run)}
    res = CliRunner().invoke(
        app,
        [
            "plot",
            str(dt_run),
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
        f"error: --checkpoint {ckpt} is not inside RUN_DIR {dt_run}: the figure is logged to RUN_DIR's "
        f"TensorBoard files; give the run directory that holds the checkpoint, or --no-tensorboard\n"
    )
    assert {p: p.stat().st_size for p in event_files(dt_run)} == before and no_evaluation == []
    assert not (tmp_path / "fig.png").exists()


# -- sweep ------------------------------------------------------------------------------------------


def _sweep(*args: str):
    return CliRunner().invoke(app, ["sweep", "-c", "toy", *args])


def test_sweep_override_without_equals_is_refused_not_a_traceback(tmp_path: Path) -> None:
    """``rl-tformers sweep ... train.steps`` (no ``=VALUE``) stopped with an IndexError traceback in
    check_overrides; ``rl-tformers train`` says what is wrong, and so does the sweep now."""
    out = tmp_path / "sw"
    for item in ("train.steps", "=5"):
        res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), item)
        assert res.exit_code == 2, res.output
        assert res.output == f"error: override {item!r} is not KEY=VALUE (e.g. train.steps=1000)\n"
    assert not out.exists()


@pytest.mark.parametrize(
    ("metric", "message"),
    [
        (
            "step",
            "--metric step: that is a column the sweep writes for each run, not a scalar the runs log; ",
        ),
        (
            "seed",
            "--metric seed: that is a column the sweep writes for each run, not a scalar the runs log; ",
        ),
        ("train.lr", "--metric train.lr: that is a grid key, not a scalar the runs log; "),
        ("", "--metric '' is empty; "),
    ],
)
def test_sweep_refuses_a_metric_that_no_run_logs_before_running(
    tmp_path: Path, metric: str, message: str
) -> None:
    """``--metric step`` ran the whole sweep, then summarised nothing with a warning blaming the
    runs ("its final value is NaN or infinite in every completed run ... (diverged?)");
    ``--metric ''`` was silently taken as the default metric."""
    out = tmp_path / "sw"
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), "--metric", metric, "train.steps=2")
    assert res.exit_code == 2, res.output
    hint = "give a scalar the runs log, e.g. eval/return_mean or train/loss (default: the evaluation score, else "
    tail = "train/loss), or leave --metric out" if not metric else "train/loss)"
    assert res.output == f"error: {message}{hint}{tail}\n"
    assert not out.exists()


def test_sweep_refuses_grid_keys_inside_each_other() -> None:
    """``--grid train.lr=... --grid 'train={lr: ...}'``: the later key replaced the earlier one's
    values in every run; the sweep was then refused as 'the values mean the same once parsed'
    (or, with other fields, ran a grid that was not the one asked for)."""
    from rl_tformers.runtime.sweep import SweepError, parse_grid

    with pytest.raises(SweepError) as e:
        parse_grid(["train.lr=1e-3,3e-3", "train={lr: 0.1}"])
    assert str(e.value) == (
        "--grid train.lr=... and --grid train=... set the same option (train.lr is inside train): in every "
        "run one would replace the other's value; sweep one of them"
    )
    with pytest.raises(SweepError, match=r"\(backbone.position.kind is inside backbone.position\)"):
        parse_grid(["backbone.position={kind: alibi}", "backbone.position.kind=rotary,none"])
    assert list(parse_grid(["train.lr=1e-3", "train.lr_min=1", "backbone.n_layers=1"])) == [
        "train.lr",
        "train.lr_min",
        "backbone.n_layers",
    ]  # a shared prefix that is not a dotted parent is fine


def test_sweep_refuses_run_names_longer_than_the_file_system_takes(tmp_path: Path) -> None:
    """A long grid value (a list, a dict, a long number) names run folders and logs longer than 255
    bytes: the sweep stopped with an ``OSError: File name too long`` traceback."""
    from rl_tformers.runtime.sweep import SweepError, expand

    out = tmp_path / "sw"
    value = "0." + "1" * 240
    res = _sweep("--grid", f"train.lr={value},0.2", "--out", str(out), "train.steps=2")
    assert res.exit_code == 2, res.output
    log = f"lr={value}_seed0.parts.jsonl"
    assert res.output == (
        f"error: --grid: the point (train.lr={value}) names its runs' files after its values, and its log "
        f"logs/{log[:60]}...{log[-17:]} would be 263 bytes long, more than the 255 bytes a file name may have "
        f"here; give shorter values (or sweep fewer keys at once)\n"
    )
    assert not out.exists()
    ok = "0." + "1" * 232  # lr=<234 characters>_seed0.parts.jsonl: 255 bytes
    assert len(expand({"train.lr": [ok]}, [0], out)) == 1
    with pytest.raises(SweepError, match="256 bytes long"):
        expand({"train.lr": [ok]}, [10], out)  # the longest seed counts


def test_sweep_out_problems_are_errors_not_tracebacks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--out ""`` (an unset shell variable) was read as '.', a sweep into the current folder;
    an --out name too long for the file system stopped with an OSError traceback."""
    monkeypatch.chdir(tmp_path)
    res = _sweep("--grid", "train.lr=1e-3", "--out", "", "train.steps=2")
    assert res.exit_code == 2, res.output
    assert (
        res.output
        == "error: --out '' is empty; give the sweep folder (or leave --out out for runs/sweep-<time>)\n"
    )
    long = tmp_path / ("x" * 300)
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(long), "train.steps=2")
    assert res.exit_code == 2, res.output
    assert res.output == f"error: --out {long}: File name too long\n"
    assert list(tmp_path.iterdir()) == []


def test_sweep_refuses_gpus_per_run_that_would_be_ignored(tmp_path: Path) -> None:
    """``--gpus-per-run 1`` with the local launcher was silently ignored (Ray's num_gpus only)."""
    out = tmp_path / "sw"
    res = _sweep("--grid", "train.lr=1e-3", "--out", str(out), "--gpus-per-run", "1", "train.steps=2")
    assert res.exit_code == 2, res.output
    assert res.output == (
        "error: --gpus-per-run 1 is for --launcher ray (Ray's num_gpus per run); local runs take their device "
        "from --device (e.g. --device cuda, shared by the --jobs runs); drop --gpus-per-run, or add --launcher "
        "ray\n"
    )
    from rl_tformers.runtime.sweep import SweepError, sweep

    with pytest.raises(SweepError, match=r"^--gpus-per-run inf: give a finite number >= 0"):
        sweep("toy", {}, [0], out, launcher="ray", gpus_per_run=float("inf"))
    assert not out.exists()


def test_sweep_warns_about_completed_runs_that_did_not_log_the_summary_metric(tmp_path: Path) -> None:
    """A grid over datasets with and without reference returns: eval/normalized_score is the
    summary's metric, but the completed runs of the point without references never log it, and
    their point read ``0/2`` seeds with no word why (as if its runs had failed). The table holds
    exactly each run's last logged values."""
    from rl_tformers.runtime import sweep as sw

    out = tmp_path / "sw"
    runs = sw.expand({"dataset.path": ["hopper", "cartpole"]}, [0, 1], out)
    logged = {
        "path=hopper/seed0": {"eval/normalized_score": 41.5, "eval/return_mean": 1300.25},
        "path=hopper/seed1": {"eval/normalized_score": 43.5, "eval/return_mean": 1370.75},
        "path=cartpole/seed0": {"eval/return_mean": 200.0},
        "path=cartpole/seed1": {"eval/return_mean": 250.0},
    }
    for run in runs:
        run.run_dir.mkdir(parents=True)
        lines = [
            {"step": 5, "time": 1.0, "train/loss": 2.0, "eval/return_mean": -1.0},
            {"step": 10, "time": 2.0, "train/loss": 0.5, **logged[run.name]},
        ]
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    warnings: list[str] = []
    outcomes = {run.name: sw.RunOutcome("ok", 0, 3.0) for run in runs}
    res = sw.write_results(out, runs, outcomes, warn=warnings.append)
    assert res.metric == "eval/normalized_score"
    assert warnings == [
        "warning: eval/normalized_score: 2 completed runs did not log it (path=cartpole/seed0, path=cartpole/seed1); "
        "their grid points count only the runs that did (the seeds column)"
    ]
    assert [(s["point"], s["n"], s["of"], s["mean"]) for s in res.summary] == [
        ("dataset.path=hopper", 2, 2, 42.5),
        ("dataset.path=cartpole", 0, 2, None),
    ]
    table = json.loads((out / "results.json").read_text())["runs"]
    for row in table:
        assert row["step"] == 10 and row["train/loss"] == 0.5 and row["seconds"] == 3.0
        assert {k: row[k] for k in logged[row["run"]]} == logged[row["run"]]
        assert ("eval/normalized_score" in row) == ("hopper" in row["run"])
