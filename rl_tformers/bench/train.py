"""Benchmark: Decision Transformer training throughput against d3rlpy and Hugging Face, and model
FLOP utilisation (``rl-tformers bench train``).

Setting (the paper's, Chen et al. 2021, table 8): context K = 20 (60 tokens), 3 layers, 1 head,
128 dims, ReLU, dropout 0.1, batch 64, AdamW (lr 1e-4, weight decay 1e-4), grad clip 0.25,
linear warmup; the same Hopper dataset for everyone (``--dataset``, default
``rlt/hopper-v5/medium-v1``, which ``rl-tformers collect --recipe hopper-medium`` builds and
``dt/hopper_medium`` trains on). Measured, in one run and interleaved round by round (so a
change of machine load hits every implementation alike):

- **ours**: :class:`~rl_tformers.runtime.trainer.Trainer` built from ``dt/hopper_medium`` and
  driven through its own :meth:`~rl_tformers.runtime.trainer.Trainer.update` (the code
  ``rl-tformers train`` runs). Variants: ``ours`` (the shipped config, GPT-2's dropout
  placement: exactly the peers' model, the like-for-like row), optionally ``ours+bf16``
  (``train.amp=bf16``), ``ours+compile`` (``train.compile=true``) and ``ours-ffn-dropout``
  (``backbone.ffn_dropout=0.1``: dropout also on the feed-forward hidden layer, the placement
  the DT shipped before; ``--ffn-dropout-row``) and ``ours+torch-dropout`` (every dropout through
  ``F.dropout``, one Mersenne Twister draw per element, instead of the backbone library's four
  16-bit lanes per 64-bit draw, :mod:`rl_tformers.dropout`; ``--torch-dropout-row``).
- **d3rlpy** 2.8 ``DecisionTransformer`` (its reproduction-script settings) and **hf**
  ``transformers.DecisionTransformerModel`` (sdpa attention, ``torch.optim.AdamW``), each in a
  worker process of the peers' virtual environment (``--build-peers`` makes
  ``.bench-venvs/peers``; d3rlpy pins gymnasium 1.0.0, so it cannot share ours), same torch
  version and thread count, fed the same data (:func:`export_peer_data`), see
  :mod:`rl_tformers.bench._peer_dt`.

Two modes: ``e2e`` = sample a batch from the dataset + one update (what each library's
training loop does per step; Hugging Face has no offline-RL sampler, so no e2e row);
``model`` = one update on pre-sampled batches (forward, loss, backward, clip, AdamW step).
Reported: updates per second (median over ``--repeats`` rounds of ``--steps`` updates, after
``--warmup`` excluded updates), ratios to each peer, and **MFU** = FLOPs of one update
(``torch.utils.flop_counter.FlopCounterMode``: matmuls and attention of forward + backward)
x updates/s / the matmul peak: the fastest of n x n matmuls, n in ``--matmul-sizes``
(default 512, 1024, 2048), in the same dtype, thread count and device, measured in every round
(on this CPU the model's own 3840 x 128 x 128..512 GEMMs run faster than a 2048^3 one, so
the largest size alone would overstate MFU).

Command: ``rl-tformers bench train --threads 1 --repeats 5 --out bench_train.json``
(``--peer-python PATH`` to use another interpreter with d3rlpy + transformers).

``--task minatar-breakout`` (:data:`TASKS`) measures the pixel DT instead: ``dt/minatar_breakout``
(K = 30, 128 dims, 3 layers, 1 head, batch 64, the ``minatar_cnn`` encoder) on uint8
``(4, 10, 10)`` frames with Discrete(3) actions (``rlt/minatar-breakout/dqn-replay-v1``), its
``ours`` row in float32 (the config ships bf16 autocast: ``--bf16`` adds that row), against
d3rlpy's ``DiscreteDecisionTransformer`` with the same layers (Hugging Face's model has no pixel
path). ``--memory`` adds what each implementation holds: its observations' dtype and bytes and
its process's resident memory (after the imports, after data + model, peak after training).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from torch.utils.flop_counter import FlopCounterMode

from rl_tformers.agents.decision_transformer.agent import to_model_batch
from rl_tformers.bench.options import check_counts, check_device, check_out, emit_result, fail
from rl_tformers.dropout import torch_draws
from rl_tformers.runtime.cpu_matmul import onednn_linear_available, resolve_cpu_matmul
from rl_tformers.runtime.data import batch_stream
from rl_tformers.runtime.device import move_to
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.host import host_description
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import Trainer, _with_run_dir

PEERS = ("d3rlpy", "hf")
MODES = ("e2e", "model")
PEER_VENV = Path(".bench-venvs") / "peers"
PEER_PYTHON_ENV = "RL_TFORMERS_PEER_PYTHON"
#: pip requirements of the peers' virtual environment (torch is pinned to ours at build time);
#: MuJoCo (gymnasium 1.0.0, the version d3rlpy 2.8 pins) for the d3rlpy cross-check's Hopper-v5
#: evaluations (:mod:`rl_tformers.bench.crosscheck`)
PEER_REQUIREMENTS = ("d3rlpy>=2.8,<2.9", "transformers>=4.40", "gymnasium[mujoco]==1.0.0")
CONFIG = "dt/hopper_medium"
#: the optional row with dropout also on the feed-forward hidden layer (the DT's former default)
FFN_DROPOUT_ROW = "ours-ffn-dropout"
#: the row with PyTorch's own float32 GEMMs (MKL), measured where the shipped ``cpu_matmul: auto``
#: resolves to oneDNN (:mod:`rl_tformers.runtime.cpu_matmul`)
MKL_ROW = "ours+mkl"
#: the optional row whose dropouts draw from PyTorch's ``F.dropout`` (:func:`rl_tformers.dropout.torch_draws`)
TORCH_DROPOUT_ROW = "ours+torch-dropout"


def _peak_key(dtype: str, library: str) -> str:
    """``fp32`` for torch's own GEMM (MKL on the CPU), ``fp32/onednn`` for oneDNN's."""
    return dtype if library == "torch" else f"{dtype}/{library}"
DEFAULT_DATASET = "rlt/hopper-v5/medium-v1"  # what `collect --recipe hopper-medium` builds, dt/hopper_medium's


@dataclass(frozen=True)
class Task:
    """A measured setting: our config, its default dataset, the peers that have a path for its
    observations, and the overrides every variant of ours starts from.

    ``base`` makes the ``ours`` row full precision where the config ships ``train.amp=bf16``
    (``ours+bf16`` sets it back), so ``ours`` is always the float32 like-for-like row.
    """

    config: str
    dataset: str
    peers: tuple[str, ...]
    base: tuple[str, ...] = ()


#: ``--task``: ``hopper`` (vector observations, continuous actions; the default) and
#: ``minatar-breakout`` (uint8 (4, 10, 10) frames, Discrete(3) actions: the pixel DT)
TASKS = {
    "hopper": Task(CONFIG, DEFAULT_DATASET, PEERS),
    "minatar-breakout": Task("dt/minatar_breakout", "rlt/minatar-breakout/dqn-replay-v1", ("d3rlpy",),
                             ("train.amp=none",)),
}
#: why a peer is not measured on pixel observations
NO_PIXEL_PATH = {
    "hf": "transformers' DecisionTransformerModel embeds states with one Linear(state_dim, hidden) layer: no pixel encoder",
}


@dataclass
class Settings:
    """Benchmark settings (see the module docstring; times in seconds).

    ``dataset`` None: the task's dataset; ``peers`` None: the task's peers.
    """

    task: str = "hopper"
    dataset: str | None = None
    device: str = "cpu"
    threads: int = 1
    repeats: int = 5
    steps: int = 20
    warmup: int = 5
    peers: tuple[str, ...] | None = None
    peer_python: str | None = None
    bf16: bool = False
    compile: bool = False
    ffn_dropout_row: bool = False
    torch_dropout_row: bool = False
    matmul_sizes: tuple[int, ...] = (512, 1024, 2048)
    seed: int = 0
    overrides: tuple[str, ...] = ()
    memory: bool = False

    @property
    def spec(self) -> Task:
        return TASKS[self.task]

    @property
    def dataset_path(self) -> str:
        return self.dataset or self.spec.dataset

    @property
    def peer_list(self) -> tuple[str, ...]:
        return self.spec.peers if self.peers is None else tuple(self.peers)

    def check(self) -> None:
        """Raises:
            ValueError: an unknown task or peer, a peer without a path for the task's observations,
                a device that is not cpu or an available cuda, or a count below its least
                (``--steps``, ``--repeats``, ``--threads`` and every ``--matmul-sizes`` entry at
                least 1, ``--warmup`` at least 0).
        """
        check_counts(("--steps", self.steps), ("--repeats", self.repeats), ("--threads", self.threads),
                     *(("--matmul-sizes", n) for n in self.matmul_sizes))
        check_counts(("--warmup", self.warmup), lo=0)
        if not self.matmul_sizes:
            raise ValueError("--matmul-sizes is empty; give sizes like 512,1024,2048")
        check_device(self.device)
        if self.task not in TASKS:
            raise ValueError(f"--task {self.task!r}: choose from {', '.join(TASKS)}")
        unknown = [p for p in self.peer_list if p not in PEERS]
        if unknown:
            raise ValueError(f"--peers: unknown peers {unknown}; choose from {', '.join(PEERS)}")
        for p in self.peer_list:
            if p not in self.spec.peers:
                raise ValueError(f"--peers {p}: not measured on --task {self.task} ({NO_PIXEL_PATH.get(p, 'no path')}); "
                                 f"this task's peers: {', '.join(self.spec.peers)}")


@dataclass
class Result:
    settings: Settings
    rows: list[dict[str, Any]] = field(default_factory=list)
    ratios: list[dict[str, Any]] = field(default_factory=list)
    peak_gflops: dict[str, float] = field(default_factory=dict)
    peak_by_size: dict[str, dict[int, float]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: ``--memory``: implementation -> what its process holds (:func:`memory_probe`, the peers' ``memory``)
    memory: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"settings": {**dataclasses.asdict(self.settings), "dataset": self.settings.dataset_path,
                             "peers": list(self.settings.peer_list)},
                "machine": self.machine, "rows": self.rows,
                "ratios": self.ratios, "peak_gflops": self.peak_gflops, "peak_gflops_by_size": self.peak_by_size,
                "memory": self.memory, "notes": self.notes}


# -- machine / peak ---------------------------------------------------------------------------------

#: the host description every benchmark JSON records under ``machine`` (CPU vendor, family, model
#: and name, the avx512_bf16 / amx flags, threads, torch version, date, load average, GPU):
#: :func:`rl_tformers.runtime.host.host_description`
machine_info = host_description


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 2048, reps: int = 2,
                  library: str = "torch") -> float:
    """GFLOP/s of an n x n x n matmul (2 n^3 FLOPs) in ``dtype``: the best of ``reps`` after a warm-up.

    ``library``: ``torch`` (``a @ b``: MKL for float32 on the CPU) or ``onednn`` (oneDNN's
    ``a b^T``, :mod:`rl_tformers.runtime.cpu_matmul`; CPU only), so the peak is the faster of
    the two GEMM libraries of this PyTorch build, not the one a model happens to avoid.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    if library == "onednn":
        def mm() -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    else:
        def mm() -> torch.Tensor:
            return a @ b
    mm().sum().item()
    best = float("inf")
    for _ in range(max(1, reps)):
        sync(device)
        t0 = time.perf_counter()
        mm()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# -- ours -----------------------------------------------------------------------------------------

