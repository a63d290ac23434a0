"""scripts/results_mujoco.sh end to end on a tiny budget: recipe -> sweeps -> per-run JSON and curves; the table and the figure scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from tests.scripts import script_module

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
        p = subprocess.run(["bash", str(REPO / "scripts/results_mujoco.sh"), "medium-expert"], env=env, cwd=REPO,
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


def test_the_results_table_reads_sweeps_evaluations_and_peers(tmp_path: Path) -> None:
    """scripts/results_table.py: a sweep's completed runs, else per-run evaluations, and the
    d3rlpy cross-check, as mean ± std (ddof 0) with each seed's score, and the mean training
    minutes per run of the runs that recorded their time."""
    results_table = script_module("results_table")
    runs = [{"seed": 1, "status": "ok", "eval/normalized_score": 30.0, "seconds": 150.0},
            {"seed": 0, "status": "skipped", "eval/normalized_score": 10.0, "seconds": 90.0},
            {"seed": 2, "status": "failed", "eval/normalized_score": 99.0}]
    (tmp_path / "bc-hopper-medium.json").write_text(json.dumps({"runs": runs}))
    (tmp_path / "dt-hopper-medium-s0.eval.json").write_text(json.dumps({"results": [{"normalized_score": 68.25}]}))
    (tmp_path / "peers-hopper-medium.json").write_text(json.dumps(
        {"rows": [{"algo": "iql", "per_seed_normalised": [50.0, 52.0]}]}))
    assert results_table.table(tmp_path).splitlines()[2] == (
        "| hopper-medium | 68.2 ± 0.0 (n=1: 68.2) | 20.0 ± 10.0 (n=2: 10.0, 30.0) | - | 51.0 ± 1.0 (n=2: 50.0, 52.0) | - | - / 2 / - |")


def test_the_curves_figure_reads_the_peers_learning_curves(tmp_path: Path) -> None:
    """scripts/results_curves.py: the cross-check runs that carry a curve, normalised with the
    file's reference scores, mean and std (ddof 0) over seeds at the steps every seed has."""
    results_curves = script_module("results_curves")

    def run(algo: str, seed: int, curve: dict[int, float] | None) -> dict:
        out = {"algo": algo, "seed": seed, "results": [{"target": None, "returns": [0.0]}]}
        if curve is not None:
            out["curve"] = [{"step": s, "results": [{"target": None, "returns": [r, r + 2.0]}]}
                            for s, r in curve.items()]
        return out

    path = tmp_path / "peers-hopper-medium.json"
    path.write_text(json.dumps({"reference_scores": [-10.0, 90.0], "runs": [
        run("iql", 0, None), run("cql", 0, {2: 9.0, 4: 29.0}), run("cql", 1, {2: 29.0, 4: 49.0, 6: 0.0})]}))
    assert results_curves.peer_curves(path) == {
        "d3rlpy CQL": {"steps": [2, 4], "mean": [30.0, 50.0], "std": [10.0, 10.0], "n": 2}}


def _results_curves():
    results_curves = script_module("results_curves")
    return results_curves


def test_the_curves_figure_draws_a_peer_dt_curve_per_target_and_a_peer_bc_curve(tmp_path: Path) -> None:
    """A cross-check of d3rlpy's DT with two targets and BC: one curve per DT target, labelled
    with it, and BC's own label, none of them ours (DT, BC)."""
    def run(algo: str, targets: list[float | None], returns: dict[int, list[float]]) -> dict:
        return {"algo": algo, "seed": 0, "results": [],
                "curve": [{"step": s, "results": [{"target": t, "returns": [r]} for t, r in zip(targets, rs)]}
                          for s, rs in returns.items()]}

    path = tmp_path / "peers-hopper-medium.json"
    path.write_text(json.dumps({"reference_scores": [0.0, 200.0], "runs": [
        run("dt", [3559.0, 3300.0], {2: [20.0, 40.0], 4: [60.0, 80.0]}), run("bc", [None], {2: [100.0], 4: [120.0]})]}))
    assert _results_curves().peer_curves(path) == {
        "d3rlpy DT (target 3559)": {"steps": [2, 4], "mean": [10.0, 30.0], "std": [0.0, 0.0], "n": 1},
        "d3rlpy DT (target 3300)": {"steps": [2, 4], "mean": [20.0, 40.0], "std": [0.0, 0.0], "n": 1},
        "d3rlpy BC": {"steps": [2, 4], "mean": [50.0, 60.0], "std": [0.0, 0.0], "n": 1}}


