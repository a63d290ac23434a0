"""Defects found by the lead in session 11.

1. ``rl-tformers sweep`` built the agent of every grid point with a run to *resume* before
   starting anything (:func:`~rl_tformers.runtime.sweep.check_points`), from the config alone:
   an Online DT or PPO fine-tuning run reads ``agent.init_from`` / ``agent.init_checkpoint``
   there, so a sweep of fine-tuning runs whose offline run had since been moved or deleted was
   refused, although ``train --resume`` rebuilds such a run from its own checkpoint and never
   reads them again. Only points with a run to start are built now.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def test_sweep_precheck_builds_only_points_with_a_run_to_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rl_tformers.runtime.sweep as sw

    out = tmp_path / "sw"
    common = ["train.steps=4", "train.warmup_steps=1", "train.log_every=1", "eval.every=0", "eval.at_end=false",
              "train.checkpoint_every=2"]
    kwargs = dict(jobs=1, threads=1, device="cpu", echo=lambda m: None)
    first = sw.sweep("toy", {"train.lr": ["1e-3"]}, [0], out, common, **kwargs)
    assert [r["status"] for r in first.rows] == ["ok"]
    (run_dir,) = [p for p in out.iterdir() if p.is_dir() and p.name != "logs"]
    ckpts = sorted((run_dir / "seed0" / "checkpoints").glob("step_*.pt"))
    assert [c.name for c in ckpts] == ["step_000000002.pt", "step_000000004.pt"]
    ckpts[-1].unlink()  # as if stopped after update 2
    assert sw.run_state(run_dir / "seed0") == "partial"

    checked: list[dict] = []
    real = sw.check_points

    def recording(points):
        checked.append(dict(points))
        return real(points)

    monkeypatch.setattr(sw, "check_points", recording)
    second = sw.sweep("toy", {"train.lr": ["1e-3"]}, [0], out, common, **kwargs)  # to resume
    assert [r["status"] for r in second.rows] == ["ok"]
    assert checked in ([], [{}])  # nothing built: each --resume rebuilds its run from its checkpoint
    assert sw.run_state(run_dir / "seed0") == "complete"
