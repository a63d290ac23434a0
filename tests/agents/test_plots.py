"""The return-conditioned rollout plot draws what the DT paper's figure shows (issue 5, item 4):
achieved against target return with the y = x line, the mean with its spread over episodes,
every episode's return, the dataset's best and mean returns, and per-episode traces of the
remaining return-to-go against the cumulative reward; and `rl-tformers plot` on a
return-conditioned GTrXL run (issue 6, item 6) writes it as for the DT."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from matplotlib import pyplot as plt  # noqa: E402
from rl_tformers.runtime.evaluation import TargetResult  # noqa: E402
from rl_tformers.runtime.plots import plot_return_conditioning  # noqa: E402


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
