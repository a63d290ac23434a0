"""Defects found by the lead in session 11.

1. ``rl-tformers sweep`` built the agent of every grid point with a run to *resume* before
   starting anything (:func:`~rl_tformers.runtime.sweep.check_points`), from the config alone:
   an Online DT or PPO fine-tuning run reads ``agent.init_from`` / ``agent.init_checkpoint``
   there, so a sweep of fine-tuning runs whose offline run had since been moved or deleted was
   refused, although ``train --resume`` rebuilds such a run from its own checkpoint and never
   reads them again. Only points with a run to start are built now.

Also the new ``rl-tformers eval --context-len`` option (Online DT's evaluation context).
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


def test_eval_context_len_option_reaches_the_policy_and_is_checked(tmp_path: Path) -> None:
    """``rl-tformers eval --context-len N`` (a DT acting on the last N of its K steps, Online DT's
    evaluation context): recorded in the JSON; out of range: one error line naming the option and K.
    (That the policy then reads only N steps: tests/agents/test_dt_policy.py.)"""
    import json

    import h5py
    import numpy as np
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    rng = np.random.default_rng(0)
    n = 200
    term = np.zeros(n, bool)
    term[np.arange(19, n, 20)] = True
    data = tmp_path / "cartpole.hdf5"
    with h5py.File(data, "w") as f:
        f["observations"] = rng.normal(size=(n, 4)).astype(np.float32)
        f["actions"] = rng.integers(0, 2, n)
        f["rewards"] = np.ones(n)
        f["terminals"] = term
        f["timeouts"] = np.zeros(n, bool)
        f.attrs["env_id"] = "CartPole-v1"
    runner = CliRunner()
    run = tmp_path / "dt"
    res = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={data}", "backbone.d_model=16",
                              "backbone.n_layers=1", "agent.context_len=4", "train.steps=2", "train.batch_size=4",
                              "eval.every=0", "eval.at_end=false", "train.progress=false", "train.warmup_steps=1",
                              "--run-dir", str(run), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    common = ["eval", str(run), "--targets", "30", "--episodes", "2", "--envs", "2", "--json"]
    short = runner.invoke(app, [*common, "--context-len", "1"])
    assert short.exit_code == 0, short.output
    report = json.loads(short.output)
    assert report["extra"]["context_len"] == 1
    full = json.loads(runner.invoke(app, common).output)
    assert "context_len" not in full["extra"]
    bad = runner.invoke(app, [*common, "--context-len", "5"])
    assert bad.exit_code != 0
    assert "--context-len 5: this run's context holds K = 4 steps (agent.context_len); give 1..4" in bad.output
    # plot takes it too; with a saved evaluation it would be ignored, so it is refused
    fig = tmp_path / "fig.png"
    plot = ["plot", str(run), "--out", str(fig), "--no-tensorboard"]
    res = runner.invoke(app, [*plot, "--targets", "30", "--episodes", "1", "--envs", "1", "--context-len", "2"])
    assert res.exit_code == 0, res.output
    assert fig.stat().st_size > 0
    assert "give 1..4" in runner.invoke(app, [*plot, "--targets", "30", "--context-len", "9"]).output
    saved = tmp_path / "eval.json"
    assert runner.invoke(app, [*common[:-1], "--out", str(saved)]).exit_code == 0
    res = runner.invoke(app, [*plot, "--from-json", str(saved), "--context-len", "2"])
    assert res.exit_code != 0 and "--context-len would be ignored" in res.output


def test_a_yaml_file_given_as_checkpoint_is_named_not_a_checkpoint(tmp_path: Path) -> None:
    """``eval --checkpoint RUN/config.yaml`` said "cannot be loaded (IndexError: pop from empty
    list)" (fresh user 11): a file that is not a zip archive is not a checkpoint, said so."""
    from rl_tformers.runtime.checkpoint import CheckpointError, load_checkpoint

    f = tmp_path / "config.yaml"
    f.write_text("seed: 0\nagent:\n  kind: dt\n")
    with pytest.raises(CheckpointError, match=r"config.yaml: not an rl-tformers checkpoint \(those are the zip "
                                              r"archives torch.save writes, RUN_DIR/checkpoints/step_\*.pt\)"):
        load_checkpoint(f)


def test_a_float64_cache_of_a_float32_model_is_refused_by_every_incremental_kernel() -> None:
    """A float64 KV cache (``initial_state(..., dtype=torch.float64)``) of a float32 model was
    refused by ``sdpa`` and ``reference`` but silently promoted the layer to float64 with the other
    incremental kernels (docs audit 11): every kernel refuses it now, naming the dtypes."""
    import torch

    from rl_tformers.backbone import Backbone
    from rl_tformers.registry import REGISTRIES

    kinds = [e.kind for e in REGISTRIES["attention"] if e.capabilities.incremental and e.capabilities.causal]
    assert {"sdpa", "local", "performer"} <= set(kinds)
    for kind in kinds:
        bb = Backbone({"d_model": 16, "n_heads": 2, "n_layers": 1, "attention": {"kind": kind}}).eval()
        state = bb.initial_state(2, dtype=torch.float64)
        with pytest.raises(ValueError, match=r"^backbone: the state holds torch.float64 tensors but x and the "
                                             r"backbone's parameters are torch.float32"):
            bb(torch.randn(2, 3, 16), positions=torch.arange(3).expand(2, 3), state=state)
        ok = bb(torch.randn(2, 3, 16), positions=torch.arange(3).expand(2, 3), state=bb.initial_state(2))
        assert ok.hidden.dtype == torch.float32, kind
