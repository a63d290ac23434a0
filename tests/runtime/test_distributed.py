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

from rl_tformers.runtime import distributed as dist_rt
from rl_tformers.runtime.checkpoint import list_checkpoints
from rl_tformers.runtime.trainer import train


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
