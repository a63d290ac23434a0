"""Faults the lead found in session 13 (from breaker 13's notes on ``eval``); each test fails
without its fix. Tiny runs only (the 2-update DT of the breaker-13 tools tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rl_tformers.agents.decision_transformer.config import DTAgentConfig
from typer.testing import CliRunner

from rl_tformers.cli import app
from tests.regressions.test_found_by_breaker_13_tools import dt_run, no_evaluation  # noqa: F401 (fixtures)


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


def test_agent_targets_given_twice_are_refused() -> None:
    """``agent.targets=[100, 100.0]`` evaluated, logged and plotted one target twice."""
    def targets(value):
        return DTAgentConfig.from_dict({"targets": value}, where="agent").targets

    assert targets([100, 50]) == (100.0, 50.0) and targets(3600) == (3600.0,)
    with pytest.raises(ValueError, match=r"^agent.targets: the target 100 is given twice \(items 1 and 3\); give each "
                                         r"target once"):
        targets([100, 50, 1e2])
    with pytest.raises(ValueError, match=r"the target 0 is given twice \(items 1 and 2"):
        targets([0.0, -0.0])


def test_resumed_window_splits_the_saved_samples_over_the_new_ranks() -> None:
    """Resuming a 2-process run in 1 process (or 1 in 2) counted the saved window's samples
    ``new / saved`` times: ``perf/samples_per_s`` of the first window was off by that factor."""
    import torch

    from rl_tformers.runtime.trainer import MetricWindow

    ranks = []
    for loss in (1.0, 3.0):
        w = MetricWindow()
        w.add({"loss": torch.tensor(loss)}, samples=4)  # 8 samples in all
        ranks.append(w.state_dict())
    mean = MetricWindow.mean_state(ranks)
    for new in (1, 2, 4):
        parts = [MetricWindow() for _ in range(new)]
        for p in parts:
            p.load_state_dict(MetricWindow.for_ranks(mean, 2, new), torch.device("cpu"))
        assert sum(p.samples for p in parts) == 8.0  # what reduce sums over the new ranks
        assert parts[0].means() == {"loss": 2.0}
    one = MetricWindow()
    one.add({"loss": torch.tensor(1.0)}, samples=6)  # a one-process run's own window
    two = [MetricWindow.for_ranks(one.state_dict(), 1, 2)["samples"] for _ in range(2)]
    assert sum(two) == 6.0


def test_summary_of_a_policy_without_target_has_no_target_column() -> None:
    """``eval`` of a BC run printed ``target        -: return ...`` (fresh user 13)."""
    from rl_tformers.runtime.evaluation import TargetResult
    from rl_tformers.runtime.plots import summary_lines

    bc = TargetResult(target_return=None, returns=[1.0, 3.0], lengths=[5, 6], seeds=[0, 1])
    dt = TargetResult(target_return=3600.0, returns=[2.0], lengths=[5], seeds=[0])
    assert summary_lines([bc]) == ["return      2.00 +-     1.00 over 2 episodes"]
    assert summary_lines([dt]) == ["target     3600: return      2.00 +-     0.00 over 1 episode"]
