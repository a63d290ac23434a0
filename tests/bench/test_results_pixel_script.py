"""scripts/results_pixel.sh end to end on a tiny budget: a MinAtar Breakout dataset -> the DT, BC
and %BC sweeps -> per-run JSON and curves -> the DT's return-conditioning sweep and figures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_pixel_row_runs_from_frames_to_the_json_and_the_figures(tmp_path: Path) -> None:
    """A random policy's 400 MinAtar Breakout steps stored under the recipe's dataset id; DT, BC
    and %BC for 20 updates with an evaluation every 10 (one seed), the DT's evaluation at two
    targets. The copied JSON holds each run's final raw return (MinAtar has no reference
    scores) and a curve with both evaluations; running it again skips the finished runs."""
    root = tmp_path / "data"
    r = CliRunner().invoke(app, ["collect", "--env", "MinAtar/Breakout-v1", "--policy", "random", "--steps", "400",
                                 "--dataset-id", "rlt/minatar-breakout/dqn-replay-v1", "--root", str(root),
                                 "--no-progress"])
    assert r.exit_code == 0, r.output
    doc = tmp_path / "doc"
    env = {**os.environ, "OUT": str(tmp_path / "runs"), "DOC": str(doc), "SEEDS": "0", "TARGETS": "0,5",
           "RLT": str(Path(sys.executable).parent / "rl-tformers"), "PY": sys.executable,
           "BUDGET": "train.steps=20 eval.every=10 eval.episodes=2 eval.n_envs=2 train.checkpoint_every=10 "
                     "train.warmup_steps=2 device=cpu",
           "EXTRA": f"dataset.root={root}"}
    results = []
    for _ in range(2):
        p = subprocess.run(["bash", str(REPO / "scripts/results_pixel.sh")], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        results.append({a: json.loads((doc / f"{a}-minatar-breakout.json").read_text()) for a in ("dt", "bc", "bc10")})
    for algo, res in results[0].items():
        assert res["metric"] == "eval/return_mean", algo
        (run,) = res["runs"]
        assert run["status"] == "ok" and run["step"] == 20 and run["eval/return_mean"] >= 0, algo
        curves = json.loads((doc / f"{algo}-minatar-breakout.curves.json").read_text())
        assert [c["steps"] for c in curves["points"].values()] == [[10, 20]], algo
    assert [r["status"] for res in results[1].values() for r in res["runs"]] == ["skipped"] * 3
    rtg = json.loads((doc / "dt-minatar-breakout-s0.rtg.json").read_text())
    assert [r["target_return"] for r in rtg["results"]] == [0.0, 5.0]
    assert all(len(r["returns"]) == 10 for r in rtg["results"])
    for name in ("rtg-minatar-breakout.png", "curves.png"):
        assert (doc / name).stat().st_size > 0, name


def _fake_rlt(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for rl-tformers that logs each call's arguments and writes the sweep's
    results.json, so the script's own logic runs in a second."""
    log = tmp_path / "calls.log"
    fake = tmp_path / "rlt"
    fake.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
if [ "$1" = sweep ]; then
  while [ $# -gt 0 ]; do [ "$1" = --out ] && {{ mkdir -p "$2"; echo '{{}}' > "$2/results.json"; }}; shift; done
fi
""")
    fake.chmod(0o755)
    return fake, log


def _run_script(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    fake, _ = _fake_rlt(tmp_path)
    full = {**os.environ, "OUT": str(tmp_path / "runs"), "DOC": str(tmp_path / "doc"), "RLT": str(fake),
            "PY": shutil.which("true"), **env}
    return subprocess.run(["bash", str(REPO / "scripts/results_pixel.sh")], env=full, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("targets", ["0,x", "0,5,", "0,,5", "nan"])
def test_targets_that_are_not_numbers_are_refused_before_any_training(tmp_path: Path, targets: str) -> None:
    p = _run_script(tmp_path, SEEDS="0", TARGETS=targets)
    assert p.returncode == 2
    assert p.stderr == (f"error: TARGETS='{targets}' is not a comma-separated list of numbers "
                        "(target returns, e.g. 0,2,4)\n")
    assert not (tmp_path / "calls.log").exists() and not (tmp_path / "doc").exists()


@pytest.mark.parametrize(("seeds", "first"), [("0", "0"), ("3,4", "3"), ("2-4", "2")])
def test_the_return_conditioning_sweep_evaluates_the_first_seed(tmp_path: Path, seeds: str, first: str) -> None:
    p = _run_script(tmp_path, SEEDS=seeds, TARGETS="0,-1.5,2e1")
    assert p.returncode == 0, p.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["sweep"] * 3 + ["eval", "plot"]
    assert all(f"--seeds {seeds} " in c for c in calls[:3])
    run = tmp_path / "runs" / "dt-minatar-breakout" / "base" / f"seed{first}"
    assert calls[3].startswith(f"eval {run} --targets 0,-1.5,2e1 ")
    assert calls[4].startswith(f"plot {run} --from-json ")
