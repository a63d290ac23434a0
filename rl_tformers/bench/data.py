"""Benchmark: the data pipeline (``rl-tformers bench data``).

1. **Samplers vs training.** Samples (windows / segments) per second of the data layer's
   :class:`~rl_tformers.envs.samplers.WindowSampler` (Decision Transformer, ``dt/hopper_medium``:
   K = 20) and :class:`~rl_tformers.envs.samplers.SegmentSampler` (GTrXL,
   ``gtrxl/hopper_positions_bc``: burn-in 16 + 16 steps), read exactly as training reads them
   (the agent's ``batches()``: ``StepBatchDataset[s]``, a fresh ``default_rng([seed, s])`` per
   batch, NumPy -> torch), against the samples per second the same agent's trainer consumes
   (updates/s x batch size, measured in the same run on the same dataset). The headroom (sampler / training) must be >= 10x
   so data never limits training.
2. **Loading a 1M-step dataset.** A synthetic D4RL-layout HDF5 file (``--steps`` steps,
   Hopper-sized: 11-dim observations and next observations, 3-dim actions, 1000-step episodes
   with some early terminations; writing it is not timed) loaded with
   :func:`rl_tformers.envs.loaders.load_dataset` eagerly (everything in memory, validated) and
   lazily (observations/actions stay on disk), then the first DT batch (the sampler's
   precomputed returns-to-go over all steps included).

3. **Pixel frames.** A synthetic D4RL-layout HDF5 file of ``--pixel-steps`` (200k) grey 84x84
   uint8 frames stored once, ``frame_stack`` 4 in its metadata (Atari's layout,
   :mod:`rl_tformers.envs.frames`), loaded eagerly with :func:`~rl_tformers.envs.loaders.load_dataset`:
   the memory it takes (the observation array's bytes against the frames' bytes, and the peak of
   the allocations ``tracemalloc`` sees during the load, validation included), then the DT window
   sampler (K = ``--pixel-context``, 30 as the DT's Atari code) and the GTrXL segment sampler
   reading ``(B, L, 4, 84, 84)`` uint8 stacks through ``StepBatchDataset``, against what a pixel
   agent's training can consume at most: B samples per forward and backward pass of the Nature
   CNN (Mnih et al. 2015) over the B x K stacks alone, a lower bound of any pixel update's time
   (the transformer and optimiser come on top), so the headroom shown is a lower bound too.

Command: ``rl-tformers bench data --out bench_data.json`` (``--steps 1000000``).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer

from rl_tformers.bench import data_device
from rl_tformers.bench.options import run_checked
from rl_tformers.bench.train import DEFAULT_DATASET, machine_info
from rl_tformers.envs.frames import FRAME_STACK_KEY
from rl_tformers.envs.loaders import load_dataset
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import StepBatchDataset
from rl_tformers.runtime.agent_registry import AgentBuildError
from rl_tformers.runtime.device import move_to
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import Trainer, _with_run_dir


@dataclass
class Settings:
    """Benchmark settings."""

    dataset: str = DEFAULT_DATASET
    batch_size: int = 64
    context_len: int = 20
    seq_len: int = 32
    burn_in: int = 32
    batches: int = 200
    repeats: int = 3
    train_steps: int = 10
    threads: int = 1
    steps: int = 1_000_000
    keep: str | None = None
    skip_training: bool = False
    skip_load: bool = False
    pixel_steps: int = 200_000
    pixel_context: int = 30
    skip_pixels: bool = False
    pixels_only: bool = False
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot give a measurement, naming the CLI option.

        Raises:
            ValueError: a count below 1 (``--batch-size``, ``--batches``, ``--repeats``,
                ``--train-steps``, ``--threads``, ``--steps``, ``--pixel-steps``,
                ``--pixel-context``), or ``--keep`` naming a file.
        """
        for option, value in (("--batch-size", self.batch_size), ("--batches", self.batches),
                              ("--repeats", self.repeats), ("--train-steps", self.train_steps),
                              ("--threads", self.threads), ("--steps", self.steps),
                              ("--pixel-steps", self.pixel_steps), ("--pixel-context", self.pixel_context)):
            if int(value) < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if self.keep and Path(self.keep).exists() and not Path(self.keep).is_dir():
            raise ValueError(f"--keep {self.keep} is a file; give a folder to keep the synthetic file in")


