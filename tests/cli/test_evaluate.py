"""rl-tformers eval (rl_tformers.cli.evaluate): targets, output files, JSON, refusals before evaluating."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app


def _eval(*args: str):
    return CliRunner().invoke(app, ["eval", *args, "--episodes", "1", "--envs", "1"])


@pytest.mark.parametrize(
    ("targets", "why"),
    [("10,10", "items 1 and 2"), ("5,10,1e1", "items 2 and 3: 10 and 1e1 are the same number")],
)
def test_eval_refuses_a_target_given_twice(dt_run: Path, no_evaluation, targets, why) -> None:  # noqa: F811
    """``eval --targets 10,10`` evaluated the same target twice on the same episodes."""
    res = _eval(str(dt_run), "--targets", targets)
    assert res.exit_code == 2, res.output
    assert res.output == (f"error: --targets {targets}: the target 10 is given twice ({why}); give each target "
                          f"once: each is evaluated on the same episodes (reset seeds)\n")
    assert no_evaluation == []


@pytest.mark.parametrize("out", ["ev.json/", "ev.json/.", "sub/.."])
def test_eval_refuses_an_out_that_names_a_directory(dt_run: Path, tmp_path: Path, no_evaluation, out) -> None:  # noqa: F811
    """``eval --out ev.json/`` wrote a file ``ev.json`` (a Path option drops the trailing '/')."""
    text = f"{tmp_path}/{out}"  # (tmp_path / out would drop the trailing '/' itself)
    res = _eval(str(dt_run), "--out", text)
    assert res.exit_code == 2, res.output
    assert res.output.startswith(f"error: --out {text} names a directory; give a file name, e.g. ")
    assert no_evaluation == [] and not (tmp_path / "ev.json").exists()
    res = _eval(str(dt_run), "--out", "")
    assert res.exit_code == 2 and res.output == "error: --out '' is empty; give a file name, e.g. eval.json\n"


def test_eval_out_is_written_where_given(dt_run: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "new" / "ev.json"
    res = _eval(str(dt_run), "--out", str(out), "--targets", "10")
    assert res.exit_code == 0, res.output
    assert out.is_file() and '"results"' in out.read_text()


def test_summary_of_a_policy_without_target_has_no_target_column() -> None:
    """``eval`` of a BC run printed ``target        -: return ...`` (fresh user 13)."""
    from rl_tformers.runtime.evaluation import TargetResult
    from rl_tformers.runtime.plots import summary_lines

    bc = TargetResult(target_return=None, returns=[1.0, 3.0], lengths=[5, 6], seeds=[0, 1])
    dt = TargetResult(target_return=3600.0, returns=[2.0], lengths=[5], seeds=[0])
    assert summary_lines([bc]) == ["return      2.00 +-     1.00 over 2 episodes"]
    assert summary_lines([dt]) == ["target     3600: return      2.00 +-     0.00 over 1 episode"]
