"""Regressions found by the fresh-user pass of session 7 (README walkthrough)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rl_tformers.runtime import trainer as trainer_mod
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train

SLEEP_S = 0.02  # every update lasts at least this long below


def toy_cfg(*overrides: str):
    return compose(None, ["agent.kind=toy", "device=cpu", "train.progress=false", "train.batch_size=8",
                          "train.lr=3e-3", "train.warmup_steps=5", "eval.at_end=false", *overrides])


def _slow_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    update = trainer_mod.Trainer.update

    def slow(self, batch):
        time.sleep(SLEEP_S)
        return update(self, batch)

    monkeypatch.setattr(trainer_mod.Trainer, "update", slow)


def _rates(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["perf/steps_per_s"] for r in rows if "perf/steps_per_s" in r}


def test_throughput_after_resume_counts_only_updates_timed_since(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The first log after a resume divided the whole window (9 updates made before the stop
    plus 1 after) by the time of the 1 update since the resume: 10x the real rate. Every
    update here lasts >= 20 ms, so no logged rate may exceed 50 updates/s."""
    _slow_updates(monkeypatch)
    cfg = toy_cfg("train.log_every=10", "train.checkpoint_every=100", "train.steps=20")
    train(cfg, tmp_path / "run", stop_at=19)
    resume(tmp_path / "run")
    rates = _rates(tmp_path / "run")
    assert sorted(rates) == [10, 20]
    assert all(0 < r <= 1 / SLEEP_S for r in rates.values()), rates


def test_throughput_window_keeps_the_time_before_a_checkpoint(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint in the middle of a log window restarted the window's clock without
    forgetting its updates: the rate counted 10 updates over the time of the last 3."""
    _slow_updates(monkeypatch)
    cfg = toy_cfg("train.log_every=10", "train.checkpoint_every=7", "train.steps=10")
    train(cfg, tmp_path / "run")
    rates = _rates(tmp_path / "run")
    assert sorted(rates) == [10]
    assert 0 < rates[10] <= 1 / SLEEP_S, rates


def test_sweep_prints_the_runs_config_warnings_and_one_seed_has_no_std(tmp_path: Path) -> None:
    """A sweep whose train.steps is below the shipped warm-up trained nothing useful, and the
    trainer's warning went only to OUT/logs/<run>.log; the console showed a neat table. A
    single seed's std was 0 (a measured zero spread) instead of none. A rerun of a stopped
    run overwrote its log's first part."""
    from rl_tformers.runtime import sweep as sw

    out = tmp_path / "sweep"
    common = ["agent.kind=toy", "train.steps=6", "train.warmup_steps=50", "train.log_every=3",
              "train.checkpoint_every=0", "eval.at_end=true"]
    messages: list[str] = []
    res = sw.sweep(None, {"backbone.n_layers": ["1", "2"]}, [0], out, common, jobs=1, threads=1,
                   device="cpu", echo=messages.append)
    warns = [m for m in messages if m.startswith("warning: train.warmup_steps=50 >= train.steps=6")]
    assert len(warns) == 1 and warns[0].endswith("(every run)"), messages
    assert [s["std"] for s in res.summary] == [None, None]
    assert "| backbone.n_layers=1 |" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["summary"][0]["std"] is None
    # the log of a run is appended to, not replaced, when the sweep runs it again
    log = out / "logs" / f"{sw._slug('n_layers=1/seed0')}.log"
    first = log.read_text()
    assert first.startswith("$ ")
    import shutil

    shutil.rmtree(out / "n_layers=1" / "seed0")
    sw.sweep(None, {"backbone.n_layers": ["1", "2"]}, [0], out, common, jobs=1, threads=1, device="cpu",
             echo=messages.append)
    assert log.read_text().startswith(first) and log.read_text().count("$ ") == 2


def test_resume_with_fewer_steps_than_trained_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`train --resume RUN train.steps=N` below the run's step said only "complete" (info)."""
    import logging

    train(toy_cfg("train.steps=10", "train.log_every=5", "train.checkpoint_every=5"), tmp_path / "run")
    with caplog.at_level(logging.INFO):
        r = resume(tmp_path / "run", ["train.steps=5"])
    assert r.step == 10
    warned = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len(warned) == 1 and "train.steps=5 is below the step" in warned[0].getMessage()
    assert "(10)" in warned[0].getMessage() and "never shortened" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        resume(tmp_path / "run")  # complete at its own train.steps: no warning
    assert not [rec for rec in caplog.records if rec.levelno == logging.WARNING]


def test_unknown_dataset_id_suggests_close_local_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unknown config names, keys and kinds got a "did you mean"; a mistyped dataset id did not."""
    from rl_tformers.envs.loaders import load_minari, local_dataset_ids

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    for ds_id in ("rlt/hopper-v5/medium-v0", "rlt/walker2d-v5/expert-v0"):
        (tmp_path / "root" / ds_id / "data").mkdir(parents=True)
        (tmp_path / "root" / ds_id / "data" / "metadata.json").write_text("{}")
    assert local_dataset_ids(tmp_path / "root") == ["rlt/hopper-v5/medium-v0", "rlt/walker2d-v5/expert-v0"]
    with pytest.raises(FileNotFoundError, match=r"\(did you mean 'rlt/hopper-v5/medium-v0'\?\)"):
        load_minari("rlt/hopper-v5/medium-v9", root=tmp_path / "root")
    with pytest.raises(FileNotFoundError) as exc:
        load_minari("foo/bar-v0", root=tmp_path / "root")
    assert "did you mean" not in str(exc.value)
