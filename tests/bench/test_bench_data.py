"""``rl-tformers bench data``: sampler vs training rates through the agents' own batches, and the
synthetic D4RL file and its load timings."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from rl_tformers.bench import data as bd


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
    s = bd.Settings(dataset=str(tiny_hdf5), batches=3, repeats=1, train_steps=1, skip_load=True)
    res = bd.run(s)
    assert [r["config"] for r in res.samplers] == ["dt/hopper_medium", "gtrxl/hopper_positions_bc"]
    assert res.samplers[0]["sampler"] == "window (DT), K=20"
    assert res.samplers[1]["sampler"] == "segment (GTrXL), burn-in 16 + 16"
    for r in res.samplers:
        assert r["sampler_samples_per_s"] > 0 and r["headroom"] == pytest.approx(
            r["sampler_samples_per_s"] / r["training_samples_per_s"])
    assert "| window (DT), K=20 | 64 |" in bd.markdown(res)
