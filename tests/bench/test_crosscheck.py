"""The d3rlpy cross-check's plumbing in our environment (rl_tformers.bench.crosscheck): the .npz
export is the dataset, step for step, and the summary's arithmetic. The end-to-end worker run
needs the peers' environment (d3rlpy, MuJoCo) and is skipped without it."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.loaders import load_dataset

from rl_tformers.bench import crosscheck as cc
from rl_tformers.bench.train import default_peer_python


def _check_export(ds: EpisodeDataset, path) -> None:
    info = cc.export_dataset(ds, path)
    data = np.load(path)
    assert sorted(data.files) == ["actions", "observations", "rewards", "terminals", "timeouts"]
    eps = list(ds)  # episode-table order
    np.testing.assert_array_equal(data["observations"], np.concatenate([e.observations for e in eps]).astype(np.float32))
    np.testing.assert_array_equal(data["actions"], np.concatenate([e.actions for e in eps]).astype(np.float32))
    np.testing.assert_array_equal(data["rewards"], np.concatenate([e.rewards for e in eps]).astype(np.float32))
    np.testing.assert_array_equal(data["terminals"], np.concatenate([e.terminations for e in eps]))
    ends = np.flatnonzero(data["terminals"] | data["timeouts"])
    assert list(ends) == list(np.cumsum(ds.lengths) - 1)  # one flag per episode, at its last step (d3rlpy's split)
    # read back the D4RL way, the episodes are the dataset's
    back = EpisodeDataset.from_flags(data["observations"], data["actions"], data["rewards"], data["terminals"], data["timeouts"])
    np.testing.assert_array_equal(back.lengths, ds.lengths)
    np.testing.assert_allclose(back.episode_returns, ds.episode_returns, rtol=1e-5)
    assert info == {"steps": ds.num_steps, "episodes": ds.num_episodes,
                    "top_return": pytest.approx(float(np.max(ds.episode_returns))),
                    "mean_return": pytest.approx(float(np.mean(ds.episode_returns)))}


def test_export_matches_the_dataset(tiny_hdf5, tmp_path):
    ds = load_dataset(tiny_hdf5)
    assert ds.num_episodes > 3 and ds.terminations.any()  # some early terminations, some timeouts
    _check_export(ds, tmp_path / "all.npz")
    # a selection in another order (non-contiguous episode table): exported in table order
    sel = ds.select(np.array([3, 0, 2]))
    assert not sel.is_contiguous()
    _check_export(sel, tmp_path / "sel.npz")


def test_summary_rows():
    runs = [
        {"algo": "dt", "seed": 1, "results": [{"target": 3559.0, "returns": [1000.0, 2000.0]}]},
        {"algo": "dt", "seed": 0, "results": [{"target": 3559.0, "returns": [500.0, 500.0]}]},
        {"algo": "bc", "seed": 0, "results": [{"target": None, "returns": [100.0]}]},
    ]
    rows = cc.summarise(runs, (0.0, 1000.0))
    dt = next(r for r in rows if r["algo"] == "dt")
    assert dt["seeds"] == [0, 1] and dt["per_seed_return"] == [500.0, 1500.0]
    assert dt["per_seed_normalised"] == [50.0, 150.0]
    assert dt["normalised_mean"] == 100.0 and dt["normalised_std"] == 50.0  # population std over seeds
    bc = next(r for r in rows if r["algo"] == "bc")
    assert bc["target"] is None and bc["normalised_mean"] == 10.0


def _peers_with_mujoco() -> str | None:
    py = default_peer_python()
    if not py:
        return None
    ok = subprocess.run([py, "-c", "import d3rlpy, mujoco"], capture_output=True).returncode == 0
    return py if ok else None


@pytest.mark.slow
@pytest.mark.skipif(_peers_with_mujoco() is None,
                    reason="needs the peers' environment with d3rlpy and MuJoCo (rl-tformers bench train --build-peers)")
def test_worker_end_to_end(tiny_hdf5, tmp_path):
    out = tmp_path / "out.json"
    rc = cc.main(["--dataset", str(tiny_hdf5), "--seeds", "0", "--steps", "5", "--episodes", "2",
                  "--extra-targets", "3300", "--work", str(tmp_path / "work"), "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["d3rlpy_version"].startswith("2.8")
    rows = {(r["algo"], r["target"]) for r in res["rows"]}
    assert rows == {("dt", res["targets"][0]), ("dt", 3300.0), ("bc", None)}
    for run in res["runs"]:
        assert run["reset_seeds"] == [0, 1] and all(len(r["returns"]) == 2 for r in run["results"])
