"""The rl-tformers command line as a whole (rl_tformers.cli): help layout, paths given to eval, interrupted demo."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()


def _commands(cmd, path=()):
    yield path, cmd
    for name, sub in getattr(cmd, "commands", {}).items():
        yield from _commands(sub, (*path, name))


# ------------------------------------------------------------------- help text broken mid-sentence
def test_no_help_paragraph_is_broken_mid_sentence() -> None:
    """Typer keeps the single line breaks of a docstring paragraph, so a paragraph wrapped in the
    source is broken at that place on screen (`rl-tformers dataset info --help` would print "...
    is also compared with it: a" and "per-step observation shape ..." on the next line).
    Every prose paragraph of every command's help must be one line (indented example lines and
    \\b blocks may keep theirs)."""
    broken = []
    for path, cmd in _commands(typer.main.get_command(app)):
        text = inspect.cleandoc(cmd.help or "").partition("\f")[0]
        for par in text.split("\n\n"):
            lines = par.split("\n")
            if len(lines) > 1 and not par.startswith("\b") and not any(ln.startswith(" ") for ln in lines):
                broken.append((" ".join(path) or "rl-tformers", lines[0]))
    assert broken == []


def test_the_backbones_line_of_the_main_help_is_not_cut() -> None:
    r = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    line = next(ln for ln in r.output.splitlines() if " backbones " in ln)
    assert "capabilities, fields (with their defaults)." in line


# ------------------------------------------------------------------- an interrupted demo
def test_interrupted_demo_says_how_to_get_its_evaluation_and_plot(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`make demo` stopped with Ctrl-C says how to get its evaluation and plot: "rl-tformers train
    --resume RUN" alone trains the remaining updates silently (the demo's run has
    train.progress=false and eval.at_end=false) and ends without them."""
    from types import SimpleNamespace

    from rl_tformers.agents.common import demo

    monkeypatch.setattr(demo, "train", lambda cfg, run_dir, **kw: SimpleNamespace(interrupted=2, step=139))
    run = tmp_path / "demo"
    with pytest.raises(InterruptedError) as exc:
        demo.run_demo(out_dir=run, n_episodes=3, eval_episodes=4, echo=lambda s: None)
    assert str(exc.value) == (
        f"training stopped by signal 2 at update 139; continue it with: rl-tformers train --resume {run} (it trains "
        f"only: the demo's evaluation and plot are then rl-tformers eval {run} --seed 1000 --episodes 4 and "
        f"rl-tformers plot {run} --targets 50,140,230,320,410,500 --seed 1000 --episodes 4 "
        f"--out {run / 'return_conditioning.png'})")


# ------------------------------------------------------------------- option help cut with an ellipsis
def test_no_option_help_is_cut_with_an_ellipsis_on_an_80_column_terminal() -> None:
    """On an 80-column terminal no option help is cut: Rich cuts a word longer than the help
    column instead of wrapping it (e.g. "DT with backbone.depth.kind=ea…", "(default:
    agent.early_exit.thres…"), so such words must not be in the help."""
    cut = {}
    for path, _ in _commands(typer.main.get_command(app)):
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"})
        assert r.exit_code == 0, (path, r.output)
        lines = [ln for ln in r.output.splitlines() if "\u2026" in ln]
        if lines:
            cut[" ".join(path)] = lines
    assert cut == {}
