"""Benchmark: sampling a few episodes of a many-episode Minari dataset (``rl-tformers bench minari``).

A synthetic Minari dataset of ``--episodes`` episodes of ``--episode-len`` steps (Hopper-sized:
11-dim float64 observations, 3-dim float32 actions; written with
``minari.create_dataset_from_buffers``, not timed) is opened and ``--sample`` episodes are drawn
from it, timed from the open (nothing cached between repeats):

* **minari**: ``minari.MinariDataset(path).sample_episodes(n)``, Minari's own reader: the
  baseline, measured in the same run;
* **ours, lazy**: :func:`rl_tformers.envs.loaders.open_minari` then
  :meth:`~rl_tformers.envs.minari_episodes.MinariEpisodes.sample_episodes` (counts from the
  metadata; only the drawn episodes read, then validated and built as an ``EpisodeDataset``);
* **ours, full read**: :func:`~rl_tformers.envs.loaders.load_minari` (every episode read and
  validated, the dataset training uses) then the same episodes selected.

Each row reports the median seconds over ``--repeats`` (Minari's and the lazy reader's
interleaved round by round) and its ratio to Minari's (lower is faster; 1.0x = as fast as Minari).

Command: ``rl-tformers bench minari --episodes 10000 --out bench_minari.json``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import typer

from rl_tformers.bench.options import run_checked
from rl_tformers.bench.train import machine_info
from rl_tformers.envs.loaders import load_minari, minari_root, open_minari

DATASET_ID = "bench/synthetic-v0"
#: bytes of one synthetic step: 11 float64 observations, 3 float32 actions, a float64 reward, 2 flags
STEP_BYTES = 11 * 8 + 3 * 4 + 8 + 2
#: copies of the dataset the command holds at once at most (the episodes written, Minari's read
#: and the full read's arrays)
COPIES_HELD = 3


def _physical_memory_bytes() -> int:
    """The machine's physical memory in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


