"""Multi-process data-parallel training on PyTorch's own engine: ``torch.distributed`` +
:class:`~torch.nn.parallel.DistributedDataParallel` (DDP), processes started by ``torchrun``.

Launch (both are the same thing; ``--nproc`` only spawns the second line)::

    rl-tformers train --nproc 2 -c dt/hopper_medium
    torchrun --standalone --nproc-per-node 2 -m rl_tformers.cli train -c dt/hopper_medium --run-dir runs/x

What each part does:

- **Process group**: :func:`process_group` joins the group ``torchrun`` describes through the
  environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``):
  ``gloo`` on CPU, ``nccl`` on CUDA (one GPU per process, ``cuda:LOCAL_RANK``). Without those
  variables (``WORLD_SIZE`` unset or 1) everything here is a no-op and training is the plain
  single-process loop.
- **Batches**: ``train.batch_size`` is the *global* batch. Every rank reads the same
  step-indexed batch ``s`` (a pure function of ``(seed, s)``) and keeps rows
  ``[r B / W, (r + 1) B / W)`` (:func:`shard_batch`): the W shards are disjoint, cover the global
  batch exactly, and need no communication. Sampling costs W times more CPU than strictly needed,
  which the data benchmark shows is negligible (samplers run >100x faster than training).
  An agent whose batches are already its own rank's (``local_batches``: on-policy PPO, each
  rank collecting its own rollout) is fed unchanged, and its ``train.batch_size`` need not
  divide by W.
- **Gradients**: the agent's ``loss(batch)`` runs inside :class:`AgentLoss`, an ``nn.Module``
  whose only submodule is ``agent.model``, wrapped in DDP; DDP's autograd hooks all-reduce
  (average) the gradients bucket by bucket during ``backward``. Agents need no change. With a
  loss that is a mean over equal-sized shards, the averaged gradient equals the single-process
  gradient of the global batch (up to float summation order). A loss that is a mean over a
  data-dependent number of terms per shard (DT's mean over unpadded steps) would instead give
  the mean of the shards' means; such a loss divides by :func:`shard_mean_total` (the global
  count / W under DDP, one small all-reduce inside the forward; the local count otherwise), so
  the averaged gradient is again that of the global batch. The DT loss and GTrXL's offline
  losses (BC, rcbc, IQL) do; PPO normalises advantages over the global minibatch.
- **Writes**: checkpoints, ``config.yaml``, TensorBoard and ``metrics.jsonl`` come from rank 0
  only; logged scalars are reduced over ranks first, key by key
  (:meth:`~rl_tformers.runtime.trainer.MetricWindow.reduce`): a scalar only some ranks log
  is the mean over the updates that logged it.
- **Randomness**: rank r > 0 reseeds its global generators with ``derive_seed(seed, "rank", r)``
  (different dropout masks on different shards); a checkpoint stores every rank's generator
  state and partial logging window, so ``--resume`` with the same process count continues each
  rank exactly, logged numbers included.
- **Stopping**: a SIGINT/SIGTERM during a rank's start-up stops it at once (nothing is trained
  or written yet); the ranks then agree that training starts before rank 0 writes to the run
  directory, and from there agree every update on whether a signal arrived anywhere, so all of
  them stop (and save) after the same update (see
  :class:`~rl_tformers.runtime.trainer.GracefulInterrupt`). Rank 0 says so, except under
  ``rl-tformers train --nproc``, whose launcher reports the stop once, from the run directory,
  after every rank has exited (``LAUNCHER_ENV`` tells the ranks).
- **Failures**: rank 0 alone evaluates and then broadcasts whether its evaluation failed; if it
  did, every rank joins the save of that step and the ranks > 0 raise :class:`PeerFailure`. A
  rank whose collective lost its peer (:func:`peer_failed`) prints one line instead of gloo's
  traceback and waits for torchrun to end it (:func:`wait_for_teardown`), so that torchrun
  names the rank that failed first.
- **Launching**: ``rl-tformers train --nproc N`` checks the config, the batch split, the GPU
  count (:func:`gpu_count_problem`) and the run directory before it starts torchrun
  (:mod:`rl_tformers.runtime.torchrun`, which exits with the ranks' status instead of
  torchrun's tracebacks); under torchrun a bad input is reported by rank 0 alone.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from rl_tformers.runtime.device import batch_size_of

#: Seconds a collective waits for the slowest rank (rank 0 may be evaluating or saving).
DEFAULT_TIMEOUT_S = 3600
TIMEOUT_ENV = "RL_TFORMERS_DIST_TIMEOUT_S"
#: Set (to its pid) by ``rl-tformers train --nproc`` for the processes it starts: the launcher
#: reports a stop by SIGINT/SIGTERM itself, so the ranks do not.
LAUNCHER_ENV = "RL_TFORMERS_LAUNCHER_PID"


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job (from torchrun's environment variables).

    Attributes:
        rank: global rank, 0..world_size-1 (``RANK``).
        local_rank: rank on this machine, the CUDA device index (``LOCAL_RANK``).
        world_size: number of processes W (``WORLD_SIZE``).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def dist_info() -> DistInfo:
    """The :class:`DistInfo` of this process (rank 0 of 1 outside torchrun)."""
    return DistInfo(_env_int("RANK", 0), _env_int("LOCAL_RANK", 0), max(1, _env_int("WORLD_SIZE", 1)))


def is_active() -> bool:
    """True inside an initialised process group with more than one process."""

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def backend_for(device_spec: str | torch.device) -> str:
    """``nccl`` for CUDA devices (``auto`` on a machine with CUDA), ``gloo`` otherwise."""
    spec = str(device_spec).strip().lower()
    if spec.startswith("cuda") or (spec == "auto" and torch.cuda.is_available()):
        return "nccl"
    return "gloo"


def rank_device(device: torch.device, info: DistInfo | None = None) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` for CUDA runs under torchrun, else ``device``.

    Raises:
        ValueError: more local ranks than CUDA devices.
    """
    info = info or dist_info()
    if device.type != "cuda" or not info.distributed:
        return device
    n = torch.cuda.device_count()
    if info.local_rank >= n:
        raise ValueError(f"local rank {info.local_rank} has no GPU: this machine has {n}; use --nproc <= {n}")
    dev = torch.device("cuda", info.local_rank)
    torch.cuda.set_device(dev)
    return dev


