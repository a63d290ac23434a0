"""scripts/bench_eval_malloc.sh: the same evaluation benchmark with glibc's allocator defaults and
with the settings of the rl-tformers command, in alternating processes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_eval_malloc.sh"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_each_process_records_the_allocator_setting_it_ran_with(tiny_hdf5, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RL_TFORMERS_MALLOC"))}
    env.update(RLT=str(Path(sys.executable).parent / "rl-tformers"), ROUNDS="1",
               ARGS=f"--dataset {tiny_hdf5} --episodes 2 --n-envs 2 --max-episode-steps 5 --train-updates 0")
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("== round 1:") == 2
    glibc = json.loads((tmp_path / "eval_glibc_r1.json").read_text())
    retained = json.loads((tmp_path / "eval_retained_r1.json").read_text())
    assert glibc["machine"]["malloc"] is None
    assert retained["machine"]["malloc"] == {"mmap_threshold": 32 * 2**20, "trim_threshold": 256 * 2**20}
    assert glibc["rollouts"][0]["lengths"] == retained["rollouts"][0]["lengths"]


def test_the_script_needs_an_output_folder():
    r = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "usage: scripts/bench_eval_malloc.sh OUT_DIR" in r.stderr


FORWARD_SCRIPT = SCRIPT.parent / "dt_forward_malloc.py"


def test_the_forward_script_alternates_the_two_settings_process_by_process(tmp_path):
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, str(FORWARD_SCRIPT), "--rounds", "1", "--reps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [x["malloc"] for x in res["rounds"]] == ["glibc", "retained"] and res["library"] == "mkl"
    assert all(set(x["ms_per_forward"]) == {"1", "10", "50"} and min(x["ms_per_forward"].values()) > 0
               for x in res["rounds"])
    assert r.stdout.splitlines()[0].startswith("round 1 glibc: N=1 ")
