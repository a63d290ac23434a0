"""Dropout with cheap random numbers on the CPU (Srivastava et al. 2014; inverted dropout).

``F.dropout`` on the CPU draws one Bernoulli number per element from PyTorch's Mersenne
Twister, element by element (``bernoulli_``): about 5 ns per element, 14-20% of a
Decision Transformer update (docs/performance.md, "Where the time goes"). Here one 64-bit draw
of the same generator (``Tensor.random_`` over the full int64 range, which PyTorch fills 64
bits at a time) serves four elements: it is read as four 16-bit lanes, and an element is kept
when its lane is at least ``-32768 + m`` with ``m = round(p * 65536)``. So each element is
dropped independently with probability ``p' = m / 65536`` (``|p' - p| <= 2^-17``, 7.6e-6; the
function that rounds is :func:`quantised_p`) and kept ones are scaled by ``1 / (1 - p')``, which
keeps the expectation of every element unchanged. The draws come from the global CPU
generator, so ``torch.manual_seed`` and a checkpoint's saved RNG state reproduce them.

Other devices (CUDA's dropout draws Philox numbers inside one fused kernel), non-float inputs,
and a ``p`` that rounds to 0 or 1 at this resolution use ``F.dropout``; outside training the
input is returned as it is. Inside :func:`torch_draws` every call uses ``F.dropout`` (PyTorch's
own stream: ``rl-tformers bench train --torch-dropout-row`` times the two in one run).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_LANES = 4  # 16-bit lanes per 64-bit draw
_LEVELS = 1 << 16  # values of a lane
_torch_draws = False  # set inside torch_draws()


@contextmanager
def torch_draws() -> Iterator[None]:
    """Inside this block :func:`dropout` calls ``F.dropout`` on every device (one Bernoulli draw per
    element, PyTorch's stream). Process-wide, not thread-safe; for benchmarks and comparisons."""
    global _torch_draws
    before, _torch_draws = _torch_draws, True
    try:
        yield
    finally:
        _torch_draws = before


def _dropped_levels(p: float) -> int:
    """m = round(p * 65536): how many of a lane's 65536 values drop an element."""
    return round(p * _LEVELS)


def quantised_p(p: float) -> float:
    """The drop probability this module applies on the CPU for a requested ``p``: ``p`` rounded to
    a multiple of 2^-16 (``m / 65536``)."""
    return _dropped_levels(p) / _LEVELS


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device | str = "cpu") -> Tensor:
    """A bool mask of ``shape``, True (kept) with probability ``1 - quantised_p(p)`` per element,
    independently, from ``ceil(numel / 4)`` 64-bit draws of the device's default generator.

    Raises:
        ValueError: ``p`` outside (0, 1) after rounding to 2^-16 (nothing, or everything, dropped).
    """
    m = _dropped_levels(p)
    if not 0 < m < _LEVELS:
        raise ValueError(f"dropout p={p} rounds to {m}/65536: use F.dropout for p this close to 0 or 1")
    n = math.prod(int(size) for size in shape)
    words = torch.empty(-(-n // _LANES), dtype=torch.int64, device=device).random_(-(1 << 63), None)
    lanes = words.view(torch.int16)[:n].view(shape)  # uniform over [-32768, 32767]
    return lanes >= m - _LEVELS // 2


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """Inverted dropout of ``x`` (any shape): elements zeroed with probability p (2^-16 resolution on
    the CPU, see the module docstring), kept ones scaled by ``1 / (1 - p')``; ``x`` itself
    outside training or when ``p == 0``.

    Raises:
        ValueError: ``p`` outside [0, 1] (as ``F.dropout``).
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    m = _dropped_levels(p)
    if _torch_draws or x.device.type != "cpu" or not x.is_floating_point() or not 0 < m < _LEVELS:
        return F.dropout(x, p, training=True)
    keep = keep_mask(x.shape, p, x.device)
    return x.mul(keep).mul_(_LEVELS / (_LEVELS - m))


class Dropout(nn.Module):
    """``nn.Dropout`` with this module's CPU draws: (...) -> (...), the same shape.

    Args:
        p: drop probability in [0, 1).
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p = float(p)

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
