"""The training loop shared by every agent: one :class:`Trainer` per run.

Per update ``s`` (0-based; ``step`` below is the number of updates completed, ``s + 1``)::

    redraw random features due after the s updates so far (Performer/RFA/LSH ``redraw_every``;
        _redraw_features: after the checkpoint and evaluation of step s, before the batch)
    batch = stream[s]                           # pure function of (seed, s): see agents.py
    with autocast(train.amp): loss, logs = agent.loss(batch)
    zero_grad; loss.backward()
    grad_norm = clip_grad_norm_(params, train.grad_clip)   # measured even without clipping
    optimizer.step(); scheduler.step()
    every train.log_every:        scalars (window means) -> TensorBoard + metrics.jsonl
    every train.checkpoint_every (and at end, and on SIGINT/SIGTERM): checkpoint
    every eval.every (and at end): agent.evaluate(step) with isolated RNGs, after the checkpoint
        of that step (an evaluation that raises first saves the step if it was not saved, so the
        run stays resumable; the error is re-raised with a note saying where the model is; a
        resume from that step runs the evaluation that was never logged before training on)

Exact resume: a checkpoint at ``step`` holds everything the rest of the run depends on
(weights, AdamW moments, scheduler counters, global RNG states, the agent's extra state and, for
an agent with the ``process_state`` hook, each process's own running state, the partial logging
window); batches are re-derived from ``(seed, step)``. So N updates in one
run and N/2 + resume + N/2 give bit-identical weights and logs on CPU (on GPU, as identical as
the kernels are deterministic: see ``train.deterministic``).

Multi-process training (``torchrun``, ``rl-tformers train --nproc N``): the same loop in each
process, with the agent's loss wrapped in DistributedDataParallel, batches split across ranks
(an agent with ``local_batches``, PPO, yields its own rank's) and every write (logs,
config.yaml, checkpoints) from rank 0 only; see :mod:`rl_tformers.runtime.distributed`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from tqdm.contrib.logging import logging_redirect_tqdm

from rl_tformers.attention._linear import maybe_redraw_random_features, random_feature_modules
from rl_tformers.envs.loaders import HDF5_SUFFIXES, data_root
from rl_tformers.envs.samplers import SegmentSampler, WindowSampler
from rl_tformers.envs.torch_data import DeviceStepBatches, StepBatchDataset
from rl_tformers.runtime import checkpoint as ckpt
from rl_tformers.runtime import distributed as dist_rt
from rl_tformers.runtime.agent_registry import (
    AgentBuildError,
    Trainable,
    UnknownAgentError,
    agent_build_errors,
    build_agent,
    get_agent,
)
from rl_tformers.runtime.cpu_matmul import apply_cpu_matmul
from rl_tformers.runtime.data import batch_stream
from rl_tformers.runtime.device import autocast, batch_size_of, move_to, resolve_device
from rl_tformers.runtime.evaluation import logs_line
from rl_tformers.runtime.optim import (
    LRSchedule,
    build_optimizer,
    build_scheduler,
    default_param_groups,
    restore_scheduler,
    restretch_message,
    scheduler_state,
)
from rl_tformers.runtime.plugins import check_env_modules, named_plugins_only, plugins_named_in
from rl_tformers.runtime.progress import PlainProgress, progress_bar
from rl_tformers.runtime.resolved import (
    cpu_matmul_values,
    read_resolved_file,
    resolved_block,
    resolved_line,
    split_resolved,
)
from rl_tformers.runtime.run_config import (
    RESUMABLE_KEYS,
    ConfigError,
    check_resume_changes,
    compose,
    default_run_dir,
    flatten,
    to_container,
    to_yaml,
)
from rl_tformers.runtime.runlock import RunBusyError, directory_problem, hold_run, lock_holder
from rl_tformers.runtime.seeding import (
    capture_rng_state,
    derive_seed,
    isolated_rng,
    restore_rng_state,
    seed_everything,
)
from rl_tformers.runtime.tracking import METRICS_FILE, RunLogger, event_files, truncate_run_logs

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"


class RunDirError(FileExistsError):
    """The run directory already holds another run (use ``--resume`` or another ``--run-dir``), or
    another process is training it (:mod:`rl_tformers.runtime.runlock`)."""


class NonFiniteLossError(FloatingPointError):
    """The loss or gradient norm became NaN/inf; nothing after the last finite window is saved."""


class EvaluationInputError(ValueError):
    """An evaluation during training refused its input: the agent's ``evaluate`` raised a
    ``ValueError`` (bad input by the project's convention, e.g. a DT episode longer than
    ``agent.max_ep_len`` with ``agent.timestep_overflow=error``). The run is saved at that step
    first; the message is one line: the agent's message (naming the option at fault), the
    checkpoint, and what to do instead of repeating the same evaluation. The agent's exception
    is ``__cause__``. ``rl-tformers train`` prints it as ``error: ...`` and exits with status 2.
    """


@dataclass
class TrainResult:
    """What :meth:`Trainer.fit` returns.

    Attributes:
        run_dir: the run directory.
        step: updates completed.
        interrupted: the signal number (``signal.SIGINT``/``SIGTERM``) that stopped the run
            early, or None when it ran to ``train.steps``.
        checkpoint: the last checkpoint written by this process (None on non-main ranks).
        last_train: the last logged training scalars.
        last_eval: the last evaluation scalars.
        total_steps: ``train.steps`` of the run; ``step < total_steps`` after an interruption
            or ``stop_at``.
    """

    run_dir: Path
    step: int
    interrupted: int | None = None
    checkpoint: Path | None = None
    last_train: dict[str, float] = field(default_factory=dict)
    last_eval: dict[str, float] = field(default_factory=dict)
    total_steps: int = 0

    @property
    def complete(self) -> bool:
        return self.step >= self.total_steps


def config_warnings(cfg: Mapping[str, Any]) -> list[str]:
    """Settings that make a run train other than its user likely means, one sentence each.

    ``cfg``: a resolved run config (DictConfig or plain dict). The trainer logs each as a
    warning at the start of a run; ``rl-tformers sweep`` prints them before its runs start
    (a run's own log is not on the sweep's console).

    Today: a non-constant schedule whose ``train.warmup_steps`` >= ``train.steps`` (the learning
    rate never leaves its linear warm-up).
    """
    t = cfg["train"]
    out = []
    schedule = str(getattr(t["schedule"], "value", t["schedule"]))
    if schedule != "constant" and int(t["warmup_steps"]) >= int(t["steps"]):
        out.append(f"train.warmup_steps={int(t['warmup_steps'])} >= train.steps={int(t['steps'])}: the learning "
                   f"rate stays in its linear warmup and never reaches train.lr ({float(t['lr']):g}); for a short "
                   "run lower train.warmup_steps")
    return out


class MetricWindow:
    """Sums of the per-update scalars since the last log, kept on the device (no sync per step).

    Each key has its own count (the updates that logged it), so a scalar an agent logs only in
    some updates (PPO's episodic return, once an episode has finished) is the mean of the
    updates that logged it. Under DDP every rank keeps its own window; :meth:`reduce` combines
    them at a log boundary without changing them, and a checkpoint stores every rank's window
    (:meth:`Trainer.save`), so the first window after a resume averages exactly the same
    numbers, summed in the same order, as in an uninterrupted run.

    Keys in ``latest`` (counters such as PPO's ``train/env_steps``, declared by the agent's
    ``latest_logs``) are not averaged: the window keeps the value of the latest update that
    logged the key (stored as a sum with count 1, so checkpoints and :meth:`reduce` need
    nothing else).
    """

    def __init__(self, latest: Iterable[str] = ()) -> None:
        self.latest = frozenset(latest)
        self.count = 0
        self.samples: float = 0
        self.sums: dict[str, Tensor | float] = {}
        self.counts: dict[str, float] = {}

    def add(self, values: Mapping[str, Tensor | float], samples: int) -> None:
        self.count += 1
        self.samples += samples
        for k, v in values.items():
            # a copy: the value may be a buffer the next update overwrites (a CUDA graph's output)
            v = v.detach().float().reshape(()).clone() if isinstance(v, Tensor) else float(v)
            if k in self.latest:  # a counter: its latest value, not the window's mean
                self.sums[k], self.counts[k] = v, 1
                continue
            self.sums[k] = v if k not in self.sums else self.sums[k] + v
            self.counts[k] = self.counts.get(k, 0) + 1

    def means(self) -> dict[str, float]:
        """This process's window means as Python floats (synchronises the device once)."""
        if not self.count:
            return {}
        return {k: float(v) / self.counts[k] for k, v in self.sums.items()}

    def non_finite(self) -> list[str]:
        """Names whose sum is NaN/inf (some update in the window produced a non-finite value)."""
        return [k for k, v in self.means().items() if not math.isfinite(v)]

    def reduce(self, device: torch.device) -> tuple[dict[str, float], float]:
        """Window means over every rank and the samples of every rank; the window is unchanged.

        Outside a process group: :meth:`means` and this process's samples. Under DDP the ranks
        first agree on the union of their keys (a key only some ranks logged, such as PPO's
        episodic return, is summed as 0 with count 0 elsewhere), then one all-reduce (float64)
        adds up every key's sum and count: each mean is over the (rank, update) pairs that
        logged the key. A ``latest`` key is the mean over the ranks of each rank's latest value
        (PPO's ``train/env_steps`` already counts every process, so every rank logs the same
        total). Every rank gets the same numbers (the same decisions, e.g. on non-finite values).
        """
        if not dist_rt.is_active():
            return self.means(), float(self.samples)

        everyone = dist_rt.gather_objects(list(self.sums))
        # the same order on every rank: rank 0's keys, then the other ranks' in sorted order
        keys = [*everyone[0], *sorted(set().union(*map(set, everyone)) - set(everyone[0]))]
        zero = torch.zeros((), dtype=torch.float64, device=device)

        def f64(v: Tensor | float) -> Tensor:
            return v.detach().to(device=device, dtype=torch.float64).reshape(()) if isinstance(v, Tensor) \
                else torch.tensor(float(v), dtype=torch.float64, device=device)

        t = torch.stack([*(f64(self.sums[k]) if k in self.sums else zero for k in keys),
                         *(f64(self.counts[k]) if k in self.counts else zero for k in keys),
                         f64(float(self.samples))])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        values = t.tolist()
        n = len(keys)
        means = {k: values[i] / values[n + i] for i, k in enumerate(keys) if values[n + i] > 0}
        return means, values[-1]

    def reset(self) -> None:
        self.count, self.samples, self.sums, self.counts = 0, 0, {}, {}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "samples": self.samples,
                "sums": {k: v.cpu() if isinstance(v, Tensor) else v for k, v in self.sums.items()},
                "counts": dict(self.counts)}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        """Restore :meth:`state_dict` (a checkpoint written before per-key counts counts every
        key in every update of the window)."""
        self.count, self.samples = int(state["count"]), state["samples"]
        self.sums = {k: v.to(device) if isinstance(v, Tensor) else float(v) for k, v in state["sums"].items()}
        counts = state.get("counts")
        self.counts = {k: (counts[k] if counts is not None else self.count) for k in self.sums}

    @staticmethod
    def mean_state(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The mean of several ranks' :meth:`state_dict` (sums, counts and samples divided by
        the number of ranks): the window a run resumed with another number of processes starts
        from on every rank, so that :meth:`reduce` weights the saved updates as many
        (rank, update) pairs as the new ranks' updates."""
        w = len(states)
        keys = list(dict.fromkeys(k for s in states for k in s["sums"]))
        sums: dict[str, Tensor | float] = {}
        counts: dict[str, float] = {}
        for k in keys:
            parts = [s["sums"][k] for s in states if k in s["sums"]]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            sums[k] = total / w
            counts[k] = sum(float(s.get("counts", {}).get(k, s["count"])) for s in states if k in s["sums"]) / w
        return {"count": int(states[0]["count"]), "samples": sum(float(s["samples"]) for s in states) / w,
                "sums": sums, "counts": counts}

    @staticmethod
    def for_ranks(state: Mapping[str, Any], saved_ranks: int, ranks: int) -> dict[str, Any]:
        """The window each of ``ranks`` processes resumes from, given the :meth:`mean_state`
        ``state`` of a run saved with ``saved_ranks`` processes (or the one window of a
        one-process run, ``saved_ranks`` = 1): the means carry over as they are, and the samples
        (a count, which :meth:`reduce` sums over the ranks) are split so that the ranks' sum is
        the saved total (otherwise ``perf/samples_per_s`` of the first window after a resume with
        another process count would be off by ``ranks / saved_ranks``)."""
        return {**state, "samples": float(state["samples"]) * saved_ranks / max(ranks, 1)}


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT/SIGTERM) arrived before the first update of this session: training
    never started, nothing was trained, and the run directory was not written (a resumed run is
    exactly as it was). Raised by :class:`GracefulInterrupt` in its ``"raise"`` start-up mode and
    by :meth:`Trainer.fit` when the ranks agree to stop before the first update.

    A subclass of ``KeyboardInterrupt``, so code that catches ``Exception`` (data loading,
    agent builders) lets it through.

    Attributes:
        signum: the signal; None when another process of the run stopped before training
            started and this one received no signal (it then stops too).
    """

    def __init__(self, signum: int | None) -> None:
        name = signal.Signals(signum).name if signum is not None else "another process of the run"
        super().__init__(f"interrupted by {name} before the first update")
        self.signum = signum


class GracefulInterrupt:
    """SIGINT/SIGTERM handling of one training process (main thread only; elsewhere a no-op).

    Until :meth:`begin_training`, a start-up mode may apply (``startup``); nothing has been
    trained yet, so a signal then ends the start-up at once:

    - ``"raise"`` (one process): the first signal raises :class:`Interrupted` wherever the
      process is (importing, loading a dataset); ``rl-tformers train`` prints one line.
    - ``"default"`` (a rank of a multi-process run): the signals keep their default action, so
      the process ends at once and silently, even while it waits inside the process group's
      rendezvous or a collective for a peer that has already gone (a Python handler would only
      run once that wait ends: up to the collective timeout). torchrun, or the launcher of
      ``--nproc``, reports the stop.

    Then (``startup=None`` from the start) the mode is **graceful**: a signal only sets
    :attr:`signum`; the training loop saves a checkpoint and stops at the next update boundary.
    A second signal aborts at once (``KeyboardInterrupt``; checkpoints are atomic, so that
    loses at most the updates since the last one) unless both are SIGTERM: a scheduler may send
    SIGTERM to every process of a job as well as to the launcher that forwards it, and such a
    repeat must not turn the save into an abort. A second Ctrl-C reaches torchrun's ranks as
    SIGTERM (torchrun's second shutdown), which therefore aborts too.

    Entering installs the handlers, then unblocks SIGINT/SIGTERM in this thread: the ranks of
    ``rl-tformers train --nproc`` start with them blocked (:mod:`rl_tformers.runtime.torchrun`),
    so a Ctrl-C during their start-up waits, pending, until this point instead of interrupting
    ``import torch`` with a traceback. A signal already pending is handled as the ``with``
    statement enters (``"raise"``: :class:`Interrupted` is raised from it, with the previous
    handlers back in place). Leaving restores the previous handlers.

    Args:
        announce: log the stop (the signal's receipt, where the run stopped, an abort); under
            DDP only rank 0 does, and no rank does when ``rl-tformers train --nproc`` reports.
        startup: None, ``"raise"`` or ``"default"`` (above).

    Raises:
        ValueError: another ``startup``.

    Attributes:
        signum: the first signal received by the handler, or None.
        aborted: the second signal, once it aborted the process; else None.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    STARTUP_MODES = (None, "raise", "default")

    def __init__(self, announce: bool = True, *, startup: str | None = None) -> None:
        if startup not in self.STARTUP_MODES:
            raise ValueError(f"startup must be one of {self.STARTUP_MODES}, got {startup!r}")
        self.signum: int | None = None
        self.aborted: int | None = None
        #: set by the trainer while it evaluates: ``(step, final)``; a signal then waits for the
        #: evaluation's end (its announcement says so), a second one aborts it
        self.evaluating: tuple[int, bool] | None = None
        self.announce = announce
        self._startup = startup
        self._previous: dict[int, Any] = {}

    def begin_training(self) -> None:
        """Leave the start-up mode: from now on a signal stops the run at the next update boundary."""
        if self._startup == "default" and self._previous:  # entered in the main thread
            for s in self.SIGNALS:
                signal.signal(s, self._handler)
        self._startup = None

    def _handler(self, signum: int, frame: Any) -> None:
        first = self.signum is None
        if first:
            self.signum = signum
        if self._startup == "raise":
            if first:
                raise Interrupted(signum)
            return  # another signal while the first one unwinds the start-up
        if not first:
            if self.aborted is None and (signum != signal.SIGTERM or self.signum != signal.SIGTERM):
                self.aborted = signum
                raise KeyboardInterrupt
            return
        if self.announce:
            name = signal.Signals(signum).name
            if self.evaluating is None:
                log.warning("received %s: finishing the current update, saving a checkpoint, then stopping "
                            "(press Ctrl-C again to abort at once)", name)
            elif self.evaluating[1]:
                log.warning("received %s during the final evaluation (step %d): the run is trained and saved; the "
                            "evaluation finishes, then the run ends (press Ctrl-C again to stop at once and "
                            "evaluate the saved model later)", name, self.evaluating[0])
            else:
                log.warning("received %s during the evaluation of step %d: the evaluation finishes, then the run "
                            "saves a checkpoint and stops (press Ctrl-C again to abort at once)", name,
                            self.evaluating[0])

    def __enter__(self) -> GracefulInterrupt:
        if threading.current_thread() is threading.main_thread():
            handler = signal.SIG_DFL if self._startup == "default" else self._handler
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, handler)
            try:
                if hasattr(signal, "pthread_sigmask"):
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)  # a pending signal acts now
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


