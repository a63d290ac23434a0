"""``rl-tformers bench data``: sampler vs training rates through the agents' own batches, and the
synthetic D4RL file and its load timings."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from rl_tformers.bench import data as bd
from rl_tformers.cli import app
from tests.runs import tripwire


def test_synthetic_d4rl_file_loads_with_its_episodes(tmp_path):
    path = bd.write_synthetic_d4rl(tmp_path / "s.hdf5", 5000, ep_len=100, seed=1)
    with h5py.File(path) as f:
        flags = np.asarray(f["terminals"]) | np.asarray(f["timeouts"])
        assert f["observations"].shape == (5000, 11) and f["next_observations"].shape == (5000, 11)
        assert f["actions"].shape == (5000, 3) and flags[-1]
        assert not (np.asarray(f["terminals"]) & np.asarray(f["timeouts"])).any()
    rows = bd.load_times(path, bd.Settings())
    assert [r["mode"] for r in rows] == ["eager", "lazy"]
    for r in rows:
        assert r["steps"] == 5000 and r["episodes"] == int(flags.sum())
        assert 0 < r["load_s"] <= r["first_batch_s"]


def test_samplers_against_their_trainers(tiny_hdf5):
    s = bd.Settings(dataset=str(tiny_hdf5), batches=3, repeats=1, train_steps=1, skip_load=True, skip_pixels=True)
    res = bd.run(s)
    assert [r["config"] for r in res.samplers] == ["dt/hopper_medium", "gtrxl/hopper_positions_bc"]
    assert res.samplers[0]["sampler"] == "window (DT), K=20"
    assert res.samplers[1]["sampler"] == "segment (GTrXL), burn-in 16 + 16"
    for r in res.samplers:
        assert r["sampler_samples_per_s"] > 0 and r["headroom"] == pytest.approx(
            r["sampler_samples_per_s"] / r["training_samples_per_s"])
    assert "| window (DT), K=20 | 64 |" in bd.markdown(res)


runner = CliRunner()


def test_the_pixel_part_holds_each_frame_once_and_samples_uint8_stacks(tmp_path, monkeypatch) -> None:
    """Part 3 alone (``--pixels-only``) on 3000 synthetic frames: the frames' bytes once in
    memory, (B, K, 4, 84, 84) uint8 batches, a headroom over the Nature CNN's rate."""
    monkeypatch.setattr(bd, "build_trainer", tripwire)  # parts 1 and 2 do not run
    r = runner.invoke(app, ["bench", "data", "--pixels-only", "--pixel-steps", "3000", "--pixel-context", "5",
                            "--batch-size", "4", "--batches", "2", "--repeats", "1", "--train-steps", "1",
                            "--keep", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["pixels"]
    assert (p["steps"], p["frame_shape"], p["observation_shape"], p["frame_stack"]) == (3000, [1, 84, 84], [4, 84, 84], 4)
    assert p["observation_dtype"] == "uint8" and p["memory_ratio"] == 1.0 and p["frames_mib"] == 3000 * 84 * 84 / 2**20
    assert p["load_peak_ratio"] < 1.5  # no stacked, float or second copy while loading
    window, segment = p["samplers"]
    assert window["batch_observations"] == [4, 5, 4, 84, 84] and segment["batch_observations"] == [4, 64, 4, 84, 84]
    for row in (window, segment):
        assert row["batch_dtype"] == "uint8" and row["headroom"] == pytest.approx(
            row["sampler_samples_per_s"] / row["encoder_samples_per_s"])
    with h5py.File(tmp_path / "synthetic-frames-3000.hdf5") as f:
        assert f["observations"].dtype == np.uint8 and f["observations"].shape == (3000, 1, 84, 84)


# ------------------------------------------------------------- bench data / bench eval options
@pytest.mark.parametrize("args, option", [
    (["--train-steps", "0"], "--train-steps"), (["--train-steps", "-1"], "--train-steps"),
    (["--batches", "0"], "--batches"), (["--batches", "-1"], "--batches"),
    (["--batch-size", "0"], "--batch-size"), (["--steps", "0"], "--steps"), (["--steps", "-5"], "--steps"),
    (["--repeats", "0"], "--repeats"), (["--repeats", "-2"], "--repeats"),
    (["--threads", "0"], "--threads"), (["--threads", "-1"], "--threads"),
])
def test_bench_data_counts_are_checked_before_any_work(monkeypatch, args: list[str], option: str) -> None:
    from rl_tformers.bench import data as bd

    monkeypatch.setattr(bd, "run", tripwire)
    r = runner.invoke(app, ["bench", "data", *args])
    assert r.exit_code == 2 and option in r.output, r.output


def test_bench_data_settings_are_checked_in_python_too(monkeypatch) -> None:
    from rl_tformers.bench import data as bd

    monkeypatch.setattr(bd, "build_trainer", tripwire)
    with pytest.raises(ValueError, match=r"^--train-steps must be >= 1, got 0$"):
        bd.run(bd.Settings(train_steps=0))
    with pytest.raises(ValueError, match=r"^--batches must be >= 1, got -1$"):
        bd.run(bd.Settings(batches=-1))


def test_bench_data_keep_and_out_paths_are_checked_first(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.bench import data as bd

    monkeypatch.setattr(bd, "run", tripwire)
    (tmp_path / "afile").write_text("hi")
    r = runner.invoke(app, ["bench", "data", "--keep", str(tmp_path / "afile")])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --keep {tmp_path / 'afile'} is a file")
    r = runner.invoke(app, ["bench", "data", "--out", str(tmp_path)])
    assert r.exit_code == 2 and r.stderr.startswith(f"error: --out {tmp_path} is a directory")
