"""Faults found by the lead in session 10, each pinned by a test that failed before its fix."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rl_tformers.runtime.run_config import compose
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


def test_a_ppo_fine_tuning_run_resumes_without_reading_its_offline_run_again(tmp_path: Path) -> None:
    """`--resume` of a PPO fine-tuning run (agent.init_checkpoint) read the offline run again to build
    its model: with that run retrained (another backbone) the resume crashed on a state_dict size
    mismatch, and with it deleted the resume was refused ("no such run directory"), although the
    run's own checkpoint holds the model config, weights and statistics. Now it rebuilds from its
    checkpoint and continues exactly as an uninterrupted run."""
    import shutil

    import torch
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    recall_file = save_d4rl_hdf5(scripted_dataset("recall", 30, delay=2, seed=0), tmp_path / "recall-d2.hdf5")

    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]
    offline = ["agent.kind=gtrxl", "agent.seq_len=4", "agent.burn_in=2", f"dataset.path={recall_file}",
               "train.steps=2", "train.batch_size=4", "train.progress=false", "eval.at_end=false", "device=cpu"]
    train(compose(None, [*offline, *tiny]), tmp_path / "offline")
    ppo = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d2-v0",
           f"agent.init_checkpoint={tmp_path / 'offline'}", "agent.n_envs=2", "agent.n_steps=4", "agent.n_epochs=1",
           "agent.n_minibatches=1", "train.steps=4", "train.progress=false", "eval.at_end=false", "device=cpu",
           "train.checkpoint_every=1", *tiny]
    train(compose(None, ppo), tmp_path / "whole")
    train(compose(None, ppo), tmp_path / "cut", stop_at=2)
    shutil.rmtree(tmp_path / "offline")  # gone: the resume must not need it
    assert resume(tmp_path / "cut").step == 4
    a = torch.load(tmp_path / "whole" / "checkpoints" / "step_000000004.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "cut" / "checkpoints" / "step_000000004.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # retrained with another width at the same path: still the run's own model
    train(compose(None, [*offline, *[t.replace("d_model=16", "d_model=8") for t in tiny]]), tmp_path / "offline")
    assert resume(tmp_path / "cut", ["train.steps=6"]).step == 6