@contextlib.contextmanager
def process_group(device_spec: str | torch.device = "auto") -> Iterator[DistInfo]:
    """Join torchrun's process group for the duration of the block (no-op without torchrun).

    Args:
        device_spec: the run's ``device`` (chooses the backend: :func:`backend_for`).

    Yields:
        :class:`DistInfo`. A group that already exists (a caller set it up) is used as is and
        left alone at exit.
    """

    info = dist_info()
    if not info.distributed or not dist.is_available() or dist.is_initialized():
        yield info
        return
    backend = backend_for(device_spec)
    if backend == "nccl":
        rank_device(torch.device("cuda"), info)
    timeout = datetime.timedelta(seconds=_env_int(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    dist.init_process_group(backend=backend, timeout=timeout)
    ok = False
    try:
        yield info
        ok = True
    finally:
        if ok:
            # every rank finishes its outstanding collectives before any rank leaves the group
            dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: Any = 0) -> NoReturn:
    """End this torchrun rank now with ``code`` (SystemExit's convention: None is 0, an int is
    itself, anything else is printed to stderr and gives 1), after flushing the logging
    handlers, stdout and stderr, without the interpreter's shutdown.

    Why: a process that built a :class:`~torch.nn.parallel.DistributedDataParallel` on a gloo
    group keeps that group alive after :func:`torch.distributed.destroy_process_group`, even once
    the DDP module is garbage-collected (torch 2.13: its worker threads ``pt_gloo_runloop`` and
    ``gloo_tcp_loop`` are still listed in ``/proc/self/task``; a group that only ran collectives
    is torn down), so those threads still run when the interpreter shuts down. A thread of them that wakes then (the peer rank closing its
    connections) meets a finalising interpreter or destroyed C++ statics, and the process aborts
    with "terminate called without an active exception" (SIGABRT) after the run was saved and
    reported. ``os._exit`` ends the process without that shutdown. Everything a rank writes is
    written and closed before the command returns (checkpoints, ``metrics.jsonl``,
    TensorBoard), and DataLoader workers are shut down with the training loop.
    """

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        print(code, file=sys.stderr)
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


# -- batches -------------------------------------------------------------------------------------

def _leading(batch: Any) -> int | None:

    return batch_size_of(batch)


def shard_batch(batch: Any, rank: int, world_size: int, global_batch: int | None = None) -> Any:
    """Rows ``[rank * B / W, (rank + 1) * B / W)`` of every tensor/array whose leading size is B.

    Args:
        batch: tensors / NumPy arrays inside dicts, lists and tuples (NamedTuples keep their
            type); other leaves and arrays of another leading size are returned unchanged.
        rank, world_size: r and W.
        global_batch: B; default: the leading size of the first tensor found.

    Raises:
        ValueError: B is not divisible by W (names ``train.batch_size``).
    """
    b = global_batch if global_batch is not None else _leading(batch)
    if b is None or world_size == 1:
        return batch
    if b % world_size:
        raise ValueError(
            f"train.batch_size={b} is not divisible by the {world_size} processes; the global batch is "
            f"split evenly across ranks, so pick a multiple of {world_size}"
        )
    lo, hi = rank * (b // world_size), (rank + 1) * (b // world_size)

    def cut(x: Any) -> Any:
        if isinstance(x, (Tensor, np.ndarray)):
            return x[lo:hi] if x.ndim > 0 and x.shape[0] == b else x
        if isinstance(x, Mapping):
            out = {k: cut(v) for k, v in x.items()}
            return type(x)(out) if isinstance(x, dict) else out
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(cut(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(cut(v) for v in x)
        return x

    return cut(batch)


class ShardedBatches(Dataset):
    """A step-indexed dataset whose item ``s`` is this rank's shard of ``source[s]`` (:func:`shard_batch`)."""

    def __init__(self, source: Dataset, rank: int, world_size: int) -> None:
        self.source, self.rank, self.world_size = source, rank, world_size

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getitem__(self, step: int) -> Any:
        return shard_batch(self.source[step], self.rank, self.world_size)


def shard_source(source: Dataset | Iterable[Any], rank: int, world_size: int) -> Dataset | Iterable[Any]:
    """Wrap an agent's ``batches(start)`` result so that it yields this rank's shards."""
    if world_size == 1:
        return source
    if isinstance(source, Dataset):
        return ShardedBatches(source, rank, world_size)
    return (shard_batch(b, rank, world_size) for b in source)


# -- the model -----------------------------------------------------------------------------------

_IN_DDP_LOSS = False  # True while AgentLoss.forward runs (every rank runs it, in step)


class AgentLoss(nn.Module):
    """``forward(batch) = agent.loss(batch)`` as a module owning ``agent.model``, so that
    :class:`~torch.nn.parallel.DistributedDataParallel` can wrap any agent unchanged.

    While it runs, :func:`shard_mean_total` reduces counts over the ranks.
    """

    def __init__(self, agent: Any) -> None:
        super().__init__()
        self.model = agent.model
        self.agent = agent

    def forward(self, batch: Any) -> Any:
        global _IN_DDP_LOSS
        previous, _IN_DDP_LOSS = _IN_DDP_LOSS, is_active()
        try:
            return self.agent.loss(batch)
        finally:
            _IN_DDP_LOSS = previous


def shard_mean_total(count: Tensor) -> Tensor | None:
    """The divisor that turns this shard's sum into its share of the global-batch mean.

    A loss ``sum_i x_i / n`` over the ``n`` terms of this rank's shard (``n`` data-dependent,
    e.g. unpadded steps) is, after DDP averages the gradients of the W ranks, the mean of the
    ranks' means, not the mean over the global batch. Dividing the shard's sum by ``N / W``
    instead, N the count over every rank, makes the average ``sum over all terms / N``: the
    single-process loss of the global batch.

    Args:
        count: this shard's number of terms (a 0-dim tensor on the training device).

    Returns:
        ``max(N, 1) / W`` (float32, one all-reduce of ``count``) inside a DDP training
        forward (:class:`AgentLoss` under an active process group: every rank calls it the same
        number of times); None anywhere else (one process, evaluation, rank 0 alone), where the
        caller divides by its own count exactly as before.
    """
    if not _IN_DDP_LOSS:
        return None

    total = count.detach().to(torch.float64).reshape(1).clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total.clamp_min(1.0) / dist.get_world_size()).to(torch.float32).reshape(())


def wrap_ddp(agent: Any, device: torch.device, find_unused_parameters: bool = False) -> nn.Module:
    """``DistributedDataParallel(AgentLoss(agent))`` on ``device`` (parameters broadcast from rank 0).

    ``find_unused_parameters`` (``train.ddp_find_unused``): needed when some parameters get no
    gradient in some updates (adaptive depth, heads unused by the loss); costs one graph
    traversal per update. A script of your own that calls this ends each rank with
    :func:`exit_rank` (as ``rl-tformers train --nproc`` does): its gloo group outlives
    ``destroy_process_group`` and can abort the interpreter's shutdown.
    """

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(AgentLoss(agent), device_ids=ids, output_device=ids[0] if ids else None,
                                   find_unused_parameters=find_unused_parameters)


# -- a failure elsewhere ------------------------------------------------------------------------

class PeerFailure(RuntimeError):
    """Raised on the ranks > 0 when rank 0 failed in a step every rank takes part in (its
    evaluation, say): rank 0 reports the error, this rank only stops."""


#: What gloo says when a collective loses its peer (the other process exited or was killed).
PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
#: Seconds a rank whose peer failed waits for torchrun to end it, so that torchrun names the
#: rank that failed first (its failure is recorded before this one's) rather than this one.
PEER_FAILURE_WAIT_S = 30.0


def peer_failed(exc: BaseException) -> bool:
    """True when ``exc`` only says that another process of the run failed: a
    :class:`PeerFailure`, or a collective that lost its peer (gloo's ``Connection closed by
    peer`` / ``Connection reset by peer``), anywhere in its cause chain."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PeerFailure):
            return True
        if isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_LOST_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def wait_for_teardown(seconds: float = PEER_FAILURE_WAIT_S) -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), wait up to ``seconds`` for torchrun to end
    this process (it does once it sees another rank's failure); elsewhere return at once.

    A rank that only learnt of another rank's failure would otherwise exit as soon as the rank
    that failed did, and torchrun, which records failures to the second, could name this one as
    the first failure (``rank 0 exited with status 1`` for a crash of rank 1).
    """

    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    deadline = time.monotonic() + max(0.0, seconds)
    with contextlib.suppress(KeyboardInterrupt):
        while time.monotonic() < deadline:
            time.sleep(0.1)


# -- small collectives ---------------------------------------------------------------------------

def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest of every rank's ``value`` (one all-reduce of one integer).

    Raises:
        RuntimeError: the collective failed (e.g. another rank has exited: gloo's "Connection
            closed by peer").
    """

    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (identity outside a process group)."""
    if not is_active():
        return obj

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` outside a process group)."""
    if not is_active():
        return [obj]

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if is_active():
        dist.barrier()


# -- launching -----------------------------------------------------------------------------------

def gpu_count_problem(device_spec: str | torch.device, nproc: int) -> str | None:
    """Why ``nproc`` processes cannot train on ``device_spec`` here (None if they can).

    A CUDA run (``device=cuda``, ``cuda:N``, or ``auto`` on a machine with CUDA: the ``nccl``
    backend) puts rank r on ``cuda:LOCAL_RANK``, one GPU per process: more processes than GPUs
    would start them all, then fail in the ranks without a GPU (:func:`rank_device`) with a
    traceback. ``rl-tformers train --nproc`` checks this before it starts any process.
    """
    if nproc <= 1 or backend_for(device_spec) != "nccl":
        return None
    n = torch.cuda.device_count()
    if nproc <= n:
        return None
    return (f"--nproc {nproc}: device={str(device_spec)!r} runs one process per GPU (rank r on cuda:r) and this "
            f"machine has {n} CUDA device(s); use --nproc <= {n}, or device=cpu (gloo) for more processes")


def torchrun_command(nproc: int, train_args: Sequence[str]) -> list[str]:
    """The command ``rl-tformers train --nproc N ...`` runs: torchrun (``torch.distributed.run``
    of this interpreter, through :mod:`rl_tformers.runtime.torchrun`, which turns torchrun's
    tracebacks into plain exit statuses) starting N copies of ``rl_tformers.cli train ARGS``
    on this machine.

    Raises:
        ValueError: ``nproc < 1``.
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return [sys.executable, "-m", "rl_tformers.runtime.torchrun", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "rl_tformers.cli", "train", *train_args]


__all__ = [
    "LAUNCHER_ENV", "AgentLoss", "DistInfo", "PeerFailure", "ShardedBatches", "backend_for", "barrier",
    "broadcast_object", "dist_info", "exit_rank", "gather_objects", "gpu_count_problem", "is_active",
    "max_over_ranks",
    "peer_failed", "process_group",
    "rank_device", "shard_batch", "shard_mean_total", "shard_source", "torchrun_command", "wait_for_teardown", "wrap_ddp",
]
