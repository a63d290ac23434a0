"""Device selection, mixed precision and moving batches to the device."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

AMP_MODES = ("none", "bf16")


def mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(spec: str = "auto") -> torch.device:
    """Turn a config/CLI device string into a :class:`torch.device`.

    Args:
        spec: ``auto`` (CUDA if available, else MPS, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or
            ``mps``.

    Raises:
        ValueError: for an unknown spec or a device this machine does not have (the message
            says which devices are available).
    """
    spec = str(spec).strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError as exc:
        raise ValueError(f"device={spec!r} is not a device; use auto, cpu, cuda, cuda:N or mps") from exc
    have = ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (["mps"] if mps_available() else [])
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={spec!r} but CUDA is not available here; available: {', '.join(have)}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={spec!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps":
        if not mps_available():
            raise ValueError(f"device={spec!r} but MPS is not available here; available: {', '.join(have)}")
    elif dev.type != "cpu":
        raise ValueError(f"device={spec!r} is not supported; use auto, cpu, cuda, cuda:N or mps")
    return dev


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """Autocast context for the forward pass and loss.

    Args:
        device: the training device.
        amp: ``none`` (full precision, a no-op context) or ``bf16`` (bfloat16 autocast; weights,
            gradients and optimiser state stay float32, so no loss scaling is needed).

    Raises:
        ValueError: for another ``amp`` value.
    """
    if amp not in AMP_MODES:
        raise ValueError(f"train.amp={amp!r}; use one of {', '.join(AMP_MODES)}")
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def move_to(batch: Any, device: torch.device) -> Any:
    """Move a batch to ``device``: tensors and NumPy arrays anywhere inside dicts/lists/tuples.

    NumPy arrays become tensors (``torch.from_numpy``, dtype kept); other leaves are returned
    as they are. Tuples that are NamedTuples keep their type. Copies from pinned memory are
    non-blocking.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=batch.is_pinned())
    if isinstance(batch, np.ndarray):
        return torch.from_numpy(batch).to(device)
    if isinstance(batch, Mapping):
        moved = {k: move_to(v, device) for k, v in batch.items()}
        return type(batch)(moved) if isinstance(batch, dict) else moved
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(move_to(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int | None:
    """Leading dimension of the first tensor/array found in ``batch`` (samples per step), or None."""
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return int(batch.shape[0]) if batch.ndim > 0 else None
    if isinstance(batch, Mapping):
        values = batch.values()
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return None
    for v in values:
        n = batch_size_of(v)
        if n is not None:
            return n
    return None