class OursRunner:
    """One of our variants: a Trainer from the task's config (:data:`TASKS`) plus the task's base
    overrides, ``--`` overrides and the variant's, driven step by step."""

    def __init__(self, name: str, s: Settings, overrides: Sequence[str], run_dir: Path) -> None:

        self.name = name
        cfg = compose(s.spec.config, [f"dataset.path={s.dataset_path}", f"device={s.device}", f"seed={s.seed}",
                                      "train.steps=1000000", *s.spec.base, *s.overrides, *overrides])
        self.trainer = Trainer(_with_run_dir(cfg, run_dir), run_dir)
        tr = self.trainer
        if bool(cfg.train.compile):
            tr.model.compile()
        tr.model.train()
        self.move_to = move_to
        self.source = tr.agent.batches(0)
        self.stream = iter(batch_stream(self.source, 0, 1_000_000, 0, pin_memory=tr.device.type == "cuda"))
        self.presampled = [move_to(self.source[i], tr.device) for i in range(8)]
        self.i = 0
        self.params = sum(p.numel() for p in tr.params)
        self.amp = tr.amp
        #: the GEMM library of the float32 CPU linear layers (``cpu_matmul``, ``auto`` resolved)
        self.cpu_matmul = str(tr.cfg.get("cpu_matmul", "mkl"))
        #: the dropout draws of its updates: PyTorch's (``TORCH_DROPOUT_ROW``) or the library's
        self.draws = torch_draws if name == TORCH_DROPOUT_ROW else contextlib.nullcontext

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    def step(self, mode: str) -> torch.Tensor:
        """One update (``e2e``: on the next sampled batch; ``model``: on a pre-sampled one); its
        loss, a 0-dim tensor on the device (not synchronised)."""
        with self.draws():
            return self._step(mode)

    def _step(self, mode: str) -> torch.Tensor:
        tr = self.trainer
        if mode == "e2e":  # the body of Trainer._train_step: next batch, to device, update, window
            batch = self.move_to(next(self.stream), tr.device)
            loss, grad_norm, logs = tr.update(batch)
            tr.window.add({"train/loss": loss, "train/grad_norm": grad_norm, **dict(logs)}, samples=64)
            return loss
        loss = tr.update(self.presampled[self.i % len(self.presampled)])[0]
        self.i += 1
        return loss

    def run(self, mode: str, steps: int) -> float:
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step(mode)
        sync(self.device)
        if mode == "e2e":
            self.trainer.window.reset()
        return time.perf_counter() - t0

    def flops(self) -> int:
        """FLOPs of one update (forward + backward matmuls/attention; FlopCounterMode)."""

        fc = FlopCounterMode(display=False)
        with fc, self.draws():
            self.trainer.update(self.presampled[0])
        return int(fc.get_total_flops())

    def close(self) -> None:
        self.stream = None


