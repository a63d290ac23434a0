"""Multi-process training (DDP via torchrun, gloo on CPU): batch sharding, the launcher command,
and two CPU processes reproducing the single-process loss trajectory, with stop and resume."""

from __future__ import annotations

import json
import os
import signal
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
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import MetricWindow, train
from tests.datafiles import write_d4rl_h5
from tests.runtime.ddp_helpers import read_metrics, subprocess_env, train_cli, two_ranks


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


# ------------------------------------------------- a failed evaluation under DDP saves its step
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
    assert "checkpoints/step_000000004.pt" in outs[0]["text"]  # the step it failed at, saved (not nothing)
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


# ------------------------------------------------------------- the rank that failed is named
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
    assert "[rank0]: Traceback" not in r.stderr  # not gloo's "Connection closed by peer" traceback
    assert "rank 0: stopped: another process of the run failed or was killed" in r.stderr


# ---------------------------------------------------------------- a stale WORLD_SIZE and --nproc
def test_nproc_with_world_size_in_the_environment_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "run"
    r = CliRunner().invoke(app, ["train", "--nproc", "2", "-c", "toy", "device=cpu", "train.steps=2",
                                 "--run-dir", str(run)])
    assert r.exit_code == 2, r.output
    assert "error: --nproc 2 starts its own processes, but WORLD_SIZE=1 is set" in r.output
    assert not run.exists()  # not one process trained, --nproc ignored


# ------------------------------------------------- DDP: more CUDA processes than GPUs
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


runner = CliRunner()


TOY_DDP = ["agent.kind=toy", "device=cpu", "train.steps=20", "train.batch_size=8", "train.log_every=5",
       "train.checkpoint_every=10", "train.keep_last=10", "train.lr=3e-3", "train.warmup_steps=5",
       "eval.at_end=false", "train.progress=false"]


PPO = ["-c", "gtrxl/ppo_cartpole", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
       "agent.n_envs=2", "agent.n_steps=16", "agent.n_epochs=2", "agent.n_minibatches=2", "train.log_every=2",
       "eval.at_end=false", "eval.every=0", "train.progress=false", "--device", "cpu"]


def _train_keys(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if k == "step" or k.startswith("train/")} for m in read_metrics(run_dir)]


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


# ------------------------------------------------ metric windows with different keys per rank
def test_window_mean_of_a_key_logged_in_some_updates_counts_only_those() -> None:
    w = MetricWindow()
    w.add({"train/loss": torch.tensor(1.0), "train/episodic_return": 10.0}, samples=4)
    w.add({"train/loss": torch.tensor(3.0)}, samples=4)
    assert w.means() == {"train/loss": 2.0, "train/episodic_return": 10.0}  # not 10 / 2


def test_ranks_logging_different_keys_reduce_key_by_key(tmp_path: Path) -> None:
    outs = two_ranks(tmp_path, """
        from rl_tformers.runtime.trainer import MetricWindow
        w = MetricWindow()
        if rank == 0:
            w.add({"loss": torch.tensor(1.0), "episodic_return": 10.0}, samples=4)
            w.add({"loss": torch.tensor(3.0)}, samples=4)
        else:
            w.add({"only_rank1": 7.0, "loss": torch.tensor(5.0)}, samples=4)
            w.add({"loss": torch.tensor(7.0), "episodic_return": 20.0, "only_rank1": 9.0}, samples=4)
        before = repr(w.state_dict())
        means, samples = w.reduce(torch.device("cpu"))
        out = {"means": means, "order": list(means), "samples": samples, "unchanged": repr(w.state_dict()) == before}
    """)
    assert outs[0] == outs[1]  # every rank the same numbers, in the same order
    assert outs[0]["means"] == {"loss": 4.0, "episodic_return": 15.0, "only_rank1": 8.0}
    assert outs[0]["samples"] == 16 and outs[0]["unchanged"]


def test_gtrxl_ppo_trains_on_two_processes(tmp_path: Path) -> None:
    run = tmp_path / "ppo"
    r = train_cli("--nproc", "2", *PPO, "train.steps=8", "--run-dir", str(run))
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_metrics(run)
    assert [x["step"] for x in m] == [2, 4, 6, 8]
    # every process runs its own 2 environments x 16 steps per rollout (a rollout = 4 updates)
    assert [x["train/env_steps"] for x in m] == [64.0, 64.0, 128.0, 128.0]


