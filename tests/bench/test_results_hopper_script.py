"""scripts/results_hopper.sh end to end on a tiny budget: recipe -> sweeps -> per-run JSON and curves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_short_results_row_runs_from_the_recipe_to_the_json_and_the_figure(shared_dir, tmp_path: Path) -> None:
    """The pipeline of the converged Hopper table, shortened: the version 1 medium-expert recipe
    at 600 steps per policy, DT, BC and %BC for 30 updates with an evaluation every 15 (one
    seed), then the copied JSON and the curves figure. Running it again skips the finished runs
    and gives the same results."""
    root = tmp_path / "data"
    r = CliRunner().invoke(app, ["collect", "--recipe", "hopper-medium-expert", "--recipe-steps", "600", "--root",
                                 str(root), "--no-progress", "--policies", str(shared_dir / "policies")])
    assert r.exit_code == 0, r.output
    env = {**os.environ, "OUT": str(tmp_path / "runs"), "DOC": str(tmp_path / "doc"), "SEEDS": "0", "PEERS": "0",
           "RLT": str(Path(sys.executable).parent / "rl-tformers"), "PY": sys.executable,
           "BUDGET": "train.steps=30 eval.every=15 eval.episodes=2 eval.n_envs=2 train.checkpoint_every=15 device=cpu",
           "EXTRA": f"dataset.root={root} backbone.d_model=16 backbone.n_layers=1 train.warmup_steps=2"}
    runs = []
    for _ in range(2):
        p = subprocess.run(["bash", str(REPO / "scripts/results_hopper.sh"), "medium-expert"], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append({a: json.loads((tmp_path / "doc" / f"{a}-hopper-medium-expert.json").read_text())
                     for a in ("dt", "bc", "bc10")})
    for algo, res in runs[0].items():
        (run,) = res["runs"]
        assert run["status"] == "ok" and run["step"] == 30 and "eval/normalized_score" in run, algo
        curves = json.loads((tmp_path / "doc" / f"{algo}-hopper-medium-expert.curves.json").read_text())
        assert [c["steps"] for c in curves["points"].values()] == [[15, 30]], algo
    assert [r["status"] for res in runs[1].values() for r in res["runs"]] == ["skipped"] * 3
    assert {a: res["runs"][0]["eval/normalized_score"] for a, res in runs[1].items()} == \
        {a: res["runs"][0]["eval/normalized_score"] for a, res in runs[0].items()}
    assert (tmp_path / "doc" / "curves.png").stat().st_size > 0
