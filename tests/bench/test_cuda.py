"""CUDA-only checks of the performance paths (skipped without a GPU; run by scripts/gpu_check.sh)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from bench_helpers import TINY

from rl_tformers.bench import eval as be
from rl_tformers.bench import train as bt
from rl_tformers.runtime.optim import adamw_implementation

pytestmark = pytest.mark.cuda


def test_fused_adamw_on_cuda():
    assert adamw_implementation([torch.zeros(3, device="cuda", requires_grad=True)]) == {"fused": True}


def test_bench_train_on_cuda(tiny_hdf5):
    s = bt.Settings(dataset=str(tiny_hdf5), device="cuda", repeats=2, steps=3, warmup=2, peers=(), bf16=True,
                    overrides=TINY, matmul_sizes=(1024, 4096))
    res = bt.run(s)
    assert {r["impl"] for r in res.rows} == {"ours", "ours+bf16"}
    assert res.machine["gpu"] and res.peak_gflops["fp32"] > 0 and res.peak_gflops["bf16"] > 0
    assert all(0 < r["mfu"] < 1.5 for r in res.rows)


def test_memory_step_cost_on_cuda():
    s = be.Settings(device="cuda", skip_rollouts=True, memory_kinds=("gtrxl",), mem_lens=(16,), mem_envs=4, mem_steps=3)
    (row,) = be.run(s).memory
    assert row["memory_ms_per_step"] > 0 and row["reencode_ms_per_step"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL DDP needs two GPUs")
def test_ddp_nccl_two_gpus(tmp_path):
    args = ["agent.kind=toy", "device=cuda", "train.steps=6", "train.batch_size=8", "train.log_every=3",
            "train.progress=false", "eval.at_end=false"]
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "--nproc", "2", *args,
                        "--run-dir", str(tmp_path / "ddp")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ddp" / "checkpoints" / "step_000000006.pt").exists()
