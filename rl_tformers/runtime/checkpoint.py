"""Checkpoints that never lose a run: atomic, verified, safe to load, pruned to the last N.

Layout: ``RUN_DIR/checkpoints/step_000001000.pt`` (9-digit step, so names sort by step). There
is no ``latest`` pointer file to keep in sync: the latest checkpoint is found by scanning names
and taking the highest step that loads and verifies (a pointer could itself be stale or point
at a damaged file).

A checkpoint is a plain ``torch.save`` dict (``torch.load(path, weights_only=True)`` opens it
anywhere) holding only tensors, numbers, strings, ``None``, lists, tuples and dicts:

=============  ==================================================================
``format``     ``"rl-tformers-checkpoint"``; ``version``: :data:`FORMAT_VERSION`
``step``       optimiser updates completed; the next batch drawn is batch ``step``
               (batches are a pure function of (seed, step): this *is* the sampler
               position)
``model``      ``model.state_dict()`` (CPU tensors)
``optimizer``  ``optimizer.state_dict()``
``scheduler``  update counters of the lr scheduler
``rng``        :func:`rl_tformers.runtime.seeding.capture_rng_state`
``extra``      the agent's ``extra_state()`` (obs statistics, reward scale...)
``trainer``    trainer bookkeeping (partial logging window, elapsed time)
``config``     the resolved config (as ``config.yaml``), as YAML text
``sha256``     digest of everything above (see :func:`content_digest`)
=============  ==================================================================

Safety and integrity:

- Writes go to a temporary file in the same directory, are flushed and fsynced, then renamed
  over the final name with ``os.replace`` (atomic on POSIX and Windows): a crash leaves either
  the old state or the new checkpoint, never a half-written file under a checkpoint name.
- Loading uses ``torch.load(weights_only=True)``: unpickling can build tensors and plain
  containers only, never call arbitrary code. The SHA-256 below is a checksum against damage,
  not a signature: anyone can write a checkpoint whose digest matches, so nothing in a
  checkpoint is trusted as code. Bytes an agent stores for its own use (the pickled
  environments of a PPO run that only unpickling restores) are unpickled only inside
  :func:`allow_unpickling`, which ``--resume --unsafe-unpickle-envs`` enters.
- A truncated file fails to open (the zip directory sits at its end). A flipped byte inside
  tensor data would load silently, so every checkpoint carries a SHA-256 over its decoded
  content, recomputed and compared on load.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import struct
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

FORMAT = "rl-tformers-checkpoint"
#: The checkpoint format this build writes and reads. A checkpoint of any other version (those of
#: the pre-release builds of 0.1.0 hold 1) is refused with :class:`CheckpointFormatError`: its
#: config and state may lack keys this build needs, and no conversion is attempted.
FORMAT_VERSION = 2
CHECKPOINT_DIR = "checkpoints"
_NAME = re.compile(r"^step_(\d{9,})\.pt$")
_REQUIRED = ("format", "version", "step", "model", "optimizer", "scheduler", "rng", "extra", "trainer", "config")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (unreadable, truncated, corrupt, or not ours); names the file."""


class CheckpointFormatError(CheckpointError):
    """A checkpoint of another format version than :data:`FORMAT_VERSION`: a run saved by
    another build. One line naming the file, its version and the one this build reads."""