# ------------------------------------------------------------- DDP resume off a log boundary
@pytest.mark.slow
def test_ddp_stop_between_log_lines_and_resume_is_bit_identical(tmp_path: Path) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    assert train_cli("--nproc", "2", *TOY_DDP, "--run-dir", str(full)).returncode == 0
    first = train_cli("--nproc", "2", *TOY_DDP, "--run-dir", str(split), "--stop-at", "7")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"continue with: rl-tformers train --resume {split} --nproc 2" in first.stderr
    state = torch.load(split / "checkpoints" / "step_000000007.pt", weights_only=True)
    assert len(state["trainer"]["window_ranks"]) == 2 and state["trainer"]["window_ranks"][0]["count"] == 2
    second = train_cli("--nproc", "2", "--resume", str(split))
    assert second.returncode == 0, second.stderr[-3000:]
    assert _train_keys(full) == _train_keys(split)  # every logged number, bit for bit
    a = torch.load(full / "checkpoints" / "step_000000020.pt", weights_only=True)["model"]
    b = torch.load(split / "checkpoints" / "step_000000020.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_resume_off_a_log_boundary_in_two_plain_processes_is_bit_identical(tmp_path: Path) -> None:
    """The same as the slow CLI test above, in one pair of processes (no torchrun start-up)."""
    two_ranks(tmp_path, f"""
        from pathlib import Path
        from rl_tformers.runtime.run_config import compose
        from rl_tformers.runtime.trainer import resume, train
        torch.set_num_threads(1)
        cfg = compose(None, {TOY_DDP!r})
        base = Path({str(tmp_path)!r})
        train(cfg, base / "full")
        assert train(cfg, base / "split", stop_at=7).step == 7
        resume(base / "split")
    """)
    assert _train_keys(tmp_path / "full") == _train_keys(tmp_path / "split")
    assert [m["step"] for m in read_metrics(tmp_path / "split")] == [5, 10, 15, 20]


def test_window_of_another_process_count_is_the_mean_of_the_ranks() -> None:
    ranks = []
    for loss, ret in ((1.0, 10.0), (3.0, None)):
        w = MetricWindow()
        w.add({"loss": torch.tensor(loss), **({"ret": ret} if ret is not None else {})}, samples=4)
        ranks.append(w.state_dict())
    one = MetricWindow()
    one.load_state_dict(MetricWindow.mean_state(ranks), torch.device("cpu"))
    assert one.means() == {"loss": 2.0, "ret": 10.0}
    one.add({"loss": torch.tensor(5.0)}, samples=8)  # an update of the resumed single process weighs as much
    assert one.means()["loss"] == pytest.approx(3.5)


# ------------------------------------------------------------------------ PPO resume is honest
# (the environments, the running episodes and the rollout in progress are checkpointed, so it is
# exact: tests/agents/test_gtrxl_ppo_resume.py)
def test_ppo_resume_is_exact_and_counts_env_steps_once(tmp_path: Path) -> None:
    full, split = tmp_path / "full", tmp_path / "split"
    assert train_cli(*PPO, "train.steps=12", "--run-dir", str(full)).returncode == 0
    assert train_cli(*PPO, "train.steps=12", "--run-dir", str(split), "--stop-at", "5").returncode == 0
    r = train_cli("--resume", str(split))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not bit-identical" not in r.stderr
    assert _train_keys(full) == _train_keys(split)
    # a rollout (2 envs x 16 steps) feeds 4 updates; a counter logs its latest value (the agent's
    # latest_logs), not the window's mean
    assert [m["train/env_steps"] for m in read_metrics(split)] == [32, 32, 64, 64, 96, 96]
    ea = torch.load(full / "checkpoints" / "step_000000012.pt", weights_only=True)["extra"]
    eb = torch.load(split / "checkpoints" / "step_000000012.pt", weights_only=True)["extra"]
    assert (ea["rollouts"], eb["rollouts"]) == (3, 3) and eb["env_steps"] == ea["env_steps"]


# ----------------------------------------------------- --nproc checks before torchrun starts
@pytest.mark.parametrize("args, says", [
    (["train.batch_size=7", "--run-dir", "RUN"], "train.batch_size=7 is the global batch and must be divisible by"),
    (["train.batch_size=1", "--run-dir", "RUN"], "train.batch_size=1 is the global batch"),
    (["train.batch_size=7"], "train.batch_size=7 is the global batch"),
    (["train.batch_sze=8", "--run-dir", "RUN"], "train.batch_sze: unknown key; did you mean train.batch_size?"),
])
def test_nproc_config_errors_are_one_line_before_any_process_starts(tmp_path: Path, args: list[str],
                                                                   says: str) -> None:
    args = [str(tmp_path / "run") if a == "RUN" else a for a in args]
    r = train_cli("--nproc", "2", "-c", "toy", "device=cpu", *args, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(_error_lines(r.stderr)) == 1 and says in _error_lines(r.stderr)[0]
    assert "launching" not in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


def test_nproc_resume_errors_are_one_line_before_any_process_starts(tmp_path: Path) -> None:
    r = train_cli("--nproc", "2", "--resume", str(tmp_path / "nonexistent"), timeout=60)
    assert r.returncode == 2 and _error_lines(r.stderr) == [
        f"error: --resume {tmp_path / 'nonexistent'} is not a directory: it does not exist (RUN_DIR is the run "
        f"directory of an earlier run)"]
    assert "launching" not in r.stderr and "Traceback" not in r.stderr
    run = tmp_path / "run"  # a 1-process run of batch 8, resumed on 3 processes: 8 is not divisible by 3
    assert train_cli(*TOY_DDP, "train.steps=2", "--run-dir", str(run)).returncode == 0
    r = train_cli("--nproc", "3", "--resume", str(run), "train.steps=4", timeout=60)
    assert r.returncode == 2 and "train.batch_size=8 is the global batch and must be divisible by the 3" in r.stderr
    assert len(_error_lines(r.stderr)) == 1 and "launching" not in r.stderr
    r = train_cli("--nproc", "2", "--resume", str(run), "train.lr=1", timeout=60)  # not a resumable key
    assert r.returncode == 2 and len(_error_lines(r.stderr)) == 1 and "train.lr" in r.stderr
    assert "launching" not in r.stderr


def test_error_inside_the_processes_is_printed_once_without_torchrun_traceback(tmp_path: Path) -> None:
    r = train_cli("--nproc", "2", "-c", "dt/cartpole_demo", f"dataset.path={tmp_path / 'nope.hdf5'}", "--device", "cpu",
             "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2, r.stderr[-3000:]
    assert _error_lines(r.stderr) == [f"error: dataset.path: no such HDF5 file: {tmp_path / 'nope.hdf5'}"]
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr


def test_resume_failure_under_torchrun_by_hand_is_one_line_from_rank_0(tmp_path: Path) -> None:
    """Without the launcher's checks (torchrun started by hand), rank 0's checkpoint error reaches
    the other ranks too, which exit quietly instead of dying in a barrier with a gloo traceback."""
    cmd = [sys.executable, "-m", "rl_tformers.runtime.torchrun", "--standalone", "--nproc-per-node=2",
           "-m", "rl_tformers.cli", "train", "--resume", str(tmp_path / "nonexistent")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(_error_lines(r.stderr)) == 1 and "is not a directory" in r.stderr
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr


# ------------------------------------------------------------------------------------- seeds
def test_seed_range_is_checked_up_front(tmp_path: Path) -> None:
    assert int(compose(None, ["agent.kind=toy", f"seed={2**64 - 1}"]).seed) == 2**64 - 1  # torch takes it
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\].*got 99999999999999999999"):
        compose(None, ["agent.kind=toy", "seed=99999999999999999999"])
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "toy", "seed=99999999999999999999", "--device", "cpu", "--run-dir", str(run)])
    assert r.exit_code == 2 and "error: seed must be an integer" in r.output and not run.exists()


# -------------------------------------------------------------------------------- DT under DDP
def test_dt_on_two_processes_equals_one_process_with_the_same_global_batch(tmp_path: Path) -> None:
    # episodes of 2..11 steps and windows of 4: the two halves of a batch hold different numbers
    # of padded steps, so the mean of per-shard means over unpadded steps (before the fix) differs
    # from the global mean: logged losses 2e-4 apart, weights 4e-3 after 10 updates
    ends = np.zeros(60, bool)
    ends[[2, 7, 9, 15, 18, 26, 29, 37, 44, 47, 53]] = True
    h5 = write_d4rl_h5(tmp_path / "d.hdf5", n=60, terminals=ends)
    args = ["-c", "dt/cartpole_demo", f"dataset.path={h5}", "train.steps=10", "train.batch_size=8",
            "train.log_every=5", "train.warmup_steps=1", "backbone.d_model=16", "backbone.n_layers=1",
            "agent.context_len=4", "agent.embed_dropout=0", "backbone.dropout=0", "backbone.attn_dropout=0",
            "eval.every=0", "eval.at_end=false", "train.progress=false", "--device", "cpu"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert train_cli(*args, "--run-dir", str(one)).returncode == 0
    r = train_cli("--nproc", "2", *args, "--run-dir", str(two))
    assert r.returncode == 0, r.stderr[-3000:]
    for ma, mb in zip(read_metrics(one), read_metrics(two), strict=True):  # now within float rounding (~1e-7)
        for key in ("train/loss", "train/action_acc", "train/grad_norm"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-6), (ma["step"], key)
    # weights: Adam divides the float-rounding differences of near-zero gradients by their tiny
    # sqrt(v), so a few entries move by up to ~5e-6 (lr 1e-3); the per-shard means moved them 4e-3
    a = torch.load(one / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    b = torch.load(two / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4)


_STARTED = "stopping the 2 processes (once training, they finish the current update and save a checkpoint first; " \
    "press Ctrl-C again to abort at once)"


def _launch(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``rl-tformers train --nproc 2 ARGS`` in a session of its own (so ``os.killpg`` is a Ctrl-C)."""
    return subprocess.Popen([sys.executable, "-m", "rl_tformers.cli", "train", "--nproc", "2", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)


def _lines_until(proc: subprocess.Popen, done) -> list[str]:
    """Lines of ``proc``'s stderr up to the first one for which ``done(line)`` holds (or its end)."""
    lines = []
    for line in proc.stderr:
        lines.append(line.rstrip("\n"))
        if done(line):
            break
    return lines


def test_ddp_sigint_is_reported_once_with_the_nproc_resume_hint(tmp_path: Path) -> None:
    from rl_tformers.runtime.checkpoint import list_checkpoints, load_checkpoint

    run = tmp_path / "run"
    proc = _launch([*TOY_DDP, "train.steps=1000000", "train.checkpoint_every=0", "--run-dir", str(run)], subprocess_env())
    # rank 0 prints its "run ..." line after every rank has agreed to start: a signal now stops
    # every rank at the same update boundary, with a checkpoint
    lines = _lines_until(proc, lambda line: line.startswith("run "))
    os.killpg(proc.pid, signal.SIGINT)
    lines += proc.communicate(timeout=300)[1].splitlines()
    assert proc.returncode == 130, lines
    (step, path), = list_checkpoints(run)  # the stop's checkpoint, the only one (checkpoint_every=0)
    state = load_checkpoint(path)  # verifies its digest
    assert state["step"] == step and len(state["trainer"]["rng_ranks"]) == 2  # saved by both ranks together
    assert lines[0].startswith("launching 2 processes: torchrun ") and lines[1].startswith(f"run {run} | agent toy")
    assert lines[2:] == [
        f"received SIGINT: {_STARTED}",
        f"stopped by SIGINT at step {step} of 1000000; checkpoint {path}; continue with: "
        f"rl-tformers train --resume {run} --nproc 2",
    ]
    assert all(m["step"] <= step for m in read_metrics(run))  # no log line beyond the checkpoint


# one write(2) per line: the two ranks share the pipe, and print() writes the text and the
# newline separately (lines from the two ranks could interleave)
_WAIT_IN_STARTUP = """
import os, signal, time
if os.environ.get("RANK") is not None:  # a rank: say so, then wait until a stop signal is pending
    os.write(2, f"rank {os.environ['RANK']} starting\\n".encode())
    while not set(signal.sigpending()) & {signal.SIGINT, signal.SIGTERM}:
        time.sleep(0.01)
"""


def test_ddp_sigint_during_the_ranks_start_up_is_one_line_and_130(tmp_path: Path) -> None:
    """A Ctrl-C while the ranks start (here: in sitecustomize, before `import torch`; the ranks
    start with SIGINT blocked, so it waits, pending, until `rl-tformers train` can act on it):
    one line from the launcher, exit 130, no traceback, nothing left in the run directory."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_WAIT_IN_STARTUP)
    run = tmp_path / "run"
    proc = _launch([*TOY_DDP, "train.steps=1000000", "--run-dir", str(run)], {**subprocess_env(), "PYTHONPATH": str(site)})
    starting: set[str] = set()
    lines = _lines_until(proc, lambda line: starting.add(line.strip()) or starting >= {"rank 0 starting",
                                                                                        "rank 1 starting"})
    os.killpg(proc.pid, signal.SIGINT)
    lines += proc.communicate(timeout=300)[1].splitlines()
    assert proc.returncode == 130, lines
    assert lines[0].startswith("launching 2 processes: torchrun ")
    assert sorted(lines[1:3]) == ["rank 0 starting", "rank 1 starting"]
    assert lines[3:] == [f"received SIGINT: {_STARTED}",
                         "interrupted by SIGINT before the first checkpoint: nothing to resume"]
    assert not run.exists()


def test_process_count_change_warning_once_with_the_right_plural(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train_cli(*TOY_DDP, "train.steps=2", "--run-dir", str(run)).returncode == 0
    r = train_cli("--nproc", "2", "--resume", str(run), "train.steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("resuming a run of 1 process with 2 processes") == 1, r.stderr
    assert "1 processes" not in r.stderr


# -- how a rank ends ----------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "status", "stderr"), [(None, 0, ""), (0, 0, ""), (2, 2, ""), (-1, 255, ""),
                                                          ("bad input", 1, "bad input\n")])
def test_exit_rank_flushes_the_output_and_exits_with_systemexits_status(code, status: int, stderr: str) -> None:
    script = ("import atexit, logging, sys\nfrom rl_tformers.runtime.distributed import exit_rank\n"
              "atexit.register(lambda: print('shutdown ran'))\nlogging.basicConfig(stream=sys.stderr, format='%(message)s')\n"
              "print('partial', end='')\nlogging.getLogger('x').warning('logged')\n"
              f"exit_rank({code!r})\n")
    env = {**subprocess_env(), "PYTHONUNBUFFERED": ""}  # buffered output must be flushed by exit_rank
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (status, "partial", "logged\n" + stderr)


_ATEXIT_MARK = """
import atexit, os
if os.environ.get("RANK") is not None:
    atexit.register(lambda: open(os.path.join(os.environ["MARK_DIR"], "rank" + os.environ["RANK"]), "w").close())
"""


def test_ddp_ranks_end_without_the_interpreter_shutdown(tmp_path: Path) -> None:
    """A DDP rank's gloo threads outlive destroy_process_group (a DDP built on the group keeps it); a rank
    that met them in the interpreter's shutdown aborted (SIGABRT) after the run was saved. The ranks
    end with exit_rank instead: no atexit handler runs in them, the command exits 0 with every line."""
    site, marks, run = tmp_path / "site", tmp_path / "marks", tmp_path / "run"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(_ATEXIT_MARK)
    env = {**subprocess_env(), "PYTHONPATH": str(site), "MARK_DIR": str(marks)}
    r = subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", "--nproc", "2", *TOY_DDP, "train.steps=4",
                        "--run-dir", str(run)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith(f"done: 4 steps in {run}")
    assert sorted(p.name for p in marks.iterdir()) == []
    assert [m["step"] for m in read_metrics(run)] == [4]