class _TrainerState:
    """The state the parts of :class:`Trainer` share, set up by :meth:`Trainer.__init__`: the run
    (``cfg``, ``run_dir``, ``total_steps``), the process (``rank``, ``world_size``, ``device``),
    the training objects (``agent``, ``model``, ``optimizer``, ``scheduler``, ``params``,
    ``ddp``) and the progress (``step``, ``elapsed_s``, ``window``)."""

    cfg: DictConfig
    config_yaml: str
    on_log: Callable[[int, dict[str, float]], None] | None
    run_dir: Path
    dist: dist_rt.DistInfo
    rank: int
    world_size: int
    total_steps: int
    device: torch.device
    amp: str
    agent: Trainable
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    params: list[Tensor]
    ddp: torch.nn.Module | None
    window: MetricWindow
    step: int
    elapsed_s: float
    _random_feature_modules: Any
    _rng_to_restore: dict[str, Any] | None
    _resumed_from: Path | None
    _first_loss_finite: bool | None

    @property
    def is_main(self) -> bool:
        """True on the process that logs and checkpoints (rank 0; always True without DDP)."""
        return self.rank == 0


class _TrainerCheckpoints(_TrainerState):
    """The checkpoint side of :class:`Trainer`: what a checkpoint holds, writing it (every rank's
    share gathered under DDP) and restoring a run from one, exactly."""

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint content at the current step (see :mod:`rl_tformers.runtime.checkpoint`)."""
        extra_fn = getattr(self.agent, "extra_state", None)
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": scheduler_state(self.scheduler),
            "rng": capture_rng_state(),
            "extra": dict(extra_fn()) if callable(extra_fn) else {},
            "trainer": {"window": self.window.state_dict(), "elapsed_s": self.elapsed_s},
            "config": self.config_yaml,
        }

    def save(self) -> Path | None:
        """Write a checkpoint at the current step (main rank only); prunes to ``train.keep_last``.

        Under DDP every rank must call it: every rank's RNG state and partial logging window are
        gathered into the checkpoint (``trainer.rng_ranks``, ``trainer.window_ranks``; the live
        windows are not changed, so where the checkpoints fall does not change any logged
        number), and only rank 0 writes. ``trainer.window`` then holds the mean of the ranks'
        windows, which a resume with another number of processes starts from.

        An agent with the optional ``process_state()`` hook (each process's own running state, e.g.
        the environments of an on-policy agent) gets it saved as ``trainer.process_ranks``, one entry
        per rank (gathered under DDP), handed back whole to its ``load_process_state`` on resume.

        Raises:
            NonFiniteLossError: if the current logging window (of any rank) saw a NaN/inf loss or
                gradient norm (a checkpoint must never hold diverged weights).
        """
        rng_ranks = window_ranks = None
        process_fn = getattr(self.agent, "process_state", None)
        process_ranks = [process_fn()] if callable(process_fn) else None  # one process: no gather
        if dist_rt.is_active():
            mine = process_ranks[0] if process_ranks is not None else None
            gathered = dist_rt.gather_objects((capture_rng_state(), self.window.state_dict(), mine))
            rng_ranks, window_ranks = [g[0] for g in gathered], [g[1] for g in gathered]
            if process_ranks is not None:
                process_ranks = [g[2] for g in gathered]
            bad = sorted({k for w in window_ranks for k, v in w["sums"].items() if not math.isfinite(float(v))})
        else:
            bad = self.window.non_finite()
        if bad:
            raise NonFiniteLossError(
                f"non-finite {', '.join(bad)} at or before step {self.step}; not saving a checkpoint "
                f"{self._divergence_hint()}"
            )
        if not self.is_main:
            return None
        state = self.state_dict()
        if process_ranks is not None:
            state["trainer"]["process_ranks"] = process_ranks
        if rng_ranks is not None and window_ranks is not None:
            state["trainer"]["rng_ranks"] = rng_ranks
            state["trainer"]["window_ranks"] = window_ranks
            state["trainer"]["window"] = MetricWindow.mean_state(window_ranks)
        return ckpt.save_checkpoint(self.run_dir, state, keep_last=int(self.cfg.train.keep_last))

    def _load(self, found: ckpt.FoundCheckpoint) -> None:
        state = found.state
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        restore_scheduler(self.scheduler, state["scheduler"])
        load_extra = getattr(self.agent, "load_extra_state", None)
        if callable(load_extra):
            load_extra(state["extra"])
        load_process = getattr(self.agent, "load_process_state", None)
        if callable(load_process):  # every process's own state; the agent picks its rank's
            load_process(state["trainer"].get("process_ranks"))
        windows = state["trainer"].get("window_ranks")
        if windows is not None and len(windows) == self.world_size:
            self.window.load_state_dict(windows[self.rank], self.device)  # this rank's own: exact
        else:  # one process, or another number of processes: the mean window (see MetricWindow.mean_state)
            saved_ranks = 1 if windows is None else len(windows)
            self.window.load_state_dict(MetricWindow.for_ranks(state["trainer"]["window"], saved_ranks,
                                                               self.world_size), self.device)
        self.elapsed_s = float(state["trainer"]["elapsed_s"])
        self.step = int(state["step"])
        self._rng_to_restore = state["rng"]  # restored last, right before the first update
        ranks = state["trainer"].get("rng_ranks")
        if self.world_size > 1 or ranks is not None:
            if ranks is not None and len(ranks) == self.world_size:
                self._rng_to_restore = ranks[self.rank]
            else:
                saved = 1 if ranks is None else len(ranks)
                if self.is_main:
                    log.warning("resuming a run of %s with %s: the weights and batches carry over exactly, but the "
                                "dropout random streams and the float summation order of the gradients change, so "
                                "the continuation is not bit-identical to one with %s",
                                _processes(saved), _processes(self.world_size), _processes(saved))
                if self.rank > 0:
                    seed_everything(derive_seed(int(self.cfg.seed), "rank", self.rank, self.step))
                    self._rng_to_restore = capture_rng_state()
        self._resumed_from = found.path
        note = getattr(self.agent, "resume_note", None)
        if callable(note) and self.is_main:
            text = note(self.step)
            if text:
                log.warning("warning: %s", text)

    def _divergence_hint(self) -> str:
        """What a non-finite loss or gradient norm asks the user to try: the optimiser's options,
        unless the loss of the run's first update, computed before any parameter changed, was
        already not finite (then the data's scale or the initial model is the cause)."""
        if self._first_loss_finite is False:
            return ("(the loss of the first update, computed before any parameter changed, is not finite, so the "
                    "learning rate is not the cause: the data or the initial model overflow float32; check the "
                    "scale of the observations, rewards and actions, e.g. agent.normalize_obs=true)")
        return "(try a lower train.lr, train.grad_clip, or train.amp=none)"


class _TrainerEvaluation(_TrainerState):
    """The evaluation side of :class:`Trainer`: the agent's ``evaluate(step)`` on its schedule,
    a failing evaluation left resumable, and an evaluation a resumed run still owes."""

    def evaluate(self, logger: RunLogger) -> dict[str, float]:
        """Run the agent's ``evaluate(step)`` (if any; rank 0 only) and log its scalars and figures."""
        fn = getattr(self.agent, "evaluate", None)
        if not callable(fn) or not self.is_main:
            return {}
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        try:
            with isolated_rng(), torch.no_grad():
                out = fn(self.step) or {}
        finally:
            self.model.train(was_training)
        scalars: dict[str, float] = {}
        for key, value in out.items():
            tag = key if "/" in key else f"eval/{key}"
            if hasattr(value, "savefig"):
                logger.figure(tag, value, self.step)
            elif isinstance(value, Tensor) and value.numel() == 1 or isinstance(value, (int, float)):
                scalars[tag] = float(value)
            else:
                log.warning("evaluate() returned %s=%r: not a scalar or figure, not logged", key, type(value).__name__)
        scalars["eval/time_s"] = time.perf_counter() - t0
        logger.scalars(self.step, scalars)
        if self.step < self.total_steps:  # the final one is summarised by `rl-tformers train` (with how to repeat it)
            log.info("%s", logs_line(self.step, scalars))  # the console's record, as metrics.jsonl's
        return scalars

    def _evaluate_or_save(self, logger: RunLogger, *, saved: bool, checkpoint: Path | None) -> dict[str, float]:
        """:meth:`evaluate`; if it raises, the run is left resumable at this step and the error says so.

        A checkpoint of the current step is written first when ``saved`` is False. Under DDP
        every rank calls this (rank 0 alone evaluates) and learns from rank 0 whether the
        evaluation failed; if it did, every rank joins that save, and the ranks > 0 raise
        :class:`~rl_tformers.runtime.distributed.PeerFailure` (rank 0 reports the error).

        Raises:
            EvaluationInputError: the agent's ``evaluate`` raised a ``ValueError`` (bad input,
                e.g. an option of the agent that the evaluation cannot run with); the message
                repeats the agent's, names the checkpoint and suggests the fix rather than a
                command that would fail the same way (``rl-tformers eval RUN``, or ``--resume``,
                which evaluates again).
            Exception: any other exception of the evaluation, re-raised unchanged with a note
                (also logged) naming the checkpoint and how to continue or evaluate the run.
        """
        failure: Exception | None = None
        try:
            out = self.evaluate(logger)
        except Exception as exc:
            failure = exc
        if dist_rt.is_active():
            # rank 0 evaluated while the others waited; it tells them how the evaluation went
            # (one small broadcast), so that a failed evaluation's step is saved by every rank
            # together (the checkpoint holds every rank's state) and every rank stops, instead of
            # the others dying in their next collective with nothing saved since the last checkpoint
            if dist_rt.broadcast_object(failure is not None):
                if not saved:
                    checkpoint, saved = self.save(), True
                if not self.is_main:
                    raise dist_rt.PeerFailure(f"the evaluation of step {self.step} failed on rank 0 (it reports it)")
        if failure is None:
            return out
        try:
            raise failure
        except Exception as exc:
            checkpoint = self._save_after_failed_evaluation(exc, saved=saved, checkpoint=checkpoint)
            self._explain_failed_evaluation(exc, checkpoint)
            raise

    def _save_after_failed_evaluation(self, exc: Exception, *, saved: bool, checkpoint: Path | None) -> Path | None:
        """Save the current step after the evaluation raised ``exc`` unless it is ``saved`` (one
        process; under DDP :meth:`_evaluate_or_save` saves with every rank); returns the
        checkpoint the run continues from. A save that fails too is logged and ``exc`` re-raised."""
        if not saved and not dist_rt.is_active():
            try:
                checkpoint = self.save()
            except Exception as save_exc:  # noqa: BLE001 - report both, raise the evaluation's
                log.error("evaluation at step %d failed, and saving a checkpoint then failed too: %s",
                          self.step, save_exc)
                raise exc from None
        return checkpoint

    def _explain_failed_evaluation(self, exc: Exception, checkpoint: Path | None) -> None:
        """Raise :class:`EvaluationInputError` for a ``ValueError`` of the evaluation, else add
        (and log) the note to ``exc`` naming the checkpoint and how to continue or evaluate."""
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "the last checkpoint"
        if isinstance(exc, ValueError) and not isinstance(exc, EvaluationInputError):
            if self.step >= self.total_steps:
                then = (f"nothing is lost: the trained model is in {where}; `rl-tformers eval {self.run_dir}` "
                        f"as it is would fail the same way: evaluate it with the fix named above")
            else:
                then = (f"nothing is lost: the run is saved ({where}); resuming would meet the same "
                        f"evaluation: fix the option named above, or finish training without evaluating "
                        f"({resume_command(self.run_dir, self.world_size)} eval.every=0 eval.at_end=false) "
                        f"and evaluate the model with the fix")
            raise EvaluationInputError(f"evaluation at step {self.step} failed: {exc}; {then}") from exc
        if self.step >= self.total_steps:
            then = f"the trained model is in {where}; evaluate it with: rl-tformers eval {self.run_dir}"
        else:
            then = f"the run is saved ({where}); continue with: {resume_command(self.run_dir, self.world_size)}"
        note = f"evaluation at step {self.step} failed ({type(exc).__name__}: {exc}); {then}"
        log.error("%s", note)
        exc.add_note(note)

    def evaluate_final(self, checkpoint: Path) -> TrainResult:
        """Run and log the final evaluation of a run trained to ``train.steps`` whose evaluation
        was never logged (``--resume`` of such a run; ``checkpoint``: the one it resumed from).
        Trains nothing; evaluation errors as in :meth:`_evaluate_or_save`."""
        if self.is_main:
            log.info("%s is trained (step %d of train.steps=%d) but its final evaluation was not logged: "
                     "evaluating it now", self.run_dir, self.step, self.total_steps)
        logger = RunLogger(self.run_dir, enabled=self.is_main)
        try:
            last_eval = self._evaluate_or_save(logger, saved=True, checkpoint=checkpoint)
        finally:
            logger.close()
        return TrainResult(run_dir=self.run_dir, step=self.step, checkpoint=checkpoint, total_steps=self.total_steps,
                           last_eval=last_eval)

    def _evaluate_unlogged(self, logger: RunLogger, interrupt: GracefulInterrupt, result: TrainResult,
                           eval_every: int) -> None:
        """Before the first update of a resumed run: if the checkpoint resumed from is an
        evaluation step whose evaluation was never logged (it failed, or a second signal cut it
        short, after the step was saved), run it now, so the continued run logs what an
        uninterrupted one logs (it changes no training state). Rank 0 decides (it reads its own
        logs); under DDP every rank joins the evaluation's vote."""
        pending = (self._resumed_from is not None and self.is_main and bool(eval_every)
                   and 0 < self.step < self.total_steps and self.step % eval_every == 0
                   and not final_eval_logged(self.run_dir, self.step))
        if dist_rt.is_active():
            pending = bool(dist_rt.broadcast_object(pending))
        if pending:
            log.info("the evaluation of step %d (eval.every=%d) was not logged: evaluating it now", self.step,
                     eval_every)
            interrupt.evaluating = (self.step, False)
            result.last_eval = self._evaluate_or_save(logger, saved=True, checkpoint=self._resumed_from)
            interrupt.evaluating = None


class _TrainerUpdates(_TrainerState):
    """The update side of :class:`Trainer`: one optimiser update, the per-update step around it
    (random features, batch, metrics window) and the random-feature redraw schedule."""

    def update(self, batch: Any) -> tuple[Tensor, Tensor, Mapping[str, Any]]:
        """One optimiser update on ``batch`` (already on the device; this rank's shard under DDP).

        autocast(train.amp) forward + loss, backward (DDP all-reduces gradients inside it),
        global-norm clipping to ``train.grad_clip``, AdamW step, scheduler step. No host sync.

        Returns:
            (loss, grad_norm, logs): 0-dim tensors on the device and the agent's extra scalars.

        Raises:
            TypeError: the agent's ``loss`` did not return a 0-dim tensor first.
        """
        with autocast(self.device, self.amp):
            loss, logs = (self.ddp if self.ddp is not None else self.agent.loss)(batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise TypeError(f"agent {self.cfg.agent.kind!r}: loss() must return a 0-dim tensor first, got {loss!r}")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self._clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss, grad_norm, logs

    def _train_step(self, batches: Iterator[Any]) -> float:
        """Update ``step`` -> ``step + 1``: redraw the random features due after ``step``, take the
        next batch to the device, :meth:`update`, add its scalars to the window. Returns the
        learning rate of the update (before the scheduler stepped).

        Raises:
            RuntimeError: the agent's ``batches()`` ran out before ``train.steps``.
        """
        # features due after update `step` are redrawn only now, before the next batch: the
        # checkpoint and evaluation of `step` keep the features its weights were trained with
        self._redraw_features()
        try:
            batch = next(batches)
        except StopIteration:
            raise RuntimeError(
                f"agent {self.cfg.agent.kind!r}: batches() ran out at step {self.step} of {self.total_steps}"
            ) from None
        batch = move_to(batch, self.device)
        lr = float(self.optimizer.param_groups[0]["lr"])  # of this update (before the scheduler steps)
        if self.cfg.train.cuda_graphs:  # a new iteration: the previous replay's outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        loss, grad_norm, logs = self.update(batch)
        if self.step == 0:  # a new run's first loss, computed before any parameter changed (one sync)
            self._first_loss_finite = bool(torch.isfinite(loss.detach()).all())
        self.step += 1
        self.window.add({"train/loss": loss, "train/grad_norm": grad_norm,
                         **{(k if "/" in k else f"train/{k}"): v for k, v in dict(logs).items()}},
                        samples=batch_size_of(batch) or 0)
        return lr

    def _redraw_features(self) -> int:
        """Redraw the random features that are due after update ``self.step`` (the attention
        kinds' ``redraw_every``); returns the number of modules redrawn.

        Called before the batch of the next update is drawn (after the checkpoint and the
        evaluation of update ``self.step``, so a saved or evaluated model holds the features its
        weights were trained with), so the function changes *between* updates only. An agent with an optional ``updates_per_rollout`` attribute
        U (on-policy: one rollout feeds U updates) gets its redraws only at rollout boundaries
        (steps that are multiples of U, catching up any schedule step since the previous one),
        never between a rollout and the updates that learn from it. The draw comes from a
        generator seeded with ``derive_seed(seed, "redraw", step)`` (the global RNGs are not
        touched) and the features are buffers in the checkpoint: resuming is exact.
        """
        if not self._random_feature_modules:
            return 0
        unit = max(1, int(getattr(self.agent, "updates_per_rollout", 1) or 1))
        if self.step % unit:
            return 0

        gen = torch.Generator().manual_seed(derive_seed(int(self.cfg.seed), "redraw", self.step))
        return maybe_redraw_random_features(self.model, self.step, gen, since=self.step - unit)

    @property
    def _clip(self) -> float:
        return float(self.cfg.train.grad_clip) if self.cfg.train.grad_clip else math.inf


class _TrainerStops(_TrainerState):
    """The stop side of :class:`Trainer`: the ranks' agreement to start and to stop after the
    same update, and what a stop or an abort by a signal leaves."""

    def _stop_signal(self, interrupt: GracefulInterrupt) -> int | None:
        """The signal that stops the run after this update, or None. Under DDP every rank gets
        the same answer (one all-reduce: the largest signal number any rank received), so all
        of them stop, and save together, after the same update."""
        if not dist_rt.is_active():
            return interrupt.signum
        return dist_rt.max_over_ranks(interrupt.signum or 0, self.device) or None

    def _agree_to_start(self, interrupt: GracefulInterrupt) -> None:
        """Leave start-up mode, then agree with every rank that training starts.

        Every rank switches to graceful stops before this vote (one all-reduce under DDP), and
        the vote completes on no rank before all have reached it: after it, a signal stops
        every rank at the same update boundary with a checkpoint. A rank that was still in
        its start-up when the signal came has ended at once, so the others see the vote fail.

        Raises:
            Interrupted: a signal reached this or another rank first (every rank raises it), or
                another rank left before the vote (this rank's signal, or None if it got none).
            RuntimeError: the vote failed on rank 0, which received no signal (another rank
                failed during its start-up; its error is above).
        """
        interrupt.begin_training()
        try:
            signum = self._stop_signal(interrupt)
        except RuntimeError as exc:
            if not dist_rt.is_active() or (self.is_main and interrupt.signum is None):
                raise
            raise Interrupted(interrupt.signum) from exc
        if signum is not None:
            raise Interrupted(signum)

    def _abort_note(self, signum: int, evaluating: tuple[int, bool] | None = None) -> str:
        """What an abort by a second signal leaves: the last checkpoint and how to continue
        (``evaluating``: the ``(step, final)`` of an evaluation it cut short)."""
        what = f"aborted at once by a second signal ({signal.Signals(signum).name}) at step {self.step}"
        if evaluating is not None:
            what += f", during the {'final ' if evaluating[1] else ''}evaluation of step {evaluating[0]} (not logged)"
        saved = ckpt.list_checkpoints(self.run_dir)  # newest first
        if not saved:
            return f"{what}; no checkpoint was written yet, so there is nothing to resume"
        step, path = saved[0]
        if step >= self.total_steps:
            return (f"{what}; the run is trained to step {step} ({path}): evaluate it with "
                    f"`rl-tformers eval {self.run_dir}`, or log its final evaluation with "
                    f"{resume_command(self.run_dir, self.world_size)}")
        return (f"{what}; the run continues from its last checkpoint, step {step} ({path}): "
                f"{resume_command(self.run_dir, self.world_size)}")

    def _announce_stop(self, signum: int, bar: Any, checkpoint: Path | None) -> None:
        """Log where a run stopped by ``signum`` stands and the command that continues it."""
        if bar is not None:  # its last line first: the "continue with" line must end the output
            bar.close()
        # stopped right after a resume, before any update: the checkpoint resumed from holds this step
        log.warning("stopped at step %d by %s; checkpoint %s; continue with: %s",
                    self.step, signal.Signals(signum).name, checkpoint or self._resumed_from,
                    resume_command(self.run_dir, self.world_size))


class _WindowTimer:
    """The throughput clock of a log window: the updates this process made since the window's
    timing started (after a resume the restored window also counts updates made before it) and
    the time spent on them, checkpoint and evaluation time excluded (:meth:`pause` and
    :meth:`resume` around them)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.t0, self.elapsed, self.updates = time.perf_counter(), 0.0, 0

    def pause(self) -> None:
        self.elapsed += time.perf_counter() - self.t0

    def resume(self) -> None:
        self.t0 = time.perf_counter()

    def seconds(self) -> float:
        """Seconds timed so far (at least 1e-9)."""
        return max(self.elapsed + time.perf_counter() - self.t0, 1e-9)


class _TrainerRecords(_TrainerState):
    """The record side of :class:`Trainer`: the resolved values, ``config.yaml`` and the run's
    first log lines, and each logging window's scalars."""

    def resolved_values(self) -> dict[str, Any]:
        """The effective values of what this start resolved (dotted key -> value): ``device``
        (the torch device of this rank), ``cpu_matmul`` (and the measurement ``auto`` chose it by:
        :func:`~rl_tformers.runtime.resolved.cpu_matmul_values`), ``processes``, ``torch.num_threads``,
        ``torch.num_interop_threads`` and the agent's own (``resolved_options()``, e.g.
        ``agent.reward_scale``). Recorded in ``config.yaml``, the first log line and the
        TensorBoard hparams (:mod:`rl_tformers.runtime.resolved`)."""
        values: dict[str, Any] = {
            "device": str(self.device), "processes": int(self.world_size),
            "torch.num_threads": int(torch.get_num_threads()),
            "torch.num_interop_threads": int(torch.get_num_interop_threads()),
        }
        if self.device.type == "cpu":  # the library, and the measurement auto chose it by
            values["cpu_matmul"] = str(self.cfg.get("cpu_matmul", "mkl"))
            values.update(cpu_matmul_values(self.cfg, read_resolved_file(self.run_dir / CONFIG_FILE)))
        own = getattr(self.agent, "resolved_options", None)
        if callable(own):
            values.update({str(k): v for k, v in dict(own()).items()})
        return values

    def _prepare_run_dir(self, logger: RunLogger, resolved: Mapping[str, Any]) -> None:
        yaml_text = self.config_yaml
        text = resolved_block(resolved) + yaml_text
        ckpt.atomic_write(self.run_dir / CONFIG_FILE, lambda f: f.write(text.encode()))
        if self._resumed_from is None:
            flat = flatten(to_container(self.cfg))
            logger.config(yaml_text, {**flat, **{f"resolved.{k}": v for k, v in resolved.items()}})
        else:
            logger.text("resume", f"resumed at step {self.step} from `{self._resumed_from.name}`", self.step)

    def _log_start(self, resolved: Mapping[str, Any]) -> None:
        """The run's first console lines (main rank): what trains where, and :func:`config_warnings`."""
        n_params = sum(p.numel() for p in self.params)
        if self.is_main:
            procs = f" x {self.world_size} processes" if self.world_size > 1 else ""
            log.info("run %s | agent %s | %d trainable parameters | device %s%s | steps %d -> %d | resolved: %s",
                     self.run_dir, self.cfg.agent.kind, n_params, self.device, procs, self.step, self.total_steps,
                     resolved_line(resolved))
            for message in config_warnings(self.cfg):
                log.warning("warning: %s", message)

    def _log_window(self, logger: RunLogger, bar: Any, result: TrainResult, lr: float, timer: _WindowTimer) -> None:
        """Log the window's means over every rank (:meth:`MetricWindow.reduce`), the learning rate
        ``lr`` of the last update and the window's throughput, then start the next window.

        Raises:
            NonFiniteLossError: a scalar of the window is NaN/inf (nothing is logged).
        """
        scalars, samples = self.window.reduce(self.device)
        bad = [k for k, v in scalars.items() if not math.isfinite(v)]
        if bad:
            raise NonFiniteLossError(
                f"non-finite {', '.join(bad)} in updates {self.step - self.window.count + 1}..{self.step} "
                f"{self._divergence_hint()}"
            )
        scalars["train/lr"] = lr  # of the last update
        dt = timer.seconds()
        scalars["perf/steps_per_s"] = timer.updates / dt
        scalars["perf/samples_per_s"] = samples * timer.updates / max(self.window.count, 1) / dt
        logger.scalars(self.step, scalars)
        result.last_train = scalars
        if self.on_log is not None and self.is_main:
            self.on_log(self.step, scalars)
        if bar is not None:
            bar.set_postfix(loss=f"{scalars['train/loss']:.4g}", lr=f"{lr:.2e}", refresh=False)
        self.window.reset()
        timer.restart()


class Trainer(_TrainerCheckpoints, _TrainerEvaluation, _TrainerUpdates, _TrainerStops, _TrainerRecords):
    """Runs one training run of any registered agent.

    This class sets the run up (:meth:`__init__`) and drives it (:meth:`fit`, the update loop);
    its parts are split by responsibility: checkpoints and exact resume
    (:class:`_TrainerCheckpoints`), evaluation (:class:`_TrainerEvaluation`), one update
    (:class:`_TrainerUpdates`), stop signals (:class:`_TrainerStops`) and the run's records
    (:class:`_TrainerRecords`).

    Args:
        cfg: a resolved config from :func:`rl_tformers.runtime.run_config.compose`.
        run_dir: the run directory (created if needed).
        resume_from: a verified checkpoint of this run to continue from (see :func:`resume`).
        on_log: called as ``on_log(step, scalars)`` (main rank) each time training scalars are
            logged (every ``train.log_every`` updates), e.g. for progress lines without a terminal.

    Raises:
        ConfigError / ValueError: bad device or schedule values (before anything is written).
        TypeError: the agent's builder returned something that is not a Trainable.
    """

    def __init__(self, cfg: DictConfig, run_dir: str | os.PathLike, *, resume_from: ckpt.FoundCheckpoint | None = None,
                 on_log: Callable[[int, dict[str, float]], None] | None = None):
        self.cfg = cfg
        self.config_yaml = to_yaml(cfg)  # the config is read-only: serialise it once
        self.on_log = on_log
        self.run_dir = Path(run_dir)
        self.dist = dist_rt.dist_info()
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        t = cfg.train
        self.total_steps = int(t.steps)
        self.device = dist_rt.rank_device(resolve_device(cfg.device), self.dist)
        check_world_size(cfg, self.world_size)
        self.amp = str(t.amp.value if hasattr(t.amp, "value") else t.amp)
        autocast(self.device, self.amp)  # validates amp
        seed_everything(int(cfg.seed), deterministic=bool(t.deterministic))

        # the builder may read the checkpoint it will be resumed from (agents.resume_state)
        self.agent: Trainable = build_agent(cfg, self.run_dir, self.device,
                                            resume_from=resume_from.state if resume_from is not None else None)
        self.model = self.agent.model.to(self.device)
        if self.device.type == "cpu":  # float32 nn.Linear products in the library the config resolved
            apply_cpu_matmul(self.model, str(cfg.get("cpu_matmul", "mkl")))
        groups_fn = getattr(self.agent, "param_groups", None)
        groups = groups_fn() if callable(groups_fn) else default_param_groups(self.model, float(t.weight_decay))
        self.optimizer = build_optimizer(groups, lr=float(t.lr), weight_decay=float(t.weight_decay),
                                         betas=tuple(t.betas), eps=float(t.eps))
        schedule = str(t.schedule.value if hasattr(t.schedule, "value") else t.schedule)
        self.scheduler = build_scheduler(
            self.optimizer, LRSchedule(schedule, self.total_steps, int(t.warmup_steps), float(t.min_lr_ratio))
        )
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]

        #: attention modules with random features (Performer, RFA, LSH) redrawn on their schedule
        self._random_feature_modules = random_feature_modules(self.model)
        #: logged keys that keep their latest value in a logging window (the agent's ``latest_logs``)
        latest = getattr(self.agent, "latest_logs", ()) or ()
        latest = (latest,) if isinstance(latest, str) else tuple(latest)
        self.window = MetricWindow(latest=[k if "/" in k else f"train/{k}" for k in latest])
        self.step = 0
        self.elapsed_s = 0.0
        self._rng_to_restore: dict[str, Any] | None = None
        self._resumed_from: Path | None = None
        #: whether the loss of a new run's first update (before any parameter changed) was finite
        self._first_loss_finite: bool | None = None
        if self.rank > 0:  # different dropout masks on different shards (checkpoints keep each rank's RNG)
            seed_everything(derive_seed(int(cfg.seed), "rank", self.rank), deterministic=bool(t.deterministic))
        if resume_from is not None:
            self._load(resume_from)
        #: DistributedDataParallel around the agent's loss (multi-process runs), else None
        self.ddp: torch.nn.Module | None = None
        if self.dist.distributed:
            if not dist_rt.is_active():
                raise RuntimeError(
                    f"WORLD_SIZE={self.world_size} (torchrun) but no process group: start runs with "
                    f"rl_tformers.runtime.trainer.train/resume (or `rl-tformers train`), which join it"
                )
            # the agent asks for it when it knows some updates leave parameters without a gradient
            # (PPO's critic warm-up trains the value head alone)
            find_unused = bool(t.get("ddp_find_unused", False)) or bool(getattr(self.agent, "ddp_find_unused", False))
            self.ddp = dist_rt.wrap_ddp(self.agent, self.device, find_unused)

    def fit(self, stop_at: int | None = None, interrupt: GracefulInterrupt | None = None) -> TrainResult:
        """Train from the current step to ``train.steps``; stops early (after saving) on SIGINT/SIGTERM.

        Args:
            stop_at: stop after this many updates (with a checkpoint) even if ``train.steps``
                is larger; ``--resume`` continues exactly as if the run had never stopped
                (for time-limited jobs). None: run to ``train.steps``.
            interrupt: this process's signal handling, already entered (``rl-tformers train``
                runs its whole start-up under one in start-up mode, see
                :class:`GracefulInterrupt`); None: a graceful one is installed for the call.

        Before anything is written to the run directory every rank leaves start-up mode and
        the ranks agree that training starts (:meth:`_agree_to_start`); a signal before that
        point leaves the run directory as it was.

        Raises:
            Interrupted: a signal reached this or another rank before the first update (every
                rank raises it); nothing was trained or written.
            KeyboardInterrupt: a second signal aborted the run (logged, with where the run
                stands, when :attr:`GracefulInterrupt.announce`).
            NonFiniteLossError: the loss or gradient norm became NaN/inf (no checkpoint of it).
            Exception: whatever the agent's ``evaluate`` raises, after the step it evaluated is
                saved (see :meth:`_evaluate_or_save`).
        """
        own = interrupt is None
        interrupt = GracefulInterrupt(announce=self.is_main) if interrupt is None else interrupt
        with interrupt if own else contextlib.nullcontext():
            with agent_build_errors():  # the agent's data checks, before the run directory is written
                batches = self.agent.batches(self.step)
                if self.cfg.train.data_on_device:
                    batches = on_device(batches, self.device, str(self.cfg.agent.kind))
            self._agree_to_start(interrupt)
            try:
                return self._train(batches, interrupt, stop_at)
            except KeyboardInterrupt:
                if interrupt.aborted is not None and interrupt.announce:
                    log.warning("%s", self._abort_note(interrupt.aborted, interrupt.evaluating))
                raise

    def _train(self, batches: Any, interrupt: GracefulInterrupt, stop_at: int | None) -> TrainResult:
        """The part of :meth:`fit` after the ranks agreed to start: prepare the run directory,
        then the training loop."""
        t = self.cfg.train
        result = TrainResult(run_dir=self.run_dir, step=self.step, total_steps=self.total_steps)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self._resumed_from is not None:
                truncate_run_logs(self.run_dir, self.step)
        logger = RunLogger(self.run_dir, enabled=self.is_main)
        stream: Any = None
        bar = None
        try:
            resolved = self.resolved_values() if self.is_main else {}
            if self.is_main:
                self._prepare_run_dir(logger, resolved)
            self._log_start(resolved)
            if t.compile or t.cuda_graphs:  # reduce-overhead: CUDA graphs of the forward and backward
                self.model.compile(**({"mode": "reduce-overhead"} if t.cuda_graphs else {}))
            if isinstance(batches, DeviceStepBatches):  # drawn on the device, no DataLoader
                batches = batches.iter_from(self.step)
            if getattr(self.agent, "local_batches", False):  # each rank's batches are its own share already
                source = batches
            else:
                source = dist_rt.shard_source(batches, self.rank, self.world_size)
            stream = batch_stream(source, self.step, self.total_steps, int(t.num_workers),
                                  pin_memory=self.device.type == "cuda")
            if self._rng_to_restore is not None:
                restore_rng_state(self._rng_to_restore)
                self._rng_to_restore = None
            bar = _progress(self.step, self.total_steps, enabled=bool(t.progress) and self.is_main)
            with _log_above_bar(bar):
                result = self._loop(iter(stream), logger, bar, interrupt, result, stop_at)
        finally:
            if bar is not None:
                bar.close()
            stream = None  # shuts DataLoader workers down
            logger.close()
        return result

    def _loop(self, batches: Iterator[Any], logger: RunLogger, bar: Any, interrupt: GracefulInterrupt,
              result: TrainResult, stop_at: int | None) -> TrainResult:
        """The updates from the current step to ``stop_at`` (or ``train.steps``): per update the
        ranks' stop vote and :meth:`_train_step`, then on their schedules the log window, the
        checkpoint and the evaluation; the last step is saved, and a stop announced."""
        t, ev = self.cfg.train, self.cfg.eval
        log_every, ckpt_every, eval_every = int(t.log_every), int(t.checkpoint_every), int(ev.every)
        last_saved = self.step if self._resumed_from is not None else -1
        self.model.train()
        self._evaluate_unlogged(logger, interrupt, result, eval_every)
        timer = _WindowTimer()
        end = self.total_steps if stop_at is None else min(int(stop_at), self.total_steps)
        stopped_by: int | None = None
        while self.step < end:
            stopped_by = self._stop_signal(interrupt)
            if stopped_by is not None:
                break
            t0 = time.perf_counter()
            lr = self._train_step(batches)
            self.elapsed_s += time.perf_counter() - t0
            timer.updates += 1
            if bar is not None:
                bar.update(1)

            if self.step % log_every == 0 or self.step == self.total_steps:
                self._log_window(logger, bar, result, lr, timer)
            # checkpoint first, then evaluate: a failing evaluation (a broken environment, a bug in
            # the agent's evaluate) must not cost the updates before it
            if (ckpt_every and self.step % ckpt_every == 0) or self.step == self.total_steps:
                timer.pause()
                result.checkpoint = self.save()
                last_saved = self.step
                timer.resume()
            if (eval_every and self.step % eval_every == 0) or (self.step == self.total_steps and ev.at_end):
                timer.pause()
                if self.step == self.total_steps and bar is not None:
                    bar.close()  # the last progress line shows the training rate, not the evaluation's time
                interrupt.evaluating = (self.step, self.step == self.total_steps)
                result.last_eval = self._evaluate_or_save(logger, saved=last_saved == self.step,
                                                          checkpoint=result.checkpoint)
                interrupt.evaluating = None
                timer.resume()

        if self.step >= end:
            stopped_by = None  # a signal during the final save is moot
        if last_saved != self.step and (stopped_by is not None or self.step == end):
            result.checkpoint = self.save()
        if stopped_by is not None and interrupt.announce:
            self._announce_stop(stopped_by, bar, result.checkpoint)
        result.step = self.step
        result.interrupted = stopped_by
        logger.flush()
        return result




def on_device(batches: Any, device: torch.device, kind: str) -> DeviceStepBatches:
    """``train.data_on_device``: the agent's step-indexed batches drawn on ``device``.

    Raises:
        ValueError: the agent's ``batches()`` is not a :class:`StepBatchDataset` of a window or
            segment sampler (an on-policy or online agent's own stream), naming the option.
    """
    sampler = getattr(batches, "sampler", None)
    if not isinstance(batches, StepBatchDataset) or not isinstance(sampler, (WindowSampler, SegmentSampler)):
        raise ValueError(f"train.data_on_device=true: agent {kind!r} does not draw its batches from a dataset with "
                         f"a window or segment sampler ({type(batches).__name__}); set train.data_on_device=false")
    return batches.on_device(device)


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def resume_command(run_dir: str | os.PathLike, world_size: int = 1) -> str:
    """The command that continues ``run_dir`` (with ``--nproc N`` for a run of N > 1 processes)."""
    return f"rl-tformers train --resume {run_dir}" + (f" --nproc {world_size}" if world_size > 1 else "")


def _log_above_bar(bar: Any) -> Any:
    """While a tqdm bar is drawn on a terminal, route ``rl_tformers`` console log lines through
    ``tqdm.write`` (plain progress lines need nothing: they are ordinary lines)."""
    if bar is None or bar.disable or isinstance(bar, PlainProgress):
        return contextlib.nullcontext()

    return logging_redirect_tqdm(loggers=[logging.getLogger("rl_tformers")])


def _progress(start: int, total: int, enabled: bool) -> Any:
    """The run's progress on stderr: a tqdm bar on a terminal; otherwise (a log file, a pipe) a
    plain line every :data:`~rl_tformers.runtime.progress.PLAIN_INTERVAL_S` seconds or every
    :data:`~rl_tformers.runtime.progress.PLAIN_FRACTION` of the run, whichever comes first, and at
    the end, without the bar's carriage returns (:func:`~rl_tformers.runtime.progress.progress_bar`)."""
    return progress_bar(total, initial=start, desc="train", unit="step", enabled=enabled, file=sys.stderr,
                        dynamic_ncols=True, mininterval=0.5, smoothing=0.05)


# -- entry points --------------------------------------------------------------------------------

def _with_run_dir(cfg: DictConfig, run_dir: Path) -> DictConfig:
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    out.run_dir = str(run_dir)
    OmegaConf.set_readonly(out, True)
    return out


def final_eval_logged(run_dir: str | os.PathLike, step: int) -> bool:
    """True if the run's ``metrics.jsonl`` has an ``eval/...`` scalar logged at ``step``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return False
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a crash
            continue
        if rec.get("step") == step and any(str(k).startswith("eval/") for k in rec):
            return True
    return False


def holds_run(run_dir: Path) -> bool:
    """True if ``run_dir`` already has checkpoints, metrics or event files."""
    return bool(ckpt.list_checkpoints(run_dir) or (run_dir / METRICS_FILE).exists() or event_files(run_dir))


def check_agent(cfg: DictConfig, device: str | torch.device = "cpu") -> None:
    """Make the checks ``rl-tformers train`` makes of the agent before it trains or writes
    anything, without a run: build the agent (:func:`~rl_tformers.runtime.agent_registry.build_agent`,
    as :class:`Trainer` does: dataset loaded and validated, agent options, backbone and
    evaluation environment checked) and prepare its first batches (as :meth:`Trainer.fit`
    does), then drop it. Nothing is written (builders do not write to the run directory).

    ``rl-tformers sweep`` calls it for every grid point with a run to start (not one to resume)
    before it starts any run. The model is built on ``device`` (default CPU: the caller holds no
    accelerator memory; the model is thrown away).

    Raises:
        AgentBuildError: the builder or its first batches refused the config or the data (a
            :class:`ConfigError` whose message names the option, field, episode or file).
        UnknownAgentError: ``agent.kind`` is not registered.
        TypeError: the builder's result is not a Trainable.
    """
    run_dir = Path(str(cfg.run_dir)) if cfg.get("run_dir") else Path(".")
    agent = build_agent(cfg, run_dir, torch.device(device))
    with agent_build_errors():
        agent.batches(0)


def check_world_size(cfg: DictConfig, world_size: int) -> None:
    """Refuse a process count the agent kind cannot train with, or a global batch that the
    processes cannot split evenly.

    Agent kinds registered with ``single_process=True`` (Online DT: its replay buffer and
    rollouts belong to one process) refuse any ``world_size`` > 1. Kinds registered with
    ``local_batches=True`` (on-policy PPO: every rank trains on minibatches of its own rollout)
    do not split ``train.batch_size``, so any process count fits.

    Raises:
        ConfigError: a ``single_process`` kind with ``world_size`` > 1 (naming ``agent.kind`` and
            ``--nproc``), or ``train.batch_size`` not divisible by ``world_size`` (> 1).
    """
    if world_size <= 1:
        return
    kind = OmegaConf.select(cfg, "agent.kind", default=None)
    try:
        entry = get_agent(str(kind)) if kind is not None else None
    except UnknownAgentError:
        entry = None  # (building the agent reports it)
    if entry is not None and entry.single_process:
        raise ConfigError(f"agent.kind={kind} runs in one process only (its training state is not shared between "
                          f"processes); this run asks for {world_size} (--nproc {world_size}): use --nproc 1")
    if entry is not None and entry.local_batches:
        return
    b = int(cfg.train.batch_size)
    if b % world_size:
        raise ConfigError(
            f"train.batch_size={b} is the global batch and must be divisible by the {world_size} processes "
            f"(--nproc {world_size}); pick a multiple of {world_size}"
        )


def _held_run_problem(path: Path) -> str:
    if ckpt.list_checkpoints(path):
        return (f"{path} already holds a run; continue it with --resume {path} (Python: "
                f"rl_tformers.runtime.trainer.resume({str(path)!r}, ['train.steps=N'])), or pick another "
                f"--run-dir (Python: train(cfg, run_dir=...))")
    return (f"{path} already holds the logs of a run that stopped before its first checkpoint; "
            f"delete it or pick another --run-dir")


def write_paths_problem(run_dir: str | os.PathLike, option: str = "--run-dir") -> str | None:
    """Why the run cannot write its files in the existing folder ``run_dir`` (None if it can):
    its checkpoint folder (``RUN_DIR/checkpoints``) exists and is not a folder, an entry of it
    named like a checkpoint (``step_*.pt``) is not a file, or ``config.yaml`` /
    ``metrics.jsonl`` exists and is not a file. Checked before training starts, so that the first
    save does not fail after the run has started. Creates nothing.

    Args:
        option: the command-line option that named ``run_dir`` (``--run-dir``, ``--resume``).
    """
    run_dir = Path(run_dir)
    fix = "move it away" if option == "--resume" else f"move it away or pick another {option}"

    def what(p: Path) -> str:
        return "a folder" if p.is_dir() else "a file" if p.is_file() else "not a regular file"

    def occupied(p: Path) -> bool:
        return p.exists() or p.is_symlink()

    folder = ckpt.checkpoint_dir(run_dir)
    if occupied(folder) and not folder.is_dir():
        return f"{option} {run_dir}: {folder} is {what(folder)}, not the folder the run keeps its checkpoints in; {fix}"
    named = [e for e in sorted(folder.iterdir()) if e.name.startswith("step_") and e.name.endswith(".pt")] \
        if folder.is_dir() else []
    for p in [*named, run_dir / CONFIG_FILE, run_dir / METRICS_FILE]:
        if occupied(p) and not p.is_file():
            return (f"{option} {run_dir}: {p} is {what(p)}, not {'a checkpoint' if p.parent == folder else 'a file'}; "
                    f"the run writes {'its checkpoints' if p.parent == folder else 'that file'} under that name: {fix}")
    return None


def new_run_problem(path: str | os.PathLike) -> str | None:
    """Why a new run cannot start in ``path`` (None if it can), without creating or locking
    anything: the path (or a folder above it) is a file, another process is training there,
    or it already holds a run. :func:`train` checks the same again under the run's lock."""
    path = Path(path)
    problem = directory_problem(path, "--run-dir")
    if problem is not None or not path.is_dir():
        return problem
    problem = write_paths_problem(path, "--run-dir")
    if problem is not None:
        return problem
    pid = lock_holder(path)
    if pid is not None:
        return str(RunBusyError(path, pid or None))
    return _held_run_problem(path) if holds_run(path) else None


def train(cfg: DictConfig, run_dir: str | os.PathLike | None = None, config_name: str | None = None,
          stop_at: int | None = None, on_log: Callable[[int, dict[str, float]], None] | None = None,
          interrupt: GracefulInterrupt | None = None) -> TrainResult:
    """Start a new run.

    Args:
        cfg: resolved config (:func:`rl_tformers.runtime.run_config.compose`).
        run_dir: where to write; default ``cfg.run_dir``, else ``runs/<config_name>-<timestamp>``.
        config_name: used for the default run directory name.
        stop_at: stop (with a checkpoint) after this many updates; see :meth:`Trainer.fit`.
        on_log: see :class:`Trainer`.
        interrupt: the caller's signal handling, already entered; see :meth:`Trainer.fit`.

    Under torchrun (``WORLD_SIZE`` > 1) this joins the process group for the run; rank 0 picks
    the run directory, checks it and holds its training lock (:mod:`rl_tformers.runtime.runlock`)
    until the run ends; the other ranks follow its decision.

    Raises:
        RunDirError: ``run_dir`` (or a folder above it) is a file, already holds a run, or
            another process is training it (``... is being trained by pid N``).
        Interrupted / KeyboardInterrupt: see :meth:`Trainer.fit`.
    """
    with dist_rt.process_group(cfg.device) as info, contextlib.ExitStack() as lock:
        problem, path = None, None
        if info.is_main:
            path = Path(run_dir) if run_dir is not None else (
                Path(cfg.run_dir) if cfg.run_dir else default_run_dir(cfg, config_name)
            )
            problem = directory_problem(path, "--run-dir")
            if problem is None and path.is_dir():
                problem = write_paths_problem(path, "--run-dir")
            if problem is None:
                try:
                    lock.enter_context(hold_run(path))
                except RunBusyError as exc:
                    problem = str(exc)
                except OSError as exc:
                    problem = f"--run-dir {path}: cannot create or lock it ({exc.strerror or exc})"
            if problem is None and holds_run(path):
                problem = _held_run_problem(path)
        problem, path = dist_rt.broadcast_object((problem, path))
        if problem is not None:
            raise RunDirError(problem)
        return Trainer(_with_run_dir(cfg, path), path, on_log=on_log).fit(stop_at, interrupt)


def load_resume_config(run_dir: str | os.PathLike, overrides: tuple[str, ...] | list[str] = (),
                       repair: bool = True, plugins: Iterable[str] = ()) -> tuple[DictConfig, ckpt.FoundCheckpoint,
                                                                            list[str]]:
    """The config a run resumes with, the checkpoint it resumes from and the changed keys.

    A module the run's ``plugins`` list (its checkpoint's config, or ``config.yaml``) is imported
    only when named: in ``plugins`` (``--plugin``), in a ``plugins=[...]`` override, or imported
    already (an installed entry point): :func:`~rl_tformers.runtime.plugins.named_plugins_only`.

    Args:
        repair: remove stale temporary files and quarantine damaged checkpoints (what one
            process resuming does; under DDP only rank 0 repairs, the others only read).
        plugins: the modules the user names (``--plugin``), imported first.

    Raises:
        CheckpointError: no valid checkpoint in ``RUN_DIR/checkpoints``.
        ConfigError: an override touches a key outside ``RESUMABLE_KEYS``; ``RUN_DIR/config.yaml``
            differs from the checkpoint's config (:func:`check_config_file`); a module of the
            run's plugins is not named, not found or fails to import; an environment id of the
            run names a module (``module:EnvId``) not imported (:func:`~rl_tformers.runtime.plugins.check_env_modules`).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        what = "it does not exist" if not run_dir.exists() else "it is a file"
        raise ckpt.CheckpointError(f"--resume {run_dir} is not a directory: {what} (RUN_DIR is the run directory "
                                   f"of an earlier run)")
    if repair:
        ckpt.remove_stale_temporaries(run_dir)
    found = ckpt.find_latest_valid(run_dir, quarantine=repair)
    saved = OmegaConf.create(found.state["config"])  # resolved plain values, as written
    with named_plugins_only(plugins, "--plugin", allowed=plugins_named_in(overrides)):
        new = _with_run_dir(compose(start=saved, overrides=list(overrides)), run_dir)
        changes = check_resume_changes(saved, new)
        check_config_file(run_dir, found, new, overrides)
    check_env_modules(to_container(new), "")  # a module:EnvId the run (not the user) names
    return new, found, changes


def _override_keys(overrides: tuple[str, ...] | list[str]) -> list[str]:
    return [o.split("=", 1)[0].strip() for o in overrides]


def check_config_file(run_dir: Path, found: ckpt.FoundCheckpoint, new: DictConfig,
                      overrides: tuple[str, ...] | list[str] = ()) -> None:
    """Refuse to resume when ``RUN_DIR/config.yaml`` says something the resumed run would not do.

    A run resumes with its checkpoint's config (plus the command line's overrides); config.yaml
    is only a copy, rewritten when the run continues. An edited copy would be silently undone,
    so every key of config.yaml (composed like the checkpoint's: layout and key order do not
    count) must equal the resumed config's, except
    ``run_dir`` and the keys the command line sets (the command line decides those). A missing
    config.yaml is fine (it is written again).

    Raises:
        ConfigError: naming config.yaml, each differing key with both values, and what to do:
            a key that may change when resuming is passed as an override, any other change
            needs a new run.
    """

    path = Path(run_dir) / CONFIG_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({exc}); fix or delete it (--resume takes the config from the "
                          f"checkpoint and writes config.yaml again)") from None
    if split_resolved(text)[1] == found.state["config"]:
        return  # written with this checkpoint's config (under the resolved values of a start)
    undo = f"undo the edit, or delete {path} (it is written again from the checkpoint's config)"
    try:
        on_disk = OmegaConf.load(path)
        if not isinstance(on_disk, DictConfig):
            raise ValueError(f"a YAML {type(on_disk).__name__}, not a mapping of keys")
        disk = compose(start=on_disk)
    except ConfigError as exc:
        raise ConfigError(f"{path} differs from the config of checkpoint {found.path.name} and does not compose "
                          f"({exc}); --resume continues with the checkpoint's config: {undo}") from None
    except Exception as exc:  # noqa: BLE001 - YAML syntax errors and the like, reported with the file
        raise ConfigError(f"{path}: not a readable config ({type(exc).__name__}: {exc}); {undo}") from None
    set_here = _override_keys(overrides)
    covered = lambda key: key == "run_dir" or any(key == k or key.startswith(k + ".") for k in set_here)  # noqa: E731
    a, b = flatten(to_container(new)), flatten(to_container(disk))
    resumable, fixed = [], []
    for key in sorted(set(a) | set(b)):
        if covered(key) or a.get(key, "<unset>") == b.get(key, "<unset>"):
            continue
        line = f"{key}: {a.get(key, '<unset>')} (checkpoint) -> {b.get(key, '<unset>')} (config.yaml)"
        if any(key == k or key.startswith(k + ".") for k in RESUMABLE_KEYS):
            resumable.append(f"{line}; to resume with it, pass {key}={b.get(key, '<unset>')} on the command line")
        else:
            fixed.append(f"{line}; cannot change when resuming: start a new run for it")
    if resumable or fixed:
        raise ConfigError(
            f"{path} differs from the config of checkpoint {found.path.name}, which --resume continues with "
            f"(config.yaml is a copy, not read on resume):\n  " + "\n  ".join(fixed + resumable)
            + f"\npass changes to {', '.join(RESUMABLE_KEYS)} as KEY=VALUE overrides on the command line "
            f"(e.g. rl-tformers train --resume {run_dir} train.steps=N); start a new run for any other change; "
            f"else {undo}")


def resume(run_dir: str | os.PathLike, overrides: tuple[str, ...] | list[str] = (),
           stop_at: int | None = None, interrupt: GracefulInterrupt | None = None,
           plugins: Iterable[str] = ()) -> TrainResult:
    """Continue a run from its newest valid checkpoint (damaged newer ones are warned about and skipped).

    ``overrides`` may change only :data:`rl_tformers.runtime.run_config.RESUMABLE_KEYS` (e.g.
    ``train.steps=20000`` to train longer). Log records written after the checkpoint (by a
    crash) are dropped first, so no step appears twice in TensorBoard or metrics.jsonl.
    Rank 0 holds the run's training lock (:mod:`rl_tformers.runtime.runlock`) from before it
    touches the directory until the run ends.

    ``interrupt``: the caller's signal handling, already entered; see :meth:`Trainer.fit`.
    ``plugins``: the modules of the run's ``plugins`` the caller trusts (``--plugin``); no other
    module the run lists is imported (:func:`load_resume_config`).

    Raises:
        RunDirError: another process is training ``run_dir`` (``... is being trained by pid N``).
        CheckpointError / ConfigError: as :func:`load_resume_config`.
        Interrupted / KeyboardInterrupt: see :meth:`Trainer.fit`.
    """
    with dist_rt.process_group(_resume_device_spec(run_dir, overrides)) as info, contextlib.ExitStack() as lock:
        _lock_for_resume(run_dir, info, lock)
        cfg, found, changes = _resume_config(run_dir, overrides, plugins, info)
        for line in changes:
            if not line.startswith("run_dir:") and info.is_main:
                log.info("resume: %s", line)
        if found.state["step"] >= int(cfg.train.steps):
            return _resume_trained(run_dir, cfg, found, info)
        try:
            trainer = Trainer(cfg, run_dir, resume_from=found)
        except AgentBuildError as exc:
            raise AgentBuildError(f"{exc}{_relative_data_hint(cfg)}") from exc.__cause__
        if info.is_main:  # after the data and the agent were accepted: a refused resume warns of nothing
            t = cfg.train
            saved_steps = OmegaConf.create(found.state["config"]).train.steps
            jump = restretch_message(
                getattr(t.schedule, "value", str(t.schedule)), float(t.lr), int(t.warmup_steps), float(t.min_lr_ratio),
                int(saved_steps), int(t.steps), int(found.state["step"]))
            if jump is not None:
                log.warning("resume: %s", jump)
        return trainer.fit(stop_at, interrupt)


def _lock_for_resume(run_dir: str | os.PathLike, info: dist_rt.DistInfo, lock: contextlib.ExitStack) -> None:
    """Rank 0 takes the run's training lock into ``lock`` and checks that the run can write its
    files; every rank learns the outcome.

    Raises:
        RunDirError: another process is training ``run_dir``, or a path the run writes is taken.
    """
    problem = None
    if info.is_main and Path(run_dir).is_dir():  # a missing directory: load_resume_config says so
        try:
            lock.enter_context(hold_run(run_dir))
        except RunBusyError as exc:
            problem = str(exc)
        if problem is None:
            problem = write_paths_problem(run_dir, "--resume")
    problem = dist_rt.broadcast_object(problem)
    if problem is not None:
        raise RunDirError(problem)


def _resume_config(run_dir: str | os.PathLike, overrides: tuple[str, ...] | list[str], plugins: Iterable[str],
                   info: dist_rt.DistInfo) -> tuple[DictConfig, ckpt.FoundCheckpoint, list[str]]:
    """:func:`load_resume_config` on every rank: rank 0 first (it repairs the run directory
    before the other ranks read it), then the others, which raise rank 0's error if it failed."""
    failure: Exception | None = None
    if info.is_main:
        try:
            loaded = load_resume_config(run_dir, overrides, plugins=plugins)
        except (ckpt.CheckpointError, ConfigError) as exc:
            failure = exc
    # every rank learns of rank 0's failure (instead of waiting for it in a barrier, then dying
    # with a traceback when rank 0 exits) and raises the same error
    failure = dist_rt.broadcast_object(failure)
    if failure is not None:
        raise failure
    if not info.is_main:
        loaded = load_resume_config(run_dir, overrides, repair=False, plugins=plugins)
    return loaded


