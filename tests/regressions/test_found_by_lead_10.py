"""Faults found by the lead in session 10, each pinned by a test that failed before its fix."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rl_tformers.runtime.config import compose
from rl_tformers.runtime.trainer import resume, train

TINY_DT = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1", "train.batch_size=4",
           "train.progress=false", "eval.at_end=false", "device=cpu"]


def test_a_refused_resume_does_not_first_warn_that_the_schedule_is_re_stretched(
        tmp_path: Path, cartpole_h5, caplog: pytest.LogCaptureFixture) -> None:
    """`train --resume RUN train.steps=N` with a warmup_cosine schedule warned "train.steps ... re-stretches
    the warmup_cosine schedule ..." and only then refused the resume because the data had changed: a
    warning about a run that never continues. The warning now follows the data and agent checks."""
    data = cartpole_h5(tmp_path / "cp.hdf5", seed=0)
    cfg = ["train.schedule=warmup_cosine", "train.warmup_steps=1", "train.steps=4", "train.lr=1e-2"]
    train(compose("dt/cartpole_demo", [f"dataset.path={data}", *TINY_DT, *cfg]), tmp_path / "run")
    cartpole_h5(data, seed=1)  # other episodes at the same path
    with caplog.at_level(logging.INFO), pytest.raises(Exception, match="dataset|data"):
        resume(tmp_path / "run", ["train.steps=40"])
    assert not any("re-stretches" in r.getMessage() for r in caplog.records), caplog.text
    cartpole_h5(data, seed=0)  # the data back: the resume goes on and says the schedule jumps
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert resume(tmp_path / "run", ["train.steps=8"]).step == 8
    assert any("re-stretches" in r.getMessage() for r in caplog.records), caplog.text
