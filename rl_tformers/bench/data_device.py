"""Benchmark: batches drawn with the dataset on the device (``rl-tformers bench data --device-sampling DEVICE``).

Samples per second of the DT window sampler (K = ``context_len``) and the GTrXL segment sampler
(``burn_in`` + ``seq_len`` steps) on a D4RL-size file (the synthetic Hopper-shaped file of
``bench data``'s part 2, 1M steps by default), two ways, in the same run:

* **host**: what ``train.data_on_device=false`` does: ``StepBatchDataset[s]`` (NumPy gather,
  ``default_rng([seed, s])``, NumPy -> torch) then the trainer's copy of the batch to the device;
* **device**: what ``train.data_on_device=true`` does: ``StepBatchDataset.on_device(device)[s]``
  (:class:`~rl_tformers.envs.torch_data.DeviceSampler`: the same rows drawn on the host, one
  ``(3, B, L)`` int64 index tensor sent, the gather done by torch on the device).

Both are normalised as the agents normalise (observation mean/std, ``reward_scale`` 1000). The
timed runs alternate (host, device, host, ...) so both see the same load; the median of
``repeats`` runs of ``batches`` batches is reported, each run ending with a device
synchronisation. The first batches of both ways are compared value for value (``equal``).

Command: ``rl-tformers bench data --device-sampling cpu --out bench_data_device.json`` (``cuda``
on a GPU; ``--steps``, ``--keep``, ``--batch-size``, ``--batches``, ``--repeats``, ``--threads``
as in ``bench data``; the other parts of ``bench data`` do not run in this mode).
"""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl_tformers.bench.options import check_counts, check_device, run_checked
from rl_tformers.envs.loaders import load_dataset
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import StepBatchDataset
from rl_tformers.envs.trajectory import observation_stats
from rl_tformers.runtime.device import move_to
from rl_tformers.runtime.host import host_description


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(draw: Callable[[int], Any], first: int, batches: int, device: torch.device) -> float:
    """Seconds to draw batches ``first .. first + batches - 1`` (device synchronised at the end)."""
    _sync(device)
    t0 = time.perf_counter()
    for s in range(first, first + batches):
        draw(s)
    _sync(device)
    return time.perf_counter() - t0


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def device_sampling(path: Path, device: str, *, batch_size: int, context_len: int, seq_len: int, burn_in: int,
                    batches: int, repeats: int, seed: int = 0,
                    log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Host vs device sampling of the file ``path`` (see the module docstring).

    Returns:
        one row per sampler: ``sampler``, ``batch_size``, ``steps``, ``device``,
        ``host_samples_per_s``, ``device_samples_per_s``, ``ratio`` (device / host),
        ``equal`` (the first batches equal), ``device_mib`` (the tensors the device sampler holds).

    Raises:
        ValueError: a count below 1.
        RuntimeError: the device is not available (torch's error).
    """
    if min(batch_size, context_len, seq_len, batches, repeats) < 1 or burn_in < 0:
        raise ValueError(f"device_sampling: counts must be >= 1 (burn_in >= 0), got batch_size={batch_size}, "
                         f"context_len={context_len}, seq_len={seq_len}, burn_in={burn_in}, batches={batches}, "
                         f"repeats={repeats}")
    log = log or (lambda m: None)
    dev = torch.device(device)
    ds = load_dataset(path, env_id="Hopper-v5")
    stats = observation_stats(ds)
    rows = []
    for name, shape, sampler in (
            ("window (DT)", f"K={context_len}", WindowSampler(ds, context_len, reward_scale=1000.0, obs_stats=stats)),
            ("segment (GTrXL)", f"burn-in {burn_in} + {seq_len}",
             SegmentSampler(ds, seq_len, burn_in=burn_in, reward_scale=1000.0, obs_stats=stats))):
        host = StepBatchDataset(sampler, batch_size, seed=seed, num_steps=(repeats + 1) * batches)
        t0 = time.perf_counter()
        on_device = host.on_device(dev)
        setup_s = time.perf_counter() - t0
        equal = all(_equal(move_to(host[s], dev), on_device[s]) for s in range(3))
        held = [on_device.sampler.observations, on_device.sampler.actions, on_device.sampler.rewards,
                on_device.sampler.returns_to_go, *(getattr(on_device.sampler, k, None) for k in ("terminations",
                                                                                              "truncations"))]
        mib = sum(t.numel() * t.element_size() for t in held if t is not None) / 2**20
        times: dict[str, list[float]] = {"host": [], "device": []}
        for r in range(repeats):  # alternating, batches 1.. (batch 0 warmed both up above)
            first = 1 + r * batches
            times["host"].append(_timed(lambda s, h=host: move_to(h[s], dev), first, batches, dev))
            times["device"].append(_timed(lambda s, d=on_device: d[s], first, batches, dev))
        host_rate = batches * batch_size / statistics.median(times["host"])
        dev_rate = batches * batch_size / statistics.median(times["device"])
        row = {"sampler": f"{name}, {shape}", "batch_size": batch_size, "steps": ds.num_steps,
               "episodes": ds.num_episodes, "device": str(dev), "host_samples_per_s": host_rate,
               "device_samples_per_s": dev_rate, "ratio": dev_rate / host_rate, "equal": bool(equal),
               "device_mib": mib, "setup_s": setup_s}
        rows.append(row)
        log(f"{row['sampler']} on {dev}: host {host_rate:.0f} samples/s, dataset on the device {dev_rate:.0f} "
            f"samples/s ({row['ratio']:.2f}x), batches equal: {equal}, {mib:.0f} MiB held, set up in {setup_s:.2f} s")
    return rows


def markdown_rows(rows: list[dict[str, Any]]) -> list[str]:
    """The rows of :func:`device_sampling` as a Markdown table."""
    lines = ["| sampler | device | steps | batch | host samples/s | on-device samples/s | ratio | batches equal | "
             "held MiB |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['sampler']} | {r['device']} | {r['steps']} | {r['batch_size']} | {r['host_samples_per_s']:.0f} | "
              f"{r['device_samples_per_s']:.0f} | {r['ratio']:.2f}x | {'yes' if r['equal'] else 'NO'} | "
              f"{r['device_mib']:.0f} |" for r in rows]
    return lines



@dataclass
class Settings:
    """Settings of the mode (the ``bench data`` options it reads)."""

    device: str = "cpu"
    steps: int = 1_000_000
    keep: str | None = None
    batch_size: int = 64
    context_len: int = 20
    seq_len: int = 16
    burn_in: int = 16
    batches: int = 200
    repeats: int = 3
    threads: int = 1
    seed: int = 0

    def check(self) -> None:
        """Refuse settings that cannot give a measurement, naming the CLI option.

        Raises:
            ValueError: a count below 1, ``--keep`` naming a file, a ``--device-sampling`` that
                is not cpu or an available CUDA device.
        """
        check_counts(("--steps", self.steps), ("--batch-size", self.batch_size), ("--batches", self.batches),
                     ("--repeats", self.repeats), ("--threads", self.threads))
        if self.keep and Path(self.keep).exists() and not Path(self.keep).is_dir():
            raise ValueError(f"--keep {self.keep} is a file; give a folder to keep the synthetic file in")
        check_device(self.device, "--device-sampling")


@dataclass
class Result:
    settings: Settings
    rows: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"settings": dataclasses.asdict(self.settings), "machine": self.machine, "device_sampling": self.rows,
                "notes": self.notes}


def run(s: Settings, write: Callable[..., Path], log: Callable[[str], None] | None = None) -> Result:
    """The mode: write (or reuse, ``keep``) the synthetic file of ``steps`` steps with ``write``
    (``bench.data.write_synthetic_d4rl``), then :func:`device_sampling` on it.

    Raises:
        ValueError: bad settings (:meth:`Settings.check`), before anything is measured.
    """
    s.check()
    log = log or (lambda m: None)
    torch.set_num_threads(s.threads)
    res = Result(settings=s, machine=host_description(torch.device(s.device)))
    folder = Path(s.keep) if s.keep else Path(tempfile.mkdtemp(prefix="rlt-bench-data-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"synthetic-hopper-{s.steps}.hdf5"
    try:
        if not path.exists():
            log(f"writing {path} ({s.steps} steps)")
            write(path, s.steps, seed=s.seed)
        res.rows = device_sampling(path, s.device, batch_size=s.batch_size, context_len=s.context_len,
                                   seq_len=s.seq_len, burn_in=s.burn_in, batches=s.batches, repeats=s.repeats,
                                   seed=s.seed, log=log)
    finally:
        if not s.keep:
            shutil.rmtree(folder, ignore_errors=True)
    res.machine["loadavg_end"] = host_description().get("loadavg_1_5_15")
    return res


def markdown(res: Result) -> str:
    return "\n".join(markdown_rows(res.rows))


def command(device: str, write: Callable[..., Path], *, out: str | None, as_json: bool, **options: Any) -> None:
    """``bench data --device-sampling DEVICE``: the mode's command body (``options``: the
    :class:`Settings` fields given on the command line)."""
    run_checked(lambda: Settings(device=device, **options), lambda s, log: run(s, write, log), markdown, out=out,
                as_json=as_json)
