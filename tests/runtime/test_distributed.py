"""Multi-process training (DDP via torchrun, gloo on CPU): batch sharding, the launcher command,
and two CPU processes reproducing the single-process loss trajectory, with stop and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from runtime_helpers import model_state, toy_cfg
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.cli.train import _first_line
from rl_tformers.runtime import distributed as dist_rt
from rl_tformers.runtime.checkpoint import list_checkpoints
from rl_tformers.runtime.trainer import train
from tests.runtime.ddp_helpers import read_metrics, subprocess_env, two_ranks


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


def _batch(n: int = 8) -> dict:
    return {
        "obs": torch.arange(n * 3).reshape(n, 3),
        "mask": np.arange(n) % 2 == 0,
        "nested": [torch.arange(n), Pair(torch.arange(n) * 10, 7)],
        "other": torch.zeros(5),  # leading size != B: shared by every shard
        "scale": 3.0,
    }


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_shards_are_disjoint_and_cover_the_global_batch(world: int) -> None:
    full = _batch()
    shards = [dist_rt.shard_batch(full, r, world) for r in range(world)]
    assert torch.equal(torch.cat([s["obs"] for s in shards]), full["obs"])
    assert np.array_equal(np.concatenate([s["mask"] for s in shards]), full["mask"])
    assert torch.equal(torch.cat([s["nested"][0] for s in shards]), full["nested"][0])
    assert all(isinstance(s["nested"][1], Pair) and s["nested"][1].b == 7 for s in shards)
    assert torch.equal(torch.cat([s["nested"][1].a for s in shards]), full["nested"][1].a)
    assert all(s["other"] is full["other"] and s["scale"] == 3.0 for s in shards)
    assert shards[world - 1]["obs"].shape == (8 // world, 3)
    assert torch.equal(shards[world - 1]["obs"][0], full["obs"][8 - 8 // world])


def test_indivisible_batch_is_refused_naming_the_option() -> None:
    with pytest.raises(ValueError, match="train.batch_size=6 .* 4 processes"):
        dist_rt.shard_batch(_batch(6), 0, 4)


def test_sharded_dataset_and_iterable_sources() -> None:
    class Steps(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, s: int) -> dict:
            return {"x": torch.full((4, 2), float(s))}

    ds = dist_rt.shard_source(Steps(), 1, 2)
    assert len(ds) == 3 and ds[2]["x"].shape == (2, 2) and float(ds[2]["x"][0, 0]) == 2.0
    it = dist_rt.shard_source(iter([{"x": torch.arange(4)}]), 0, 2)
    assert torch.equal(next(iter(it))["x"], torch.tensor([0, 1]))
    src = Steps()
    assert dist_rt.shard_source(src, 0, 1) is src


def test_torchrun_command_and_backend() -> None:
    cmd = dist_rt.torchrun_command(2, ["--run-dir", "r", "seed=1"])
    assert cmd[:3] == [sys.executable, "-m", "rl_tformers.runtime.torchrun"]  # torchrun without its tracebacks
    assert "--standalone" in cmd and "--nproc-per-node=2" in cmd
    assert cmd[-5:] == ["rl_tformers.cli", "train", "--run-dir", "r", "seed=1"]
    with pytest.raises(ValueError, match="--nproc"):
        dist_rt.torchrun_command(0, [])
    assert dist_rt.backend_for("cpu") == "gloo" and dist_rt.backend_for("cuda:1") == "nccl"
    assert dist_rt.backend_for("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert dist_rt.dist_info().world_size == int(os.environ.get("WORLD_SIZE", 1))


COMMON = ["agent.kind=toy", "device=cpu", "train.steps=20", "train.batch_size=8", "train.log_every=5",
          "train.checkpoint_every=10", "train.keep_last=10", "train.lr=3e-3", "train.warmup_steps=5",
          "eval.at_end=false", "train.progress=false"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_cpu_processes_match_one_process_and_resume(tmp_path: Path) -> None:
    """Same global batch of 8: 2 gloo ranks x 4 rows (stopped at 10, resumed) vs one process x 8."""
    no_dropout = ["backbone.dropout=0", "backbone.attn_dropout=0"]
    single = train(toy_cfg(*COMMON, *no_dropout), tmp_path / "single")
    assert single.step == 20
    ddp = tmp_path / "ddp"
    first = _cli("--nproc", "2", *COMMON, *no_dropout, "--run-dir", str(ddp), "--stop-at", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    assert [s for s, _ in list_checkpoints(ddp)] == [10]
    second = _cli("--nproc", "2", "--resume", str(ddp))
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stderr.count("done: 20 steps") == 1  # rank 0 reports

    a, b = _metrics(tmp_path / "single"), _metrics(ddp)
    assert [m["step"] for m in b] == [5, 10, 15, 20]  # rank 0 writes, every step once
    for ma, mb in zip(a, b):
        for key in ("train/loss", "train/grad_norm", "train/mae", "train/lr"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-6), (mb["step"], key)
    assert mb["perf/samples_per_s"] > 0
    assert [s for s, _ in list_checkpoints(ddp)] == [20, 10]
    assert sorted(p.name for p in ddp.glob("config.yaml*")) == ["config.yaml"]
    # weights: Adam's step g / sqrt(v) turns float-summation differences of near-zero gradients
    # into differences of up to ~lr (3e-3) per update, so the weight tolerance is in lr units
    wa, wb = model_state(tmp_path / "single", 20), model_state(ddp, 20)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-3, atol=1e-3)
    state = torch.load(ddp / "checkpoints" / "step_000000020.pt", weights_only=True)
    assert len(state["trainer"]["rng_ranks"]) == 2  # every rank's generators, for exact resume


@pytest.mark.slow
def test_ddp_resume_with_dropout_is_exact(tmp_path: Path) -> None:
    """With dropout (each rank its own random stream), stop + resume = uninterrupted, bit for bit."""
    full, split = tmp_path / "full", tmp_path / "split"
    assert _cli("--nproc", "2", *COMMON, "--run-dir", str(full)).returncode == 0
    assert _cli("--nproc", "2", *COMMON, "--run-dir", str(split), "--stop-at", "10").returncode == 0
    assert _cli("--nproc", "2", "--resume", str(split)).returncode == 0
    wa, wb = model_state(full, 20), model_state(split, 20)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    def train_keys(ms: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if k == "step" or k.startswith("train/")} for m in ms]

    assert train_keys(_metrics(full)) == train_keys(_metrics(split))


def test_trainer_under_torchrun_without_a_process_group_refuses(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.runtime.trainer import Trainer, _with_run_dir

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    cfg = toy_cfg(*COMMON)
    with pytest.raises(RuntimeError, match="no process group"):
        Trainer(_with_run_dir(cfg, tmp_path), tmp_path)


TOY = ["agent.kind=toy", "device=cpu", "train.steps=10", "train.batch_size=8", "train.log_every=2",
       "train.checkpoint_every=5", "train.keep_last=10", "train.lr=3e-3", "train.warmup_steps=2",
       "backbone.d_model=16", "backbone.n_layers=1", "eval.at_end=false", "train.progress=false"]


def _logged(run_dir: Path) -> list[dict]:
    """Every logged number but wall-clock ones."""
    return [{k: v for k, v in m.items() if k not in ("time", "eval/time_s") and not k.startswith("perf/")}
            for m in read_metrics(run_dir)]


# ------------------------------------------------- 1: a failed evaluation under DDP saves its step
def test_failed_evaluation_on_rank_0_saves_the_step_on_every_rank_and_resumes_exactly(tmp_path: Path) -> None:
    outs = two_ranks(tmp_path, f"""
        from pathlib import Path
        from rl_tformers.runtime import toy
        from rl_tformers.runtime.run_config import compose
        from rl_tformers.runtime.trainer import resume, train
        torch.set_num_threads(1)
        cfg = compose(None, {[*TOY, "eval.every=4"]!r})
        base = Path({str(tmp_path)!r})
        train(cfg, base / "full")
        evaluate = toy.ToyAgent.evaluate

        def broken(self, step):
            if step == 4:
                raise RuntimeError("the environment broke")
            return evaluate(self, step)

        toy.ToyAgent.evaluate = broken
        try:
            train(cfg, base / "split")
            out["error"] = None
        except Exception as exc:
            out["error"] = type(exc).__name__
            out["text"] = " ".join([str(exc), *getattr(exc, "__notes__", [])])
        toy.ToyAgent.evaluate = evaluate
        out["resumed"] = resume(base / "split").step
    """)
    assert outs[0]["error"] == "RuntimeError" and outs[1]["error"] == "PeerFailure"
    split = tmp_path / "split"
    assert "checkpoints/step_000000004.pt" in outs[0]["text"]  # the step it failed at, saved (was: nothing)
    assert outs[0]["resumed"] == outs[1]["resumed"] == 10
    assert sorted(s for s, _ in list_checkpoints(split)) == [4, 5, 10]
    state = torch.load(split / "checkpoints" / "step_000000004.pt", weights_only=True)
    assert len(state["trainer"]["rng_ranks"]) == 2  # every rank's state: the resume is exact
    # the resume evaluates step 4 first (every rank takes part), then trains on: every logged
    # number of the uninterrupted run, each step once, and the same weights bit for bit
    assert _logged(split) == _logged(tmp_path / "full")
    a = torch.load(tmp_path / "full" / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    b = torch.load(split / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------- 2: the rank that failed is named
def test_a_lost_peer_is_recognised_and_summed_up_in_one_line() -> None:
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:24450. This is typically caused by a remote worker crashing. GLHF!")
    assert dist_rt.peer_failed(gloo) and dist_rt.peer_failed(dist_rt.PeerFailure("x"))
    wrapped = ValueError("while saving")
    wrapped.__cause__ = gloo
    assert dist_rt.peer_failed(wrapped)
    assert not dist_rt.peer_failed(RuntimeError("CUDA out of memory")) and not dist_rt.peer_failed(ValueError("x"))
    assert _first_line(gloo) == "RuntimeError: Connection closed by peer [127.0.0.1]:24450"


def test_a_crash_of_rank_1_is_reported_as_rank_1_without_a_traceback_of_rank_0(tmp_path: Path) -> None:
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from rl_tformers.runtime import toy\n"
        "    loss, n = toy.ToyAgent.loss, [0]\n"
        "    def broken(self, batch):\n"
        "        n[0] += 1\n"
        "        if n[0] == 3:\n"
        "            raise RuntimeError('rank 1 crashed on purpose')\n"
        "        return loss(self, batch)\n"
        "    toy.ToyAgent.loss = broken\n")
    env = {**subprocess_env(), "PYTHONPATH": os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "--nproc", "2", *TOY, "--run-dir",
                        str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "rank 1 crashed on purpose" in r.stderr  # its own traceback
    assert "error: rank 1 exited with status 1 (its output is above)" in r.stderr
    assert "[rank0]: Traceback" not in r.stderr  # was gloo's "Connection closed by peer" traceback
    assert "rank 0: stopped: another process of the run failed or was killed" in r.stderr


# ---------------------------------------------------------------- 3: a stale WORLD_SIZE and --nproc
def test_nproc_with_world_size_in_the_environment_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "--nproc", "2", "-c", "toy", "device=cpu", "train.steps=2",
                                 "--run-dir", str(run)])
    assert r.exit_code == 2, r.output
    assert "error: --nproc 2 starts its own processes, but WORLD_SIZE=1 is set" in r.output
    assert not run.exists()  # was: one process trained, --nproc ignored


# ------------------------------------------------- 7. DDP: more CUDA processes than GPUs
@pytest.mark.parametrize("device", ["cuda", "auto"], ids=["explicit-gpu", "auto-with-a-gpu"])
def test_nproc_beyond_the_gpu_count_is_refused_before_any_process_starts(tmp_path, monkeypatch, device) -> None:
    from typer.testing import CliRunner

    from rl_tformers.cli import app
    from rl_tformers.cli import train as commands

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started: list[list[str]] = []
    monkeypatch.setattr(commands, "_run_torchrun", lambda cmd, *a, **k: started.append(cmd) or 0)
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "-c", "toy", "--nproc", "2", "--run-dir", str(run), f"device={device}"])
    assert r.exit_code == 2, r.output
    assert f"error: --nproc 2: device='{device}' runs one process per GPU (rank r on cuda:r) and this machine has " \
           "1 CUDA device(s); use --nproc <= 1, or device=cpu (gloo) for more processes" in r.output
    assert started == [] and not run.exists()
    r = CliRunner().invoke(app, ["train", "-c", "toy", "--nproc", "2", "--run-dir", str(run), "device=cpu"])
    assert r.exit_code == 0, r.output  # gloo: any number of processes (the launch itself is stubbed here)
    assert len(started) == 1 and "--nproc-per-node=2" in started[0]
