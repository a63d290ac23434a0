"""One exit-code convention across the rl-tformers commands (rl_tformers.cli): bad input exits 2
after exactly one ``error: ...`` line on stderr, naming what is at fault."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()


def _leaf_commands(cmd=None, path=()):
    """Every command path that runs something (``("dataset", "info")``, ``("train",)``...)."""
    cmd = typer.main.get_command(app) if cmd is None else cmd
    subs = getattr(cmd, "commands", None)
    if not subs:
        yield path
        return
    for name, sub in sorted(subs.items()):
        yield from _leaf_commands(sub, (*path, name))


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _bad_inputs(tmp: Path) -> dict[str, list[str]]:
    """One bad input per command, refused by the command's own checks (not only by Typer's)."""
    return {
        "train": ["train", "-c", "toy", "train.lrr=1"],
        "train-config": ["train", "-c", "no_such_config"],
        "eval": ["eval", str(tmp / "no_run")],
        "plot": ["plot", str(tmp / "no_run"), "--out", str(tmp / "fig.png")],
        "dataset info": ["dataset", "info", str(tmp / "missing.hdf5")],
        "dataset export": ["dataset", "export", str(tmp / "missing.hdf5"), str(tmp / "out.hdf5")],
        "collect": ["collect", "--recipe", "pong-*"],
        "collect-env": ["collect", "--env", "NoSuchEnv-v0", "--root", str(tmp / "data"), "--no-progress"],
        "sweep": ["sweep", "-c", "toy", "--grid", "train.steps=1,2", "--seeds", "x"],
        "backbones": ["backbones", "--slot", "nope"],
        "agents": ["agents", "no_such_agent"],
        "configs": ["configs", "no_such_group/*"],
        "bench": ["bench", "attention", "--lengths", "x"],
        "demo": ["demo", "--episodes", "0"],
        "export": ["export", str(tmp / "no_run"), "--format", "onnx", "--out", str(tmp / "policy")],
    }


@pytest.mark.parametrize("name", list(_bad_inputs(Path("."))))
def test_bad_input_exits_2_with_one_error_line(tmp_path: Path, monkeypatch, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, _bad_inputs(tmp_path)[name])
    assert r.exit_code == 2, r.output
    assert len(_error_lines(r.stderr)) == 1, r.stderr
    assert "Traceback" not in r.output and r.stdout == "", r.output


def test_every_command_has_a_bad_input_above() -> None:
    """A new command (or sub-command of ``dataset``) gets its bad input in :func:`_bad_inputs`."""
    covered = {" ".join(args[:2]) if args[0] == "dataset" else args[0] for args in _bad_inputs(Path(".")).values()}
    commands = {" ".join(path[:2]) if path[0] == "dataset" else path[0] for path in _leaf_commands()}
    assert commands - covered == set()


@pytest.mark.parametrize("path", list(_leaf_commands()), ids=lambda p: " ".join(p))
def test_an_unknown_option_exits_2_with_one_error_line_naming_it(path: tuple[str, ...]) -> None:
    """click's usage errors print one line (not its usage block and boxed message) that names
    the option and the command whose --help lists the right ones."""
    r = runner.invoke(app, [*path, "--zzzz"])
    assert r.exit_code == 2, r.output
    assert _error_lines(r.stderr) == [
        f"error: No such option: --zzzz (see: rl-tformers {' '.join(path)} --help)"], r.stderr
    assert r.stderr.count("\n") == 1 and r.stdout == ""


def test_a_missing_argument_and_an_unknown_command_are_one_line() -> None:
    r = runner.invoke(app, ["eval"])
    assert (r.exit_code, r.stderr) == (2, "error: Missing argument 'run_dir'. (see: rl-tformers eval --help)\n")
    r = runner.invoke(app, ["evaluate"])
    assert r.exit_code == 2 and r.stderr.startswith("error: No such command 'evaluate'.")
    assert r.stderr.count("\n") == 1


def test_a_bad_parameter_raised_by_a_command_is_one_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["collect", "--env", "CartPole-v1", "--episodes", "1", "--noise", "-1",
                            "--root", str(tmp_path), "--no-progress"])
    assert r.exit_code == 2
    assert r.stderr == ("error: Invalid value for --noise: --noise must be a finite number >= 0 (a std in units of "
                        "half the action range), got -1.0 (see: rl-tformers collect --help)\n")


def test_a_command_group_without_a_subcommand_shows_its_help() -> None:
    r = runner.invoke(app, ["dataset"])
    assert "Usage: rl-tformers dataset" in r.output and "error:" not in r.output


def test_a_demo_run_directory_that_is_a_file_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_text("x")
    r = runner.invoke(app, ["demo", "--out-dir", str(blocker)])
    assert (r.exit_code, r.stderr) == (2, f"error: --out-dir {blocker} is a file; give the run directory to create "
                                          f"(e.g. runs/demo)\n")
    r = runner.invoke(app, ["demo", "--out-dir", str(blocker / "run")])
    assert (r.exit_code, r.stderr) == (2, f"error: --out-dir {blocker / 'run'}: {blocker} is a file, not a directory\n")
    assert blocker.read_text() == "x"