# -- peers ----------------------------------------------------------------------------------------

def default_peer_python() -> str | None:
    """``$RL_TFORMERS_PEER_PYTHON``, else ``.bench-venvs/peers/bin/python`` if it exists, else None."""
    env = os.environ.get(PEER_PYTHON_ENV)
    if env:
        return env
    p = PEER_VENV / "bin" / "python"
    return str(p) if p.exists() else None


def build_peer_venv(path: Path = PEER_VENV, echo: Callable[[str], None] = print) -> str:
    """Create ``path`` with the peers (d3rlpy 2.8, transformers) and *our* torch version.

    torch is installed first, on its own: from a local wheel when pip's configured find-links
    have one (``--no-index --no-deps``, as the Makefile probes), else, for a CPU build
    (``+cpu``), from PyTorch's CPU wheel index, else from PyPI; then the peers and torch's own
    dependencies from PyPI (torch stays as it is).
    Returns the venv's python.

    Raises:
        RuntimeError: a step failed (the message has pip's last output lines).
    """

    py = path / "bin" / "python"
    if not py.exists():
        echo(f"creating {path}")
        venv.EnvBuilder(with_pip=True).create(path)
    version = torch.__version__.split("+")[0]
    pip = [str(py), "-m", "pip", "install", "--quiet", "--timeout", "60"]

    def attempt(cmd: list[str]) -> subprocess.CompletedProcess:
        echo("$ " + " ".join(cmd))
        return subprocess.run(cmd, capture_output=True, text=True)

    tries = [[*pip, "--no-index", "--no-deps", f"torch=={version}"]]  # its dependencies come with the peers
    if "+cpu" in torch.__version__:
        tries.append([*pip, f"torch=={version}", "--index-url", "https://download.pytorch.org/whl/cpu"])
    tries.append([*pip, f"torch=={version}"])
    for cmd in tries:
        proc = attempt(cmd)
        if proc.returncode == 0:
            break
    else:
        raise RuntimeError(f"pip could not install torch=={version}:\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
    proc = attempt([*pip, *PEER_REQUIREMENTS])
    if proc.returncode != 0:
        raise RuntimeError(f"pip failed ({proc.returncode}):\n" + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
    check = subprocess.run([str(py), "-c", "import d3rlpy, transformers, torch, mujoco; print(torch.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"the peer environment does not import: {check.stderr[-2000:]}")
    if check.stdout.strip().split("+")[0] != version:
        raise RuntimeError(f"the peer environment has torch {check.stdout.strip()}, ours is {torch.__version__}")
    echo(f"peers ready in {path} (torch {check.stdout.strip()})")
    return str(py)


class PeerProcess:
    """A peer worker (:mod:`rl_tformers.bench._peer_dt`) speaking JSON lines over pipes."""

    def __init__(self, impl: str, python: str, data: Path, s: Settings, log_path: Path) -> None:
        script = Path(__file__).with_name("_peer_dt.py")
        env = {**os.environ, "OMP_NUM_THREADS": str(s.threads), "MKL_NUM_THREADS": str(s.threads),
               "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONPATH", None)
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [os.path.abspath(python), str(script), "--impl", impl, "--data", str(data), "--threads", str(s.threads),
             "--device", s.device, "--seed", str(s.seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=str(data.parent),
        )
        self.name = impl
        self.info = self._read()
        if not self.info.get("ready"):
            raise RuntimeError(f"peer {impl} did not start: {self.info}")

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.log.flush()
            tail = "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise RuntimeError(f"peer {self.name} exited (code {self.proc.poll()}):\n{tail}")
        return json.loads(line)

    def ask(self, **req: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise RuntimeError(f"peer {self.name}: {out['error']}")
        return out

    def run(self, mode: str, steps: int) -> float:
        return float(self.ask(cmd="run", mode=mode, steps=steps)["seconds"])

    def flops(self) -> int:
        return int(self.ask(cmd="flops")["flops"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
        self.log.close()


class PeerDataError(ValueError):
    """The dataset cannot be handed to the peers as they read it (e.g. stacked frames); bad input."""


def d4rl_arrays(d, action_start: int | None = None) -> dict[str, np.ndarray]:
    """The flat steps of an :class:`~rl_tformers.envs.dataset.EpisodeDataset` in D4RL layout, in
    episode-table order, as the peers read them: ``observations (N, obs)`` float32, or a pixel
    dataset's uint8 frames ``(N, C, H, W)`` as stored (no float copy); ``actions (N, A)`` float32,
    or with ``action_start`` (a ``Discrete`` space) ``(N,)`` int64 class indices
    ``action - action_start``; ``rewards (N,)`` float32, ``terminals`` / ``timeouts (N,)`` bool. Every episode ends
    with a flag (a last step with neither becomes a timeout: d3rlpy splits episodes on them). A
    step that is both terminated and truncated (a fall on the time limit's last step) is a
    terminal only: the MDP ended there, so nothing is bootstrapped (Gymnasium's semantics), and
    D4RL's layout, which d3rlpy checks, never sets both.

    Raises:
        PeerDataError: (a ValueError) a pixel dataset whose observation stacks ``frame_stack`` > 1
            stored frames (the peers read one stored row as one observation).
    """
    if d.is_pixel and d.frame_stack > 1:
        raise PeerDataError(f"the peers read one stored frame as one observation; this dataset stacks "
                         f"{d.frame_stack} frames per observation (frame_stack)")
    idx = d.flat_indices()
    terminals = d.terminations[idx].copy()
    timeouts = d.truncations[idx].copy()
    last = d.cum_lengths[1:] - 1
    timeouts[last] |= ~terminals[last]
    timeouts &= ~terminals
    if d.is_pixel:
        obs = np.asarray(d.observations[idx])  # (N, C, H, W) uint8
    else:
        obs = np.asarray(d.observations[idx], dtype=np.float32).reshape(len(idx), -1)
    if action_start is None:
        actions = np.asarray(d.actions[idx], dtype=np.float32)
    else:
        actions = np.asarray(d.actions[idx]).astype(np.int64).reshape(len(idx)) - int(action_start)
    return {"observations": obs, "actions": actions, "rewards": d.rewards[idx].astype(np.float32),
            "terminals": terminals, "timeouts": timeouts}


def export_peer_data(runner: OursRunner, path: Path, n_batches: int = 8) -> Path:
    """Write what the peers train on to ``path`` (.npz): the flat dataset in D4RL layout and
    ``n_batches`` batches from our sampler, already in model units (see ``_peer_dt``)."""

    agent = runner.trainer.agent
    info = agent.info
    batches = [to_model_batch({k: v for k, v in agent.batches(0)[i].items()}, info) for i in range(n_batches)]
    mc = agent.model_cfg
    tc = runner.trainer.cfg.train
    bb = mc.backbone
    meta = {"obs_dim": mc.obs_dim, "act_dim": mc.act_dim, "context_len": mc.context_len, "max_ep_len": mc.max_ep_len,
            "d_model": bb.d_model, "n_layers": bb.n_layers, "n_heads": bb.n_heads,
            "batch_size": int(tc.batch_size), "reward_scale": float(info.reward_scale),
            "discrete": bool(info.discrete), "image_obs": bool(info.image_obs), "obs_shape": list(info.obs_shape),
            "lr": float(tc.lr), "weight_decay": float(tc.weight_decay), "grad_clip": float(tc.grad_clip),
            "dropout": float(bb.dropout), "attn_dropout": float(bb.attn_dropout), "activation": str(bb.activation)}
    if info.image_obs:  # the encoder the peer rebuilds (minatar_cnn: conv (out, kernel, stride) list, fc width)
        enc = runner.trainer.cfg.agent.encoder
        if enc.kind != "minatar_cnn":
            raise PeerDataError(f"the d3rlpy peer rebuilds agent.encoder.kind=minatar_cnn only, not {enc.kind}")
        meta["encoder"] = {"filters": [[16, 3, 1]], "features": int(enc.get("features", 128))}
    arrays = d4rl_arrays(agent.dataset, info.action_start if info.discrete else None)
    np.savez(
        path, **arrays, meta=json.dumps(meta),
        b_obs=np.stack([b["obs"].numpy() for b in batches]), b_actions=np.stack([b["actions"].numpy() for b in batches]),
        b_rtg=np.stack([b["rtg"].numpy() for b in batches]), b_timesteps=np.stack([b["timesteps"].numpy() for b in batches]),
        b_mask=np.stack([b["mask"].numpy() for b in batches]),
    )
    return path


# -- the benchmark --------------------------------------------------------------------------------

def our_variants(s: Settings) -> list[tuple[str, list[str]]]:
    """(name, overrides) of our measured variants."""
    out = [("ours", [])]
    if s.bf16:
        out.append(("ours+bf16", ["train.amp=bf16"]))
    if s.compile:
        out.append(("ours+compile", ["train.compile=true"]))
    if s.ffn_dropout_row:
        out.append((FFN_DROPOUT_ROW, ["backbone.ffn_dropout=0.1"]))
    if s.torch_dropout_row:
        out.append((TORCH_DROPOUT_ROW, []))
    if s.device == "cpu" and resolve_cpu_matmul("auto") != "mkl" and not any(
            o.startswith("cpu_matmul=") for o in s.overrides):
        out.append((MKL_ROW, ["cpu_matmul=mkl"]))  # the shipped default runs oneDNN here: show MKL's
    return out


def _start_peers(s: Settings, first: Any, work: Path, impls: dict[str, Any], res: Result,
                 log: Callable[[str], None]) -> None:
    """Start the peer libraries' processes on the data of ``first`` (our first implementation)
    into ``impls``; a peer that cannot start, or no peer environment, is a note in ``res``."""
    peer_python = s.peer_python or default_peer_python()
    if s.peer_list and peer_python is None:
        res.notes.append("peers skipped: no peer environment (run with --build-peers, or give --peer-python)")
    elif s.peer_list:
        data = export_peer_data(first, work / "bench_data.npz")
        for peer in s.peer_list:
            log(f"starting peer {peer} ({peer_python})")
            try:
                impls[peer] = PeerProcess(peer, peer_python, data, s, work / f"{peer}.log")
            except Exception as exc:  # a peer that cannot start is reported, not fatal
                res.notes.append(f"peer {peer} skipped: {exc}")
                log(res.notes[-1])


def _proc_status_bytes(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (None where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int | None:
    """This process's resident memory now (``/proc/self/status`` VmRSS, bytes; None where there is none)."""
    return _proc_status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, bytes: ``/proc/self/status`` VmHWM (the peak of
    this process image, never below the current RSS), else ``getrusage``'s ``ru_maxrss`` (KiB on
    Linux; it also keeps the parent's peak across fork and exec, so a subprocess of a large
    process reads that)."""
    hwm = _proc_status_bytes("VmHWM")
    return hwm if hwm is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def memory_probe(s: Settings) -> dict[str, Any]:
    """What ``ours`` holds, measured in a process of its own (this one also holds our other
    variants): ``rss_start`` (bytes resident after the imports), ``rss_built`` (after loading the
    dataset and building the trainer), ``peak_rss_built`` (the process's peak RSS by then: loading
    included), ``peak_rss`` (its peak after ``warmup + steps`` more e2e updates),
    ``observations_dtype`` / ``observations_bytes`` (the dataset's observation array as held in
    memory).

    Raises:
        RuntimeError: the probe process failed (the message has its last stderr lines).
    """
    env = {**os.environ, "OMP_NUM_THREADS": str(s.threads), "MKL_NUM_THREADS": str(s.threads)}
    with tempfile.TemporaryDirectory(prefix="rlt-bench-memory-") as d:
        out = Path(d) / "memory.json"
        proc = subprocess.run([sys.executable, "-m", "rl_tformers.bench.train", json.dumps(dataclasses.asdict(s)),
                               str(out)], capture_output=True, text=True, env=env)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"memory probe exited {proc.returncode}: " + "\n".join(proc.stderr.splitlines()[-10:]))
        return json.loads(out.read_text())


def _memory_main(settings_json: str, out: str) -> None:
    """The process of :func:`memory_probe`: build ``ours`` from ``settings_json``, train, write ``out``."""
    d = json.loads(settings_json)
    s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    torch.set_num_threads(max(1, s.threads))
    start = rss_bytes()
    with tempfile.TemporaryDirectory(prefix="rlt-bench-memory-run-") as run_dir:
        runner = OursRunner("ours", s, [], Path(run_dir) / "ours")
        built, peak_built = rss_bytes(), peak_rss_bytes()
        runner.run("e2e", s.warmup + s.steps)
        obs = runner.trainer.agent.dataset.observations
        result = {"rss_start": start, "rss_built": built, "peak_rss_built": peak_built, "peak_rss": peak_rss_bytes(),
                  "observations_dtype": str(obs.dtype),
                  "observations_bytes": int(np.prod(obs.shape)) * np.dtype(obs.dtype).itemsize,
                  "observations_held": "one array of the dataset's steps as stored"}
        runner.close()
    Path(out).write_text(json.dumps(result))


def _measure_memory(res: Result, impls: dict[str, Any]) -> None:
    """``--memory`` into ``res.memory``: with no ``impls``, ours (:func:`memory_probe`); else each
    peer process of ``impls`` (its ``memory`` reply, after the rounds). A failure is a note."""
    if not impls:
        try:
            res.memory["ours"] = memory_probe(res.settings)
        except RuntimeError as exc:
            res.notes.append(f"ours: memory probe failed: {exc}")
    for name, impl in impls.items():
        if isinstance(impl, PeerProcess):
            try:
                res.memory[name] = impl.ask(cmd="memory")
            except RuntimeError as exc:
                res.notes.append(f"{name}: memory not measured: {exc}")


def _row(name: str, mode: str, ts: list[float], steps: int, f: float | None, impl: Any,
         peak_gflops: dict[str, float]) -> dict[str, Any]:
    """One implementation's row in one mode: ``steps`` updates took ``ts`` seconds per round;
    ``f`` its FLOPs per update (None: not counted), MFU against the peak of its dtype."""
    rate = [steps / t for t in ts]
    amp = "bf16" if name.endswith("+bf16") else "fp32"
    med = statistics.median(rate)
    info = getattr(impl, "info", {})
    return {
        "impl": name, "mode": mode, "steps_per_s": med, "steps_per_s_all": rate,
        "flops_per_step": f, "gflops_per_s": None if f is None else f * med / 1e9,
        "mfu": None if f is None else f * med / 1e9 / peak_gflops[amp], "peak_dtype": amp,
        "params": info.get("params", getattr(impl, "params", None)),
        "versions": info.get("versions"), "attention": info.get("attn_implementation"),
        "cpu_matmul": getattr(impl, "cpu_matmul", None),
    }


def run(s: Settings, log: Callable[[str], None] | None = None) -> Result:
    """Measure every implementation (see the module docstring); never raises for a peer that
    cannot run: it is left out with a note."""
    log = log or (lambda m: None)
    s.check()
    if s.device == "cpu":
        torch.set_num_threads(max(1, s.threads))
    res = Result(settings=s)
    if s.memory:
        log("measuring the memory of ours in a process of its own")
        _measure_memory(res, {})
    work = Path(tempfile.mkdtemp(prefix="rlt-bench-train-"))
    impls: dict[str, Any] = {}
    try:
        for name, ov in our_variants(s):
            log(f"building {name} ({' '.join(ov) or 'shipped config'})")
            impls[name] = OursRunner(name, s, ov, work / name)
        first = next(iter(impls.values()))
        device = first.device
        res.machine = machine_info(device)
        _start_peers(s, first, work, impls, res, log)
        modes = {name: ([m for m in MODES if m != "e2e"] if name == "hf" else list(MODES)) for name in impls}
        flops = {}
        for name, impl in impls.items():
            try:
                flops[name] = impl.flops()
            except Exception as exc:
                res.notes.append(f"{name}: FLOP count failed: {exc}")
            for mode in modes[name]:
                impl.run(mode, s.warmup)  # warm-up, excluded
        times: dict[tuple[str, str], list[float]] = {(n, m): [] for n in impls for m in modes[n]}
        dtypes = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if s.bf16 else {})}
        libraries = {k: ("torch", "onednn") if k == "fp32" and device.type == "cpu" and onednn_linear_available()
                     else ("torch",) for k in dtypes}
        peaks: dict[str, dict[int, list[float]]] = {
            _peak_key(k, lib): {n: [] for n in s.matmul_sizes} for k in dtypes for lib in libraries[k]}
        for r in range(max(1, s.repeats)):
            for k, dt in dtypes.items():
                for lib in libraries[k]:
                    for n in s.matmul_sizes:
                        peaks[_peak_key(k, lib)][n].append(matmul_gflops(device, dt, n, library=lib))
            for name, impl in impls.items():
                for mode in modes[name]:
                    times[(name, mode)].append(impl.run(mode, s.steps))
            log(f"round {r + 1}/{s.repeats}: " + ", ".join(
                f"{n}/{m} {s.steps / t[-1]:.2f}/s" for (n, m), t in times.items()))
        res.peak_by_size = {k: {n: statistics.median(v) for n, v in by.items()} for k, by in peaks.items()}
        res.peak_gflops = {k: max(max(by.values()) for key, by in res.peak_by_size.items() if key.split("/")[0] == k)
                           for k in dtypes}  # the faster GEMM library of each dtype
        res.rows.extend(_row(name, mode, ts, s.steps, flops.get(name), impls[name], res.peak_gflops)
                        for (name, mode), ts in times.items())
        res.ratios = ratios(res.rows)
        if s.memory:
            _measure_memory(res, impls)
        res.machine["loadavg_1_5_15_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    finally:
        for impl in impls.values():
            impl.close()
        shutil.rmtree(work, ignore_errors=True)
    return res


def ratios(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: each of our variants' steps/s divided by each peer's (and by ``ours``)."""
    out = []
    by = {(r["impl"], r["mode"]): r["steps_per_s"] for r in rows}
    ours = [r["impl"] for r in rows if r["impl"].startswith("ours")]
    others = [r["impl"] for r in rows if not r["impl"].startswith("ours")]
    for mode in MODES:
        for a in dict.fromkeys(ours):
            for b in dict.fromkeys([*others, "ours"]):
                if a != b and (a, mode) in by and (b, mode) in by:
                    out.append({"mode": mode, "impl": a, "vs": b, "ratio": by[(a, mode)] / by[(b, mode)]})
    return out


def markdown(res: Result) -> str:
    """Throughput/MFU table and ratio table."""
    def fmt(v: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
        return "-" if v is None else format(v * scale, spec) + suffix

    lines = ["| impl | mode | updates/s | GFLOP/update | GFLOP/s | MFU | params |", "|---|---|---|---|---|---|---|"]
    for r in res.rows:
        lines.append(
            f"| {r['impl']} | {r['mode']} | {r['steps_per_s']:.2f} | {fmt(r['flops_per_step'], '.2f', 1e-9)} | "
            f"{fmt(r['gflops_per_s'], '.1f')} | {fmt(r['mfu'], '.0f', 100, '%')} ({r['peak_dtype']}) | "
            f"{r['params'] or '-'} |"
        )
    peaks = "; ".join(f"{k} " + ", ".join(f"n={n}: {g:.0f}" for n, g in by.items()) for k, by in res.peak_by_size.items())
    peaks += " (peak: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in res.peak_gflops.items()) + ")"
    lines += ["", f"matmul peak (best n x n x n, {res.machine.get('threads')} threads): {peaks}", ""]
    if res.memory:
        lines += memory_lines(res.memory) + [""]
    if not res.ratios:  # --peers '' and no other variant: nothing to compare against
        lines.append("no ratios: no peer (--peers) and no other variant of ours was measured")
        return "\n".join(lines)
    lines += ["| mode | ours variant | vs | ratio |", "|---|---|---|---|"]
    lines += [f"| {q['mode']} | {q['impl']} | {q['vs']} | {q['ratio']:.2f}x |" for q in res.ratios]
    return "\n".join(lines)


def memory_lines(memory: dict[str, dict[str, Any]]) -> list[str]:
    """The ``--memory`` table: each implementation's observations in memory and its process's RSS."""
    def mib(v: int | None) -> str:
        return "-" if v is None else f"{v / 2**20:.1f} MiB" if v < 10 * 2**20 else f"{v / 2**20:.0f} MiB"

    lines = ["| impl | observations held | RSS after imports | after data + model | peak by then | "
             "peak after training |", "|---|---|---|---|---|---|"]
    for name, m in memory.items():
        lines.append(f"| {name} | {m.get('observations_dtype')}, {mib(m.get('observations_bytes'))} | "
                     f"{mib(m.get('rss_start'))} | {mib(m.get('rss_built'))} | {mib(m.get('peak_rss_built'))} | "
                     f"{mib(m.get('peak_rss'))} |")
    return lines


def register(bench_app) -> None:
    """Add the ``train`` command to the ``bench`` Typer group."""

    def train(
        task: str = typer.Option("hopper", help=f"Setting: {', '.join(TASKS)} (config, default dataset, peers)."),
        dataset: str = typer.Option(None, help="Dataset spec (Minari id, folder or D4RL .hdf5); default: the task's."),
        device: str = typer.Option("cpu", help="cpu or cuda."),
        threads: int = typer.Option(1, help="Intra-op threads of every implementation (CPU)."),
        repeats: int = typer.Option(5, help="Timed rounds (median reported)."),
        steps: int = typer.Option(20, help="Updates per round and implementation."),
        warmup: int = typer.Option(5, help="Updates before the rounds (excluded)."),
        peers: str = typer.Option(None, help="Peers to measure: d3rlpy,hf (empty: none); default: the task's."),
        peer_python: str = typer.Option(None, help="Python of an environment with d3rlpy 2.8 and transformers."),
        build_peers: bool = typer.Option(False, "--build-peers", help=f"Create/update {PEER_VENV} first."),
        bf16: bool = typer.Option(False, "--bf16", help="Also measure ours with train.amp=bf16 (MFU vs a bf16 peak)."),
        compile_: bool = typer.Option(False, "--compile", help="Also measure ours with train.compile=true."),
        ffn_dropout_row: bool = typer.Option(
            False, "--ffn-dropout-row", help=f"Also measure {FFN_DROPOUT_ROW} (backbone.ffn_dropout=0.1)."),
        torch_dropout_row: bool = typer.Option(
            False, "--torch-dropout-row", help=f"Also measure {TORCH_DROPOUT_ROW} (every dropout through F.dropout)."),
        matmul_sizes: str = typer.Option("512,1024,2048", help="Sizes n of the n x n matmuls of the peak."),
        memory: bool = typer.Option(
            False, "--memory", help="Also measure each implementation's observations and process RSS."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
        out: str = typer.Option(None, "--out", help="Also write the JSON results to this file."),
        overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Extra overrides for ours."),
    ) -> None:
        """DT training updates/s vs d3rlpy and Hugging Face (same data, threads, model), and MFU."""

        peer_list = None if peers is None else tuple(p.strip() for p in peers.split(",") if p.strip())
        unknown = [p for p in peer_list or () if p not in PEERS]
        if unknown:
            raise typer.BadParameter(f"unknown peers {unknown}; choose from {', '.join(PEERS)}", param_hint="--peers")
        sizes = [x.strip() for x in matmul_sizes.split(",") if x.strip()]
        bad = [x for x in sizes if not x.isdigit()]
        if bad:
            fail(f"--matmul-sizes {matmul_sizes!r}: {bad[0]!r} is not a whole number (e.g. 512,1024,2048)")
        s = Settings(task=task, dataset=dataset, device=device, threads=threads, repeats=repeats, steps=steps,
                     warmup=warmup, peers=peer_list, peer_python=peer_python, bf16=bf16, compile=compile_,
                     ffn_dropout_row=ffn_dropout_row, torch_dropout_row=torch_dropout_row, matmul_sizes=tuple(int(x) for x in sizes),
                     overrides=tuple(overrides or ()), memory=memory)
        try:
            s.check()
        except ValueError as exc:
            fail(str(exc))
        check_out(out)
        if build_peers:
            peer_python = build_peer_venv(echo=lambda m: typer.echo(m, err=True))
            s = dataclasses.replace(s, peer_python=peer_python)
        try:
            res = run(s, log=lambda m: typer.echo(m, err=True))
        except ConfigError as exc:  # an override, or the dataset our config cannot train on (AgentBuildError)
            msg = str(exc)  # the dataset is --dataset here, dataset.path only inside the composed config
            fail(f"--dataset{msg.removeprefix('dataset.path')}" if dataset and msg.startswith("dataset.path:") else msg)
        except PeerDataError as exc:
            fail(f"--dataset {s.dataset_path}: {exc}; measure ours alone with --peers ''")
        emit_result(res.as_dict(), markdown(res), res.notes, out=out, as_json=as_json)

    bench_app.command("train")(train)


if __name__ == "__main__":  # the process of memory_probe
    _memory_main(sys.argv[1], sys.argv[2])