@dataclass
class Result:
    settings: Settings
    samplers: list[dict[str, Any]] = field(default_factory=list)
    load: list[dict[str, Any]] = field(default_factory=list)
    pixels: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"settings": dataclasses.asdict(self.settings), "machine": self.machine, "samplers": self.samplers,
                "load": self.load, "pixels": self.pixels, "notes": self.notes}


def sampler_rate(ds: torch.utils.data.Dataset, batches: int, repeats: int, batch_size: int) -> float:
    """Samples per second of ``ds[s]`` (median over ``repeats`` runs of ``batches`` batches).

    Raises:
        ValueError: ``batches``, ``repeats`` or ``batch_size`` below 1.
    """
    if min(batches, repeats, batch_size) < 1:
        raise ValueError(f"sampler_rate: batches, repeats and batch_size must be >= 1, got "
                         f"{batches}, {repeats}, {batch_size}")
    ds[0]  # warm-up
    rates = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for s in range(batches):
            ds[(r * batches + s) % len(ds)]
        rates.append(batches * batch_size / (time.perf_counter() - t0))
    return statistics.median(rates)


def build_trainer(config: str, overrides: list[str]):
    """A :class:`~rl_tformers.runtime.trainer.Trainer` of ``config`` on CPU (nothing written)."""

    run_dir = Path(tempfile.mkdtemp(prefix="rlt-bench-data-"))
    cfg = compose(config, ["device=cpu", "train.steps=1000000000", *overrides])
    return Trainer(_with_run_dir(cfg, run_dir), run_dir)


def training_rate(tr: Any, steps: int) -> float:
    """Samples/s the trainer ``tr`` consumes: updates/s on pre-read batches x batch size.

    Raises:
        ValueError: ``steps`` below 1 (no timed update).
    """

    if steps < 1:
        raise ValueError(f"training_rate: steps must be >= 1, got {steps}")

    src = tr.agent.batches(0)
    batches = [move_to(src[i], tr.device) for i in range(4)]
    tr.model.train()
    tr.update(batches[0])
    t0 = time.perf_counter()
    for i in range(steps):
        tr.update(batches[i % 4])
    return steps * int(tr.cfg.train.batch_size) / (time.perf_counter() - t0)


def write_synthetic_d4rl(path: Path, steps: int, obs_dim: int = 11, act_dim: int = 3, ep_len: int = 1000,
                         seed: int = 0) -> Path:
    """A D4RL-layout HDF5 file of ``steps`` random steps: ``observations``, ``next_observations``
    (float32, obs_dim), ``actions`` (float32 in [-1, 1]), ``rewards``, ``terminals`` (about one
    in four episodes ends early), ``timeouts`` (every ``ep_len`` steps otherwise)."""
    import h5py

    rng = np.random.default_rng(seed)
    ends = []
    t = 0
    while t < steps:
        n = ep_len if rng.random() < 0.75 else int(rng.integers(20, ep_len))
        t = min(steps, t + n)
        ends.append((t - 1, n == ep_len))
    terminals = np.zeros(steps, dtype=bool)
    timeouts = np.zeros(steps, dtype=bool)
    for end, full in ends:
        (timeouts if full else terminals)[end] = True
    obs = rng.standard_normal((steps, obs_dim), dtype=np.float32)
    with h5py.File(path, "w") as f:
        f["observations"] = obs
        f["next_observations"] = np.roll(obs, -1, axis=0)
        f["actions"] = rng.uniform(-1, 1, (steps, act_dim)).astype(np.float32)
        f["rewards"] = rng.standard_normal(steps).astype(np.float32)
        f["terminals"] = terminals
        f["timeouts"] = timeouts
    return path


def write_synthetic_frames(path: Path, steps: int, frame_stack: int = 4, side: int = 84, ep_len: int = 2000,
                           seed: int = 0) -> Path:
    """A D4RL-layout HDF5 file of ``steps`` uint8 frames ``(1, side, side)`` (random pixels),
    Discrete(4) actions, rewards in {0, 1} and ``ep_len``-step episodes (the last one shorter),
    ``frame_stack`` in its ``rl_tformers_metadata``: an Atari dataset's layout. Written in chunks."""
    import h5py

    rng = np.random.default_rng(seed)
    ends = np.zeros(steps, dtype=bool)
    ends[ep_len - 1::ep_len] = True
    ends[-1] = True
    with h5py.File(path, "w") as f:
        obs = f.create_dataset("observations", (steps, 1, side, side), dtype=np.uint8)
        for a in range(0, steps, 10_000):
            b = min(steps, a + 10_000)
            obs[a:b] = rng.integers(0, 256, (b - a, 1, side, side), dtype=np.uint8)
        f["actions"] = rng.integers(0, 4, steps).astype(np.int64)
        f["rewards"] = (rng.random(steps) < 0.05).astype(np.float32)
        f["terminals"] = ends
        f["timeouts"] = np.zeros(steps, dtype=bool)
        f.attrs["rl_tformers_metadata"] = json.dumps({FRAME_STACK_KEY: int(frame_stack)})
    return path


