"""``rl-tformers train``: help, config printing, error messages and exit codes, a full tiny run."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()
TINY = ["agent.kind=toy", "train.steps=6", "train.log_every=3", "train.checkpoint_every=3", "train.progress=false",
        "--device", "cpu"]


def invoke(*args: str):
    return runner.invoke(app, ["train", *args], catch_exceptions=False)


def test_help_has_examples() -> None:
    out = invoke("--help").output
    for text in ("Examples", "--resume", "--config", "backbone.attention.kind=performer", "--print-config"):
        assert text in out


def test_print_config() -> None:
    r = invoke("-c", "toy", "train.steps=7", "--print-config")
    assert r.exit_code == 0 and "  steps: 7\n" in r.output and "kind: toy" in r.output


def test_config_errors_exit_2_with_the_key() -> None:
    r = invoke("agent.kind=toy", "train.lrr=1", "--print-config")
    assert r.exit_code == 2 and "error: train.lrr: unknown key; did you mean train.lr?" in r.output
    r = invoke("agent.kind=nope")
    assert r.exit_code == 2 and "registered kinds:" in r.output and "toy" in r.output
    r = invoke("-c", "no/such/config")
    assert r.exit_code == 2 and "not found" in r.output
    r = invoke("agent.kind=toy", "train.steps")
    assert r.exit_code == 2 and "not KEY=VALUE" in r.output


def test_list_agents() -> None:
    r = invoke("--list-agents")
    assert r.exit_code == 0 and any(line.startswith("toy ") for line in r.output.splitlines())


def test_train_then_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = invoke(*TINY, "--run-dir", str(run))
    assert r.exit_code == 0, r.output
    assert f"done: 6 steps in {run}" in r.output
    assert (run / "config.yaml").exists() and (run / "checkpoints" / "step_000000006.pt").exists()
    r = invoke(*TINY, "--run-dir", str(run))
    assert r.exit_code == 2 and "already holds a run" in r.output
    r = invoke("--resume", str(run), "train.steps=9", "train.progress=false")
    assert r.exit_code == 0 and "done: 9 steps" in r.output
    r = invoke("--resume", str(run), "-c", "toy")
    assert r.exit_code == 2 and "drop --config" in r.output
    r = invoke("--resume", str(run), "train.lr=1", "seed=5")
    assert r.exit_code == 2 and "cannot change when resuming" in r.output
    # one line, each changed key and the list of keys that may change set apart
    assert "run instead): seed: 0 -> 5; train.lr: 0.0001 -> 1.0. Keys that may change: " in r.output, r.output
    r = invoke("--resume", str(tmp_path / "missing"))
    assert r.exit_code == 2 and "not a directory" in r.output


def test_stop_at_then_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = invoke(*TINY, "--run-dir", str(run), "--stop-at", "4")
    assert r.exit_code == 0 and f"stopped at step 4 of 6; continue with: rl-tformers train --resume {run}" in r.output
    r = invoke("--resume", str(run), "--print-config")
    assert r.exit_code == 0 and "# resuming" in r.output and "step_000000004.pt" in r.output


def test_final_evaluation_summary_line() -> None:
    from rl_tformers.cli.train import eval_summary

    scalars = {"eval/return_mean": 412.86, "eval/return_std": 475.12, "eval/target": 3559.448,
               "eval/normalized_score": 13.31, "eval/time_s": 13.2,
               "eval/return_mean_target1": 100.0, "eval/target_target1": 500.0}
    assert eval_summary(scalars) == ("target 3559.45: return 412.9 ± 475.1, normalised score 13.3; "
                                     "target 500: return 100.0")
    assert eval_summary({"eval/return_mean": 7.0}) == "return 7.0"
    assert eval_summary({"eval/time_s": 1.0, "train/loss": 0.1}) == ""
