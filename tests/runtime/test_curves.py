"""Learning curves of runs and of sweep grid points (rl_tformers.runtime.curves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_tformers.runtime.curves import mean_curve, plot_curve_panels, point_curves, read_curves, run_curve
from rl_tformers.runtime.sweep import SweepRun, _write_learning_curves


def test_a_run_curve_is_the_metric_by_step_keeping_the_last_value_of_a_repeated_step():
    records = [{"step": 0, "train/loss": 1.0}, {"step": 2000, "eval/score": 10.0},
               {"step": 4000, "eval/score": None}, {"step": 4000, "eval/score": 12.5},
               {"step": 6000, "eval/score": float("nan")}, {"step": 2000, "eval/score": 11.0}]
    assert run_curve(records, "eval/score") == [(2000, 11.0), (4000, 12.5)]


def test_the_mean_curve_keeps_only_steps_every_seed_logged():
    c = mean_curve([[(2, 1.0), (4, 3.0), (6, 5.0)], [(2, 3.0), (4, 5.0)]])
    assert c == {"steps": [2, 4], "mean": [2.0, 4.0], "std": [1.0, 1.0], "n": 2}
    assert mean_curve([]) == {"steps": [], "mean": [], "std": [], "n": 0}
    assert point_curves({"a": [[], []], "b": [[(1, 2.0)]]}) == {"b": {"steps": [1], "mean": [2.0], "std": [0.0], "n": 1}}


def _run(tmp: Path, point: str, seed: int, values: list[float]) -> SweepRun:
    run_dir = tmp / point / f"seed{seed}"
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": 1000 * (i + 1), "eval/normalized_score": v}) for i, v in enumerate(values)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return SweepRun(f"{point}/seed{seed}", {"agent.x": point}, seed, (), run_dir)


def test_a_sweep_writes_the_curves_of_its_points(tmp_path: Path):
    runs = [_run(tmp_path, "a", 0, [10.0, 20.0]), _run(tmp_path, "a", 1, [30.0, 40.0]), _run(tmp_path, "b", 0, [5.0])]
    files = _write_learning_curves(tmp_path, runs, "eval/normalized_score")
    assert files == [str(tmp_path / "curves.json"), str(tmp_path / "curves.png")]
    metric, points = read_curves(tmp_path / "curves.json")
    assert metric == "eval/normalized_score"
    assert points["agent.x=a"] == {"steps": [1000, 2000], "mean": [20.0, 30.0], "std": [10.0, 10.0], "n": 2}
    assert points["agent.x=b"]["steps"] == [1000]
    assert (tmp_path / "curves.png").stat().st_size > 0
    # one evaluation per run is no curve: the files of an earlier call are removed
    assert _write_learning_curves(tmp_path, runs[2:], "eval/normalized_score") == []
    assert not (tmp_path / "curves.json").exists() and not (tmp_path / "curves.png").exists()


def test_a_stopped_seed_does_not_cut_the_curve_of_its_completed_seeds(tmp_path: Path):
    """A grid point with completed runs counts those only (as the summary does); a point with
    none shows its runs so far."""
    runs = [_run(tmp_path, "a", 0, [10.0, 20.0, 30.0]), _run(tmp_path, "a", 1, [30.0, 40.0, 50.0]),
            _run(tmp_path, "a", 2, [5.0]), _run(tmp_path, "b", 0, [1.0, 2.0]), _run(tmp_path, "b", 1, [3.0, 4.0])]
    _write_learning_curves(tmp_path, runs, "eval/normalized_score", done={"a/seed0", "a/seed1"})
    _, points = read_curves(tmp_path / "curves.json")
    assert points["agent.x=a"] == {"steps": [1000, 2000, 3000], "mean": [20.0, 30.0, 40.0], "std": [10.0, 10.0, 10.0],
                                   "n": 2}
    assert points["agent.x=b"] == {"steps": [1000, 2000], "mean": [2.0, 3.0], "std": [1.0, 1.0], "n": 2}


def test_a_file_that_is_not_a_curves_json_is_named_in_the_error(tmp_path: Path):
    bad = tmp_path / "curves.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match=rf"^{bad}: not a curves.json written by rl-tformers sweep"):
        read_curves(bad)


def test_a_label_has_the_same_colour_in_every_panel(tmp_path: Path, monkeypatch):
    """A label missing from the first panel still gets its own colour, the one it has elsewhere."""
    import matplotlib.figure

    curve = {"steps": [1, 2], "mean": [0.0, 1.0], "std": [0.0, 0.0], "n": 1}
    seen: dict[str, set[str]] = {}
    save = matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        for ax in fig.axes:
            for line in ax.get_lines():
                seen.setdefault(line.get_label(), set()).add(line.get_color())
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    plot_curve_panels({"a": {"DT": curve, "CQL": curve}, "b": {"IQL": curve, "CQL": curve}}, "score",
                      tmp_path / "c.png")
    assert {k: len(v) for k, v in seen.items()} == {"DT (n=1)": 1, "CQL (n=1)": 1, "IQL (n=1)": 1}
    assert len(set.union(*seen.values())) == 3