def _resume_trained(run_dir: str | os.PathLike, cfg: DictConfig, found: ckpt.FoundCheckpoint,
                    info: dist_rt.DistInfo) -> TrainResult:
    """A resume of a run whose newest checkpoint is at or past ``train.steps``: trains nothing;
    runs the final evaluation if it was never logged (cut short by a second Ctrl-C, or failed),
    else says the run is complete (or that a run is never shortened)."""
    if info.is_main and found.state["step"] > int(cfg.train.steps):
        log.warning("train.steps=%d is below the step of %s's newest checkpoint (%d): nothing was "
                    "trained, and a run is never shortened (evaluate an earlier checkpoint with "
                    "rl-tformers eval --checkpoint instead)", cfg.train.steps, run_dir, found.state["step"])
    elif cfg.eval.at_end and not final_eval_logged(run_dir, int(found.state["step"])):
        trainer = Trainer(cfg, run_dir, resume_from=found)
        return trainer.evaluate_final(found.path)
    elif info.is_main:
        log.info("%s is complete (step %d of train.steps=%d); pass train.steps=N to train longer",
                 run_dir, found.state["step"], cfg.train.steps)
    return TrainResult(run_dir=Path(run_dir), step=int(found.state["step"]), checkpoint=found.path,
                       total_steps=int(cfg.train.steps))


