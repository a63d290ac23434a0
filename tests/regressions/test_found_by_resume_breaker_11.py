"""Defects found by the eleventh resume breaker ("a run that is interrupted can be resumed
exactly": weights, optimiser state, RNG streams, metrics.jsonl lines and evaluation results of a
stopped-and-resumed run equal an uninterrupted run's). Toy agent, CPU, seconds; no ./data or
../shared.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from rl_tformers.runtime import toy
from rl_tformers.runtime.checkpoint import load_checkpoint
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import Trainer, resume, train
from tests.bitwise import same_bits

#: evaluations every 2 updates, checkpoints every 4: step 4 is both, step 6 an evaluation step only
TOY = ["agent.kind=toy", "device=cpu", "train.progress=false", "train.steps=12", "train.batch_size=4",
       "train.warmup_steps=2", "train.log_every=2", "train.checkpoint_every=4", "train.keep_last=10",
       "backbone.d_model=16", "backbone.n_layers=1", "backbone.dropout=0.1", "eval.every=2", "eval.at_end=true"]


def _rows(run: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if k not in ("time", "eval/time_s") and not k.startswith("perf/")})
    return out


def _final(run: Path) -> dict:
    state = load_checkpoint(run / "checkpoints" / "step_000000012.pt")
    return {k: state[k] for k in ("model", "optimizer", "rng", "scheduler")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    train(compose(None, TOY), run)
    return run


@pytest.mark.parametrize("bad_step", [4, 6], ids=["at-a-checkpoint-step", "between-checkpoints"])
def test_a_mid_run_evaluation_that_failed_is_logged_by_the_resume(straight: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  bad_step: int) -> None:
    """An evaluation that raised mid-run saved its step (as promised) and named `--resume`, but the
    resume started training after that step: the evaluation of that step was never logged, so
    metrics.jsonl lacked the row an uninterrupted run has (weights were equal)."""
    real = toy.ToyAgent.evaluate

    def broken(self, step):
        if step == bad_step:
            raise RuntimeError("evaluation environment broke")
        return real(self, step)

    monkeypatch.setattr(toy.ToyAgent, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation environment broke"):
        train(compose(None, TOY), tmp_path / "run")
    monkeypatch.setattr(toy.ToyAgent, "evaluate", real)
    result = resume(tmp_path / "run")
    assert result.complete
    assert same_bits(_final(straight), _final(tmp_path / "run"))
    assert any(r["step"] == bad_step and "eval/mse" in r for r in _rows(straight))
    assert _rows(tmp_path / "run") == _rows(straight)


def test_a_mid_run_evaluation_aborted_by_a_second_signal_is_logged_by_the_resume(straight: Path,
                                                                                 tmp_path: Path) -> None:
    """A second Ctrl-C during the evaluation of a checkpoint step (4) aborts it; the resume
    continues from that checkpoint and must run the evaluation it cut short."""
    run = tmp_path / "run"
    trainer = Trainer(compose(None, TOY), run)
    real = trainer.agent.evaluate

    def evaluate_with_two_ctrl_c(step: int):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises KeyboardInterrupt here
        return real(step)

    trainer.agent.evaluate = evaluate_with_two_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert not any(r["step"] == 4 and "eval/mse" in r for r in _rows(run))
    resume(run)
    assert same_bits(_final(straight), _final(run))
    assert _rows(run) == _rows(straight)


def test_a_run_stopped_at_an_evaluation_step_is_not_evaluated_twice(straight: Path, tmp_path: Path) -> None:
    """Control: --stop-at an evaluation step evaluates before stopping; the resume does not repeat it."""
    run = tmp_path / "run"
    train(compose(None, TOY), run, stop_at=4)
    resume(run)
    assert _rows(run) == _rows(straight)