class NatureCNN(torch.nn.Module):
    """Mnih et al. 2015's encoder: 32 8x8/4, 64 4x4/2, 64 3x3/1 convolutions, 512 units; input
    ``(N, C, 84, 84)`` uint8, scaled by 1/255 -> ``(N, 512)``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(channels, 32, 8, stride=4), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 4, stride=2),
            torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, stride=1), torch.nn.ReLU(), torch.nn.Flatten(),  # (N, 3136)
            torch.nn.Linear(3136, 512), torch.nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float() / 255.0)


def encoder_rate(batch: dict[str, torch.Tensor], steps: int) -> float:
    """Samples/s of the Nature CNN's forward and backward pass over every stack of ``batch``
    (``observations (B, K, C, H, W)`` uint8; median over ``steps`` passes after one warm-up)."""
    obs = batch["observations"]
    b, k = obs.shape[:2]
    net = NatureCNN(obs.shape[2])
    flat = obs.reshape(b * k, *obs.shape[2:])  # (B*K, C, H, W)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        net(flat).sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return b / statistics.median(times)


def _rss_mib() -> float:
    """This process's resident memory in MiB (``/proc/self/status`` VmRSS; NaN elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def pixel_part(path: Path, s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """Part 3 (see the module docstring) on the frame file ``path``."""
    rss0 = _rss_mib()
    tracemalloc.start()
    ds = load_dataset(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    frame_bytes = ds.num_steps * int(np.prod(ds.frame_shape))
    out: dict[str, Any] = {
        "steps": ds.num_steps, "episodes": ds.num_episodes, "frame_shape": list(ds.frame_shape),
        "observation_shape": list(ds.observation_shape), "frame_stack": ds.frame_stack,
        "observation_dtype": str(ds.observations.dtype), "frames_mib": frame_bytes / 2**20,
        "observations_mib": ds.observations.nbytes / 2**20, "memory_ratio": ds.observations.nbytes / frame_bytes,
        "load_peak_mib": peak / 2**20, "load_peak_ratio": peak / frame_bytes, "rss_growth_mib": _rss_mib() - rss0,
        "samplers": []}
    log(f"pixels: {ds.num_steps} frames {tuple(ds.frame_shape)} uint8 = {out['frames_mib']:.0f} MiB; observations "
        f"in memory {out['observations_mib']:.0f} MiB ({out['memory_ratio']:.2f}x), load peak "
        f"{out['load_peak_mib']:.0f} MiB ({out['load_peak_ratio']:.2f}x)")
    samplers = (("window (DT)", f"K={s.pixel_context}", WindowSampler(ds, s.pixel_context)),
                ("segment (GTrXL)", f"burn-in {s.burn_in} + {s.seq_len}",
                 SegmentSampler(ds, s.seq_len, burn_in=s.burn_in)))
    for name, shape, sampler in samplers:
        steps = StepBatchDataset(sampler, s.batch_size, seed=s.seed, num_steps=s.batches * s.repeats + 1)
        rate = sampler_rate(steps, s.batches, s.repeats, s.batch_size)
        batch = steps[0]
        row = {"sampler": f"{name}, {shape}", "batch_size": s.batch_size, "sampler_samples_per_s": rate,
               "batch_observations": list(batch["observations"].shape),
               "batch_dtype": str(batch["observations"].dtype).replace("torch.", "")}
        if not s.skip_training:
            enc = encoder_rate(batch, s.train_steps)
            row.update({"encoder_samples_per_s": enc, "headroom": rate / enc})
        out["samplers"].append(row)
        log(f"pixels {row['sampler']}: {rate:.0f} samples/s ({row['batch_observations']} {row['batch_dtype']})" + (
            f", the Nature CNN alone trains {row['encoder_samples_per_s']:.1f}/s ({row['headroom']:.0f}x headroom)"
            if "headroom" in row else ""))
    return out


def load_times(path: Path, s: Settings) -> list[dict[str, Any]]:
    """Seconds to load ``path`` eagerly and lazily, and to the first DT batch of each."""

    rows = []
    for lazy in (False, True):
        t0 = time.perf_counter()
        ds = load_dataset(path, lazy=lazy, env_id="Hopper-v5")
        t_load = time.perf_counter() - t0
        sampler = WindowSampler(ds, s.context_len, reward_scale=1000.0)
        sampler.sample(s.batch_size, np.random.default_rng(0))
        t_first = time.perf_counter() - t0
        rows.append({"mode": "lazy" if lazy else "eager", "steps": ds.num_steps, "episodes": ds.num_episodes,
                     "load_s": t_load, "first_batch_s": t_first, "file_mib": path.stat().st_size / 2**20})
    return rows


def run(s: Settings, log: Callable[[str], None] | None = None) -> Result:
    """Run both parts (see the module docstring).

    Raises:
        ValueError: bad settings (:meth:`Settings.check`), before anything is measured.
    """
    s.check()
    log = log or (lambda m: None)
    torch.set_num_threads(s.threads)
    res = Result(settings=s, machine=machine_info(torch.device("cpu")))
    common = [f"dataset.path={s.dataset}", f"train.batch_size={s.batch_size}", f"seed={s.seed}"]
    parts_1_2 = () if s.pixels_only else (("window (DT)", "dt/hopper_medium"), ("segment (GTrXL)", "gtrxl/hopper_positions_bc"))
    for name, config in parts_1_2:
        tr = build_trainer(config, common)
        a = tr.cfg.agent
        shape = f"K={a.context_len}" if "context_len" in a else f"burn-in {a.burn_in} + {a.seq_len}"
        rate = sampler_rate(tr.agent.batches(0), s.batches, s.repeats, s.batch_size)
        row: dict[str, Any] = {"sampler": f"{name}, {shape}", "config": config, "batch_size": s.batch_size,
                               "sampler_samples_per_s": rate}
        if not s.skip_training:
            train_rate = training_rate(tr, s.train_steps)
            row.update({"training_samples_per_s": train_rate, "headroom": rate / train_rate})
        res.samplers.append(row)
        log(f"{row['sampler']}: {rate:.0f} samples/s" + (
            f", training consumes {row['training_samples_per_s']:.0f}/s ({row['headroom']:.0f}x headroom)"
            if "headroom" in row else ""))
    if not (s.skip_load or s.pixels_only):
        folder = Path(s.keep) if s.keep else Path(tempfile.mkdtemp(prefix="rlt-bench-data-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"synthetic-hopper-{s.steps}.hdf5"
        try:
            if not path.exists():
                log(f"writing {path} ({s.steps} steps)")
                write_synthetic_d4rl(path, s.steps, seed=s.seed)
            res.load = load_times(path, s)
            for r in res.load:
                log(f"load {r['mode']}: {r['load_s']:.2f} s, first batch after {r['first_batch_s']:.2f} s "
                    f"({r['steps']} steps, {r['episodes']} episodes, {r['file_mib']:.0f} MiB)")
        finally:
            if not s.keep:
                shutil.rmtree(folder, ignore_errors=True)
    if not s.skip_pixels:
        folder = Path(s.keep) if s.keep else Path(tempfile.mkdtemp(prefix="rlt-bench-data-"))
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"synthetic-frames-{s.pixel_steps}.hdf5"
        try:
            if not path.exists():
                log(f"writing {path} ({s.pixel_steps} frames)")
                write_synthetic_frames(path, s.pixel_steps, seed=s.seed)
            res.pixels = pixel_part(path, s, log)
        finally:
            if not s.keep:
                shutil.rmtree(folder, ignore_errors=True)
    return res


def markdown(res: Result) -> str:
    """The measured parts as Markdown tables (one per part, blank lines between)."""
    tables = []
    if res.samplers:
        rows = ["| sampler | batch | sampler samples/s | trainer | training samples/s | headroom |", "|---|---|---|---|---|---|"]
        for r in res.samplers:
            tr = r.get("training_samples_per_s")
            rows.append(f"| {r['sampler']} | {r['batch_size']} | {r['sampler_samples_per_s']:.0f} | {r['config']} | "
                        f"{'-' if tr is None else f'{tr:.0f}'} | "
                        f"{'-' if tr is None else format(r['headroom'], '.0f') + 'x'} |")
        tables.append(rows)
    if res.load:
        tables.append(["| load | steps | episodes | file MiB | load s | first batch s |", "|---|---|---|---|---|---|"] + [
            f"| {r['mode']} | {r['steps']} | {r['episodes']} | {r['file_mib']:.0f} | {r['load_s']:.2f} | "
            f"{r['first_batch_s']:.2f} |" for r in res.load])
    if res.pixels:
        p = res.pixels
        tables.append(["| frames | frame | stack | frames MiB | in memory MiB | ratio | load peak MiB | peak ratio |",
                       "|---|---|---|---|---|---|---|---|",
                       f"| {p['steps']} | {tuple(p['frame_shape'])} {p['observation_dtype']} | {p['frame_stack']} | "
                       f"{p['frames_mib']:.0f} | {p['observations_mib']:.0f} | {p['memory_ratio']:.2f}x | "
                       f"{p['load_peak_mib']:.0f} | {p['load_peak_ratio']:.2f}x |"])
        rows = ["| pixel sampler | batch | batch observations | sampler samples/s | Nature CNN samples/s | headroom |",
                "|---|---|---|---|---|---|"]
        for r in p["samplers"]:
            enc = r.get("encoder_samples_per_s")
            rows.append(f"| {r['sampler']} | {r['batch_size']} | {tuple(r['batch_observations'])} {r['batch_dtype']} | "
                        f"{r['sampler_samples_per_s']:.0f} | {'-' if enc is None else f'{enc:.1f}'} | "
                        f"{'-' if enc is None else format(r['headroom'], '.0f') + 'x'} |")
        tables.append(rows)
    return "\n\n".join("\n".join(t) for t in tables)


def register(bench_app) -> None:
    """Add the ``data`` command to the ``bench`` Typer group."""

    def data(
        dataset: str = typer.Option(DEFAULT_DATASET, help="Dataset of part 1 (Minari id, folder or .hdf5)."),
        batch_size: int = typer.Option(64, min=1, help="Batch size B."),
        batches: int = typer.Option(200, min=1, help="Batches per timed sampler run."),
        repeats: int = typer.Option(3, min=1, help="Timed sampler runs (median)."),
        train_steps: int = typer.Option(10, min=1, help="Timed training updates per trainer."),
        threads: int = typer.Option(1, min=1, help="torch intra-op threads."),
        steps: int = typer.Option(1_000_000, min=1, help="Steps of the synthetic HDF5 file of part 2."),
        keep: str = typer.Option(None, help="Keep the synthetic file in this folder (and reuse it)."),
        skip_training: bool = typer.Option(False, "--skip-training", help="Do not measure the trainers."),
        skip_load: bool = typer.Option(False, "--skip-load", help="Skip part 2."),
        pixel_steps: int = typer.Option(200_000, min=1, help="Frames of the synthetic pixel file of part 3."),
        pixel_context: int = typer.Option(30, min=1, help="DT context K of the pixel window sampler (part 3)."),
        skip_pixels: bool = typer.Option(False, "--skip-pixels", help="Skip part 3."),
        pixels_only: bool = typer.Option(False, "--pixels-only", help="Run part 3 alone."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
        out: str = typer.Option(None, "--out", help="Also write the JSON results to this file."),
        device_sampling: str = typer.Option(
            None, "--device-sampling", metavar="DEVICE",
            help="Only time the DT window and GTrXL segment samplers on the --steps file with the dataset held "
                 "on DEVICE (cpu, cuda; train.data_on_device) against the host samplers."),
    ) -> None:
        """Sampler samples/s vs what training consumes; load time of a 1M-step D4RL file; a 200k-frame pixel set."""

        if device_sampling:  # the on-device mode (bench/data_device.py) alone
            return data_device.command(device_sampling, write_synthetic_d4rl, out=out, as_json=as_json, steps=steps,
                                       keep=keep, batch_size=batch_size, batches=batches, repeats=repeats,
                                       threads=threads)
        run_checked(lambda: Settings(dataset=dataset, batch_size=batch_size, batches=batches, repeats=repeats,
                                     train_steps=train_steps, threads=threads, steps=steps, keep=keep,
                                     skip_training=skip_training, skip_load=skip_load, pixel_steps=pixel_steps,
                                     pixel_context=pixel_context, skip_pixels=skip_pixels, pixels_only=pixels_only),
                    run, markdown, out=out, as_json=as_json,
                    # the dataset: part 1 starts by building the agents on it
                    load_errors=(AgentBuildError,), source=f"--dataset {dataset}")

    bench_app.command("data")(data)
