"""``rl-tformers bench data --device-sampling``: host vs on-device sampling of the same batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_tformers.bench import data as bd
from rl_tformers.bench import data_device as bdd


def test_host_and_device_sampling_are_timed_on_equal_batches(tmp_path: Path):
    path = bd.write_synthetic_d4rl(tmp_path / "hopper-s.hdf5", 5000, ep_len=100, seed=1)
    rows = bdd.device_sampling(path, "cpu", batch_size=8, context_len=20, seq_len=8, burn_in=4, batches=3, repeats=2)
    assert [r["sampler"] for r in rows] == ["window (DT), K=20", "segment (GTrXL), burn-in 4 + 8"]
    for r in rows:
        assert r["equal"] is True and r["device"] == "cpu" and r["steps"] == 5000
        assert r["host_samples_per_s"] > 0 and r["ratio"] == r["device_samples_per_s"] / r["host_samples_per_s"]
    # observations (11 float32) + actions (3 float32) + rewards + returns-to-go (float32) per step; + 2 flags
    assert rows[0]["device_mib"] == pytest.approx(5000 * (11 + 3 + 1 + 1) * 4 / 2**20)
    assert rows[1]["device_mib"] == pytest.approx(5000 * ((11 + 3 + 1 + 1) * 4 + 2) / 2**20)
    table = bdd.markdown_rows(rows)
    assert table[0].startswith("| sampler | device | steps | batch | host samples/s | on-device samples/s |")
    assert len(table) == 4 and "| yes |" in table[2]
    json.dumps(rows)


def test_device_sampling_refuses_counts_below_one(tmp_path: Path):
    with pytest.raises(ValueError, match="batches=0"):
        bdd.device_sampling(tmp_path / "none.hdf5", "cpu", batch_size=8, context_len=20, seq_len=8, burn_in=4,
                            batches=0, repeats=1)


def test_the_device_sampling_mode_of_bench_data_writes_its_json(tmp_path: Path):
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    out = tmp_path / "d.json"
    r = CliRunner().invoke(app, ["bench", "data", "--device-sampling", "cpu", "--steps", "3000", "--batches", "2",
                                 "--repeats", "1", "--batch-size", "4", "--keep", str(tmp_path / "k"), "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["settings"]["device"] == "cpu" and data["settings"]["steps"] == 3000
    assert [row["equal"] for row in data["device_sampling"]] == [True, True]
    assert "loadavg_end" in data["machine"] and (tmp_path / "k" / "synthetic-hopper-3000.hdf5").exists()


@pytest.mark.parametrize("args, message", [
    (["--device-sampling", "tpu"], "--device-sampling 'tpu': use cpu or cuda"),
    (["--device-sampling", "cpu", "--repeats", "0"], None),  # Typer's own range check (min=1)
])
def test_the_device_sampling_mode_refuses_bad_options_before_any_work(args, message, monkeypatch):
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    monkeypatch.setattr(bdd, "device_sampling", lambda *a, **k: pytest.fail("measured despite a bad option"))
    r = CliRunner().invoke(app, ["bench", "data", *args])
    assert r.exit_code == 2, r.output
    if message:
        assert r.output.strip().splitlines()[-1].startswith(f"error: {message}"), r.output