def _relative_data_hint(cfg: DictConfig) -> str:
    """For a resume whose data are not found: the run's relative ``dataset.path`` / ``dataset.root``
    is read from the current folder, which may not be the one the run was started in."""

    ds = cfg.get("dataset") or {}
    path = ds.get("path")
    if (isinstance(path, str) and path and not Path(path).expanduser().is_absolute()
            and not Path(path).expanduser().exists() and Path(path).suffix.lower() not in HDF5_SUFFIXES):
        # a Minari id (`rlt/hopper-v5/medium-v0`) is no path: it is looked up in the data root, so
        # "pass the absolute path" (the hint below) missed the usual fix, the run's data root
        root = data_root(ds.get("root"))
        where = "" if root.is_absolute() else f", relative to the current folder {Path.cwd()}"
        return (f" (the run's dataset.path={path} is read as a Minari id from the data root {root}{where}, then "
                f"from Minari's root: name the data root that holds it, e.g. --resume RUN dataset.root=/abs/data/root "
                f"(or dataset.path=/abs/path of a dataset folder), or resume from the folder the run was started "
                f"in; the data are checked against the checkpoint)")
    rel = [f"dataset.{k}={ds.get(k)}" for k in ("path", "root")
           if isinstance(ds.get(k), str) and not Path(ds.get(k)).expanduser().is_absolute()
           and not Path(ds.get(k)).expanduser().exists()]
    if not rel:
        return ""
    return (f" (the run's {' and '.join(rel)} is relative and is read from the current folder {Path.cwd()}: resume "
            f"from the folder the run was started in, or pass the absolute path, e.g. --resume RUN "
            f"{rel[0].split('=')[0]}=/abs/path; the data are checked against the checkpoint)")


def _resume_device_spec(run_dir: str | os.PathLike, overrides: tuple[str, ...] | list[str]) -> str:
    """The ``device`` a resumed run will use (a ``device=`` override, else its config.yaml's), to
    pick the process-group backend before the checkpoint is read."""
    for o in reversed(list(overrides)):
        if o.startswith("device="):
            return o.split("=", 1)[1]
    try:
        saved = OmegaConf.load(Path(run_dir) / CONFIG_FILE)
        return str(saved.get("device", "auto"))
    except (OSError, ValueError):
        return "auto"


__all__ = [
    "ConfigError", "GracefulInterrupt", "Interrupted", "MetricWindow", "NonFiniteLossError", "RunDirError",
    "TrainResult", "Trainer", "check_agent", "check_config_file", "check_world_size", "holds_run", "load_resume_config",
    "new_run_problem", "resume", "resume_command", "train",
]
