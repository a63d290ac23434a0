"""Device selection, autocast and batch moving."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import pytest
import torch

from rl_tformers.runtime.device import autocast, batch_size_of, move_to, resolve_device


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto").type in ("cpu", "mps")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("gpu0")


def test_autocast_bf16_on_cpu() -> None:
    a = torch.randn(4, 4)
    with autocast(torch.device("cpu"), "bf16"):
        assert (a @ a).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), "none"):
        assert (a @ a).dtype == torch.float32
    with pytest.raises(ValueError, match="train.amp"):
        autocast(torch.device("cpu"), "fp16")


def test_move_to_and_batch_size() -> None:
    P = namedtuple("P", "x y")
    batch = {"a": np.zeros((5, 2), np.float32), "b": [torch.ones(5)], "c": P(torch.ones(5, 1), "tag"), "n": 3}
    out = move_to(batch, torch.device("cpu"))
    assert isinstance(out["a"], torch.Tensor) and out["a"].dtype == torch.float32
    assert isinstance(out["c"], P) and out["c"].y == "tag" and out["n"] == 3
    assert batch_size_of(batch) == 5 and batch_size_of({"s": torch.tensor(1.0)}) is None