@pytest.mark.parametrize("scores", [[50.0, 50.0], [90.0, -10.0]])
def test_the_curves_figure_refuses_a_peers_file_whose_reference_scores_do_not_normalise(tmp_path: Path,
                                                                                        capsys, scores) -> None:
    (tmp_path / "dt-hopper-medium.curves.json").write_text(json.dumps({"metric": "eval/normalized_score", "points": {
        "(base)": {"steps": [2], "mean": [1.0], "std": [0.0], "n": 1}}}))
    path = tmp_path / "peers-hopper-medium.json"
    path.write_text(json.dumps({"reference_scores": scores, "runs": [
        {"algo": "iql", "seed": 0, "curve": [{"step": 2, "results": [{"target": None, "returns": [1.0]}]}]}]}))
    assert _results_curves().main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == (
        f"error: {path}: not a cross-check JSON of python -m rl_tformers.bench.crosscheck (ValueError: "
        f"reference_scores {scores}: random is not below expert)\n")
    assert not (tmp_path / "c.png").exists()


def test_the_curves_figure_leaves_out_peers_curves_beside_sweeps_of_another_metric(tmp_path: Path, capsys,
                                                                                    monkeypatch) -> None:
    """The peers' curves are normalised scores: beside sweeps' curves of returns they are named
    on stderr and not drawn."""
    (tmp_path / "dt-breakout-x.curves.json").write_text(json.dumps({"metric": "eval/return", "points": {
        "(base)": {"steps": [2], "mean": [1.0], "std": [0.0], "n": 1}}}))
    path = tmp_path / "peers-breakout-x.json"
    path.write_text(json.dumps({"reference_scores": [0.0, 1.0], "runs": [
        {"algo": "iql", "seed": 0, "curve": [{"step": 2, "results": [{"target": None, "returns": [1.0]}]}]}]}))
    results_curves = _results_curves()
    drawn = []
    monkeypatch.setattr(results_curves, "plot_curve_panels",
                        lambda panels, metric, out: drawn.append((panels, metric)) or out)
    assert results_curves.main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 0
    assert drawn == [({"breakout-x": {"DT": {"steps": [2], "mean": [1.0], "std": [0.0], "n": 1}}}, "eval/return")]
    assert capsys.readouterr().err == (
        f"{path}: its curves are not drawn: the sweeps' curves are eval/return, not eval/normalized_score\n")


def test_the_results_table_of_another_task_reads_its_own_files(tmp_path: Path) -> None:
    """``--task walker2d``: the walker2d files make the rows; a Hopper file beside them does not."""
    results_table = script_module("results_table")
    (tmp_path / "dt-walker2d-medium-s0.eval.json").write_text(json.dumps({"results": [{"normalized_score": 74.5}]}))
    (tmp_path / "dt-hopper-medium-s0.eval.json").write_text(json.dumps({"results": [{"normalized_score": 60.0}]}))
    assert results_table.table(tmp_path, "walker2d").splitlines()[2:] == [
        "| walker2d-medium | 74.5 ± 0.0 (n=1: 74.5) | - | - | - | - | - / - / - |"]


def test_the_results_script_refuses_an_unknown_task(tmp_path: Path) -> None:
    p = subprocess.run(["bash", str(REPO / "scripts/results_mujoco.sh")], env={**os.environ, "TASK": "ant"},
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "error: TASK=ant: one of hopper, walker2d, halfcheetah"