@dataclass
class Settings:
    """Benchmark settings."""

    episodes: int = 10_000
    episode_len: int = 20
    sample: int = 10
    repeats: int = 5
    full_repeats: int = 1
    keep: str | None = None
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot give a measurement, naming the CLI option.

        Raises:
            ValueError: a count below 1, a negative ``--seed``, ``--sample`` above ``--episodes``,
                an empty ``--keep`` or one naming a file, or a dataset whose copies the command holds
                (:data:`COPIES_HELD` of :meth:`data_bytes`) exceed the machine's physical memory.
        """
        for option, value in (("--episodes", self.episodes), ("--episode-len", self.episode_len),
                              ("--sample", self.sample), ("--repeats", self.repeats),
                              ("--full-repeats", self.full_repeats)):
            if int(value) < 1:
                raise ValueError(f"{option} must be >= 1, got {value}")
        if self.sample > self.episodes:
            raise ValueError(f"--sample {self.sample} is more than --episodes {self.episodes}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0 (it seeds numpy's generator), got {self.seed}")
        if self.keep is not None and not str(self.keep).strip():
            raise ValueError("--keep is empty; give a folder to keep the synthetic dataset in, or leave the option out")
        if self.keep and Path(self.keep).exists() and not Path(self.keep).is_dir():
            raise ValueError(f"--keep {self.keep} is a file; give a folder to keep the synthetic dataset in")
        need, have = COPIES_HELD * self.data_bytes(), _physical_memory_bytes()
        if need > have:
            raise ValueError(f"--episodes {self.episodes} x --episode-len {self.episode_len}: the synthetic dataset "
                             f"holds {self.data_bytes() / 2**30:.3g} GiB ({STEP_BYTES} bytes a step) and the command "
                             f"holds about {COPIES_HELD} copies of it, more than the {have / 2**30:.3g} GiB of this "
                             f"machine; lower --episodes or --episode-len")

    def data_bytes(self) -> int:
        """Bytes of the synthetic dataset's arrays: :data:`STEP_BYTES` a step, plus one 11-dim
        float64 observation an episode (its last)."""
        return self.episodes * (self.episode_len * STEP_BYTES + 11 * 8)


@dataclass
class Result:
    settings: Settings
    rows: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"settings": dataclasses.asdict(self.settings), "machine": self.machine, "rows": self.rows,
                "notes": self.notes}


def write_synthetic_minari(root: Path, episodes: int, episode_len: int, seed: int = 0) -> Path:
    """Write Minari dataset :data:`DATASET_ID` under ``root``: ``episodes`` episodes of
    ``episode_len`` steps (random 11-dim float64 observations, 3-dim float32 actions in [-1, 1],
    normal rewards, each episode truncated at its end). Returns its data folder."""
    import minari  # optional heavy dependency: loaded by the command only
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(seed)
    n = episode_len
    flags = np.zeros(n, bool)
    last = flags.copy()
    last[-1] = True
    buffers = [EpisodeBuffer(id=i, observations=rng.standard_normal((n + 1, 11)),
                             actions=rng.uniform(-1, 1, (n, 3)).astype(np.float32), rewards=rng.standard_normal(n),
                             terminations=flags, truncations=last)
               for i in range(episodes)]
    with minari_root(root), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no environment to record: the spaces are given
        md = minari.create_dataset_from_buffers(
            DATASET_ID, buffers, observation_space=gym.spaces.Box(-np.inf, np.inf, (11,), np.float64),
            action_space=gym.spaces.Box(-1.0, 1.0, (3,), np.float32), algorithm_name="synthetic",
            author="rl-tformers bench", author_email="-", code_permalink="-", description="bench minari")
    return Path(md.storage.data_path)


def median_seconds(fns: list[Callable[[int], Any]], repeats: int) -> list[float]:
    """Median wall seconds of each ``fn(r)`` over ``r = 0 .. repeats - 1``, the functions
    interleaved round by round (a change of machine load hits them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn(r)
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measure(path: Path, s: Settings, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Seconds to open ``path`` and draw ``s.sample`` episodes with each reader (module docstring)."""
    import minari  # optional heavy dependency: loaded by the command only

    def theirs(r: int) -> None:
        md = minari.MinariDataset(path)
        md.set_seed(s.seed + r)
        list(md.sample_episodes(s.sample))

    def lazy(r: int) -> None:
        open_minari(path).sample_episodes(s.sample, np.random.default_rng(s.seed + r))

    def full(r: int) -> None:
        ds = load_minari(path)
        ds.select(np.random.default_rng(s.seed + r).choice(ds.num_episodes, s.sample, replace=False))

    theirs(0)  # warm-up: imports, the file in the page cache
    lazy(0)
    rows = []
    timed = zip(("minari sample_episodes", "ours, lazy (open_minari)"), median_seconds([theirs, lazy], s.repeats))
    for name, sec in [*timed, ("ours, full read (load_minari)", median_seconds([full], s.full_repeats)[0])]:
        repeats = s.full_repeats if name.startswith("ours, full") else s.repeats
        rows.append({"reader": name, "seconds": sec, "repeats": repeats})
        log(f"{name}: {sec:.4f} s")
    base = rows[0]["seconds"]
    for row in rows:
        row["ratio_to_minari"] = row["seconds"] / base
    return rows


def run(s: Settings, log: Callable[[str], None] | None = None) -> Result:
    """Write the synthetic dataset (or reuse the one in ``--keep``) and time the readers.

    Raises:
        ValueError: bad settings (:meth:`Settings.check`), before anything is written.
    """
    s.check()
    log = log or (lambda m: None)
    res = Result(settings=s, machine=machine_info(torch.device("cpu")))
    folder = Path(s.keep) if s.keep else Path(tempfile.mkdtemp(prefix="rlt-bench-minari-"))
    folder = folder / f"synthetic-{s.episodes}x{s.episode_len}"
    data = folder / DATASET_ID / "data"
    try:
        if not (data / "metadata.json").is_file():
            log(f"writing {s.episodes} episodes of {s.episode_len} steps under {folder}")
            t0 = time.perf_counter()
            write_synthetic_minari(folder, s.episodes, s.episode_len, seed=s.seed)
            res.notes.append(f"writing the synthetic dataset took {time.perf_counter() - t0:.1f} s (not timed)")
        res.rows = measure(data, s, log)
    finally:
        if not s.keep:
            shutil.rmtree(folder.parent, ignore_errors=True)
    return res


def markdown(res: Result) -> str:
    s = res.settings
    lines = [f"Sampling {s.sample} of {s.episodes} episodes ({s.episode_len} steps each), from opening the dataset:",
             "", "| reader | seconds (median) | repeats | ratio to Minari |", "|---|---|---|---|"]
    lines += [f"| {r['reader']} | {r['seconds']:.4f} | {r['repeats']} | {r['ratio_to_minari']:.2f}x |"
              for r in res.rows]
    return "\n".join(lines)


def register(bench_app) -> None:
    """Add the ``minari`` command to the ``bench`` Typer group."""

    def minari_sampling(
        episodes: int = typer.Option(10_000, min=1, help="Episodes of the synthetic Minari dataset."),
        episode_len: int = typer.Option(20, min=1, help="Steps per episode."),
        sample: int = typer.Option(10, min=1, help="Episodes drawn per timed sample."),
        repeats: int = typer.Option(5, min=1, help="Timed samples per lazy reader (median)."),
        full_repeats: int = typer.Option(1, min=1, help="Timed full reads (median)."),
        keep: str = typer.Option(None, help="Keep the synthetic dataset in this folder (and reuse it)."),
        seed: int = typer.Option(0, help="Seed of the data and of the draws."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
        out: str = typer.Option(None, "--out", help="Also write the JSON results to this file."),
    ) -> None:
        """Seconds to draw a few episodes of a many-episode Minari dataset: ours (lazy, full read) vs Minari's."""

        run_checked(lambda: Settings(episodes=episodes, episode_len=episode_len, sample=sample, repeats=repeats,
                                     full_repeats=full_repeats, keep=keep, seed=seed),
                    run, markdown, out=out, as_json=as_json)

    bench_app.command("minari")(minari_sampling)