def format_version_message(path: str | os.PathLike, version: Any) -> str:
    """The one-line refusal of a checkpoint of format ``version`` (``None``: none recorded)."""
    has = "no format version" if version is None else f"format version {version}"
    return (f"{path}: checkpoint {has}; this build of rl-tformers reads format version {FORMAT_VERSION} only "
            f"(the run was saved by another build; train it again with this one)")


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint at ``step``: ``step_000000100.pt``."""
    return f"step_{step:09d}.pt"


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every checkpoint file in ``RUN_DIR/checkpoints``, newest (highest step) first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return sorted(found, key=lambda sp: sp[0], reverse=True)


# -- integrity -------------------------------------------------------------------------------------

def _tensor_bytes(t: torch.Tensor) -> bytes:
    """The elements of a dense CPU tensor in row-major order, as raw bytes, whatever its strides.

    Empty tensors give ``b""``; non-contiguous ones (a transpose, an ``expand``) and tensors
    with stride 0 or other odd strides (``torch.from_numpy`` of an empty NumPy array has stride
    0; a size-1 dimension may carry any stride and still count as contiguous) are copied to a
    fresh row-major tensor first, so equal values always give equal bytes.
    """
    if t.numel() == 0:
        return b""
    flat = t.contiguous().reshape(-1)
    if flat.stride(0) != 1:  # e.g. shape (1,) with stride 0: "contiguous", yet not viewable as bytes
        flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
    return flat.view(torch.uint8).numpy().tobytes()


def _feed(h: Any, obj: Any, path: str) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.layout != torch.strided:
            raise TypeError(f"checkpoint value at {path}: only dense tensors are supported, got {t.layout}")
        t = t.cpu()
        h.update(b"T" + str(t.dtype).encode() + repr(tuple(t.shape)).encode())
        h.update(_tensor_bytes(t))
    elif isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        h.update(b"D" + struct.pack("<q", len(items)))
        for k, v in items:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"checkpoint key at {path}: keys must be str or int, got {k!r}")
            h.update(b"K" + type(k).__name__.encode() + repr(k).encode())
            _feed(h, v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        h.update((b"L" if isinstance(obj, list) else b"U") + struct.pack("<q", len(obj)))
        for i, v in enumerate(obj):
            _feed(h, v, f"{path}[{i}]")
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        h.update(b"S" + type(obj).__name__.encode() + b":" + repr(obj).encode() + b";")
    elif isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        h.update(b"O" + type(obj).__name__.encode() + repr(obj).encode())
    else:
        raise TypeError(
            f"checkpoint value at {path} has type {type(obj).__name__}; checkpoints hold only tensors, "
            f"numbers, strings, None, lists, tuples and dicts (convert NumPy arrays with torch.as_tensor)"
        )


def content_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 (hex) over a checkpoint dict's decoded content, ignoring its ``sha256`` key.

    Canonical over containers (dict keys sorted), exact for floats (``repr`` round-trips) and
    tensors (dtype, shape and raw bytes in row-major order, independent of the strides: empty
    and non-contiguous tensors hash like their contiguous copies). Raises TypeError naming the dotted path of a value that
    ``torch.load(weights_only=True)`` could not load back.
    """
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "sha256"}, "checkpoint")
    return h.hexdigest()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        moved = {k: _to_cpu(v) for k, v in obj.items()}
        return type(obj)(moved) if isinstance(obj, dict) else moved
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


# -- save / load -----------------------------------------------------------------------------------

