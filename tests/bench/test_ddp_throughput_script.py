"""scripts/ddp_throughput.sh end to end on a tiny model (slow: three trainings, one under torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_helpers import TINY

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ddp_throughput.sh"


@pytest.mark.slow
def test_ddp_throughput_script_measures_three_runs(tiny_hdf5, tmp_path):
    rlt = Path(sys.executable).parent / "rl-tformers"
    env = {**os.environ, "RLT": str(rlt)}
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "200", str(tiny_hdf5), *TINY, "train.warmup_steps=10"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "ddp_throughput.json").read_text())
    assert set(res["updates_per_s"]) == {"p1t1", "p1t2", "p2t1"}
    assert all(v > 0 for v in res["updates_per_s"].values())
    assert res["ratio_to_p1t1"]["p1t1"] == 1.0
    assert "p2t1:" in r.stdout
    # the DDP run really ran 2 processes and every run did all its updates
    assert "x 2 processes" in (tmp_path / "p2t1.log").read_text()
    for name in ("p1t1", "p1t2", "p2t1"):
        steps = [json.loads(line)["step"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert max(steps) == 200, name


def test_ddp_throughput_script_parses_and_explains_itself():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    for flag in ("-h", "--help"):
        r = subprocess.run(["bash", str(SCRIPT), flag], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "Usage: scripts/ddp_throughput.sh OUT_DIR" in r.stdout, r.stderr
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage:" in r.stderr
