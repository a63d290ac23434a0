"""``rl-tformers bench minari``: the synthetic many-episode Minari dataset and the three readers,
each reported against Minari's own sampling measured in the same run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from rl_tformers.envs.loaders import open_minari
from typer.testing import CliRunner

from rl_tformers.bench import minari_sampling as bm
from rl_tformers.cli import app
from tests.runs import tripwire


def test_synthetic_dataset_holds_the_episodes_asked_for(tmp_path):
    path = bm.write_synthetic_minari(tmp_path, 7, 4, seed=2)
    eps = open_minari(path)
    assert (eps.num_episodes, eps.num_steps) == (7, 28)
    ds = eps.load()
    assert ds.lengths.tolist() == [4] * 7 and ds.observation_shape == (11,) and ds.action_shape == (3,)
    assert ds.truncations[ds.starts + 3].all() and not ds.terminations.any()


def test_bench_minari_reports_each_reader_against_minaris_own(tmp_path):
    out = tmp_path / "r.json"
    res = CliRunner().invoke(app, ["bench", "minari", "--episodes", "12", "--episode-len", "3", "--sample", "4",
                                   "--repeats", "2", "--keep", str(tmp_path / "keep"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["reader"] for r in rows] == ["minari sample_episodes", "ours, lazy (open_minari)",
                                           "ours, full read (load_minari)"]
    assert [r["repeats"] for r in rows] == [2, 2, 1]
    assert rows[0]["ratio_to_minari"] == 1.0
    for r in rows:
        assert r["seconds"] > 0 and np.isclose(r["ratio_to_minari"], r["seconds"] / rows[0]["seconds"])
    assert (tmp_path / "keep" / "synthetic-12x3" / bm.DATASET_ID / "data" / "metadata.json").is_file()
    assert "| ours, lazy (open_minari) |" in res.output


def test_bench_minari_refuses_a_sample_larger_than_the_dataset():
    res = CliRunner().invoke(app, ["bench", "minari", "--episodes", "3", "--sample", "4"])
    assert res.exit_code == 2
    assert "error: --sample 4 is more than --episodes 3" in res.output


@pytest.mark.parametrize(("args", "said"), [
    (["--seed", "-1"], "error: --seed must be >= 0 (it seeds numpy's generator), got -1\n"),
    (["--keep", ""], "error: --keep is empty; give a folder to keep the synthetic dataset in, or leave the option "
                     "out\n"),
    (["--episodes", "1000000000", "--episode-len", "1000000000", "--sample", "1"],
     "error: --episodes 1000000000 x --episode-len 1000000000: the synthetic dataset holds 1.02e+11 GiB (110 bytes "
     "a step) and the command holds about 3 copies of it, more than the 16 GiB of this machine; lower --episodes "
     "or --episode-len\n"),
])
def test_bench_minari_refuses_settings_that_cannot_run_before_writing_anything(monkeypatch, args, said):
    monkeypatch.setattr(bm, "_physical_memory_bytes", lambda: 16 * 2**30)
    monkeypatch.setattr(bm, "write_synthetic_minari", tripwire)
    res = CliRunner().invoke(app, ["bench", "minari", *args])
    assert res.exit_code == 2 and res.stderr == said, res.output