def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Create or replace ``path`` atomically.

    ``write(f)`` fills a temporary file in the same directory, which is flushed, fsynced and
    renamed over ``path`` with ``os.replace``; readers see the old file or the complete new one.
    If ``write`` raises, the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def save_checkpoint(run_dir: str | os.PathLike, state: Mapping[str, Any], keep_last: int | None = None) -> Path:
    """Write ``state`` as ``RUN_DIR/checkpoints/step_<step>.pt`` atomically, then prune.

    Args:
        run_dir: the run directory.
        state: dict with at least the keys of the module docstring table except ``format``,
            ``version`` and ``sha256``, which are added here. Tensors are copied to CPU.
        keep_last: keep this many newest checkpoints (by step) and delete older ones;
            ``None`` or 0 keeps all.

    Returns:
        The path written.

    Raises:
        TypeError: a value that cannot be loaded with ``weights_only=True`` (the message names
            its dotted path), raised before anything is written.
        OSError: the disk refused the write; an older checkpoint is untouched.
    """
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    payload = _to_cpu({**state, "format": FORMAT, "version": FORMAT_VERSION})
    payload.pop("sha256", None)
    payload["sha256"] = content_digest(payload)
    step = int(payload["step"])
    path = d / checkpoint_name(step)
    atomic_write(path, lambda f: torch.save(payload, f))
    if keep_last:
        prune_checkpoints(run_dir, keep_last)
    return path


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints; returns the deleted paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    removed = []
    for _, p in list_checkpoints(run_dir)[keep_last:]:
        p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def remove_stale_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete temporary files left by a save that was killed (``.<name>.tmp-<pid>``)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    stale = [p for p in d.iterdir() if p.name.startswith(".") and ".tmp-" in p.name]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _head(path: Path) -> bytes:
    """The first 4 bytes of a file (a zip archive, as torch.save writes, starts with ``PK\\x03\\x04``)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4)
    except OSError:
        return b""


_UNPICKLING: ContextVar[bool] = ContextVar("rl_tformers_unpickling", default=False)


@contextmanager
def allow_unpickling(allowed: bool = True) -> Iterator[None]:
    """Let agents unpickle bytes they stored in a checkpoint, inside this block (when ``allowed``).

    Unpickling runs whatever code the bytes name: enter it only for runs you made or trust
    (``rl-tformers train --resume RUN --unsafe-unpickle-envs``). Outside it,
    :func:`unpickling_allowed` is False and agents restore their state from plain data only.
    """
    token = _UNPICKLING.set(bool(allowed))
    try:
        yield
    finally:
        _UNPICKLING.reset(token)


def unpickling_allowed() -> bool:
    """Whether the caller is inside :func:`allow_unpickling` (False by default)."""
    return _UNPICKLING.get()


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load and verify one checkpoint on CPU.

    Raises:
        CheckpointError: naming ``path``, if the file cannot be opened (missing, truncated, not a
            torch file, or holding objects other than tensors and plain containers), lacks a
            field, was written by another program, or its content does not match its SHA-256.
        CheckpointFormatError: the checkpoint's format version is not :data:`FORMAT_VERSION`
            (:func:`format_version_message`).
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: cannot be loaded safely (not a torch file, or it holds objects other than tensors and "
            f"plain containers, which weights_only loading refuses)"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - every failure mode here means "unusable file"
        if path.is_file() and _head(path) != b"PK\x03\x04":  # no zip archive at all: e.g. config.yaml as --checkpoint
            raise CheckpointError(f"{path}: not an rl-tformers checkpoint (those are the zip archives torch.save "
                                  f"writes, RUN_DIR/{CHECKPOINT_DIR}/step_*.pt)") from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: cannot be loaded ({type(exc).__name__}: {first})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an rl-tformers checkpoint")
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointFormatError(format_version_message(path, state.get("version")))
    missing = [k for k in (*_REQUIRED, "sha256") if k not in state]
    if missing:
        raise CheckpointError(f"{path}: missing field(s) {', '.join(missing)}")
    try:
        digest = content_digest(state)
    except TypeError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if digest != state["sha256"]:
        raise CheckpointError(f"{path}: content does not match its SHA-256 (the file is corrupt)")
    return state


@dataclass
class FoundCheckpoint:
    """Result of :func:`find_latest_valid`.

    Attributes:
        path: the checkpoint used.
        state: its verified content.
        skipped: newer checkpoints that failed to load, with the reason (already warned).
    """

    path: Path
    state: dict[str, Any]
    skipped: list[tuple[Path, str]]


def find_latest_valid(run_dir: str | os.PathLike, quarantine: bool = False) -> FoundCheckpoint:
    """The newest checkpoint of ``run_dir`` that loads and verifies.

    Every newer file that fails is named in a ``UserWarning`` and, with ``quarantine`` (what
    ``--resume`` does), renamed to ``<name>.corrupt`` so it is kept for inspection but never
    tried, counted or pruned again. Without it (the default: reading another run) nothing is
    changed on disk.

    A checkpoint of another format version is not skipped: the run was saved by another build,
    so its other checkpoints are of that format too, and renaming them would damage the run.

    Raises:
        CheckpointError: if ``RUN_DIR/checkpoints`` holds no checkpoint, or none is valid (the
            message lists each file with its reason).
        CheckpointFormatError: the newest checkpoint that opens has another format version.
    """
    found = list_checkpoints(run_dir)
    if not found:
        run_dir = Path(run_dir)
        if run_dir.name == CHECKPOINT_DIR and list_checkpoints(run_dir.parent):
            raise CheckpointError(f"{run_dir} is the checkpoint folder of the run {run_dir.parent}; pass the run "
                                  f"directory {run_dir.parent}")
        raise CheckpointError(f"no checkpoint in {checkpoint_dir(run_dir)} (expected files named step_<9 digits>.pt)")
    skipped: list[tuple[Path, str]] = []
    for _, path in found:
        try:
            state = load_checkpoint(path)
        except CheckpointFormatError:
            raise
        except CheckpointError as exc:
            reason = str(exc)
            skipped.append((path, reason))
            msg = f"skipping unusable checkpoint {reason}"
            if quarantine:
                bad = path.with_name(path.name + ".corrupt")
                os.replace(path, bad)
                msg += f" (moved to {bad.name})"
            warnings.warn(msg, UserWarning, stacklevel=2)
            continue
        return FoundCheckpoint(path=path, state=state, skipped=skipped)
    listing = "\n".join(f"  {r}" for _, r in skipped)  # each reason starts with its file's path
    raise CheckpointError(f"no valid checkpoint in {checkpoint_dir(run_dir)}:\n{listing}")
