"""Reusable checkers of the contract suite (importable by any test).

From a test under ``tests/contracts/``: ``from contract_checks import ...``; from elsewhere, run
pytest from the repository root (``python -m pytest``, as ``make test`` does) and use
``from tests.contracts.contract_checks import ...``.

- :class:`PeakNumel` / :func:`peak_numel`: largest tensor produced by any ATen op while a
  function runs (a ``TorchDispatchMode``), to prove a kernel never materialises an L x L matrix.
- :func:`assert_subquadratic`: :func:`peak_numel` at two lengths, absolute and growth bounds.
- :func:`assert_causal`: perturbing the future leaves the past unchanged, and the autograd
  Jacobian from every output t to inputs after t is exactly zero.
- :func:`assert_padding_invariant`: garbage in padded slots changes no valid output.
- :func:`assert_finite_grads`: every parameter gets a finite gradient (with allowed exceptions).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode


class PeakNumel(TorchDispatchMode):
    """Records the largest output (in elements) of any ATen op run inside the ``with`` block.

    Attributes after exit: ``peak`` (int) and ``op`` (name of the op that produced it).
    Views count too (a view of an L x L buffer means the buffer exists). Fused kernels count
    only their outputs, which is what "never materialises L x L" means at the PyTorch level.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            n = t.numel()
            if n > self.peak:
                self.peak, self.op = n, str(func)
        return out


def _tensors(obj) -> Iterable[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)


def peak_numel(fn: Callable[[], object]) -> tuple[int, str]:
    """Run ``fn()`` and return (largest op output in elements, op name)."""
    with PeakNumel() as mode:
        fn()
    return mode.peak, mode.op


def assert_subquadratic(run_at: Callable[[int], object], lengths: tuple[int, int] = (2048, 4096), growth: float = 3.2) -> None:
    """Assert ``run_at(L)`` never produces a tensor of L*L elements and grows sub-quadratically.

    Args:
        run_at: runs the computation at sequence length L (batch 1 is best).
        lengths: (L1, L2) with L2 = 2 L1.
        growth: largest allowed peak(L2) / peak(L1); quadratic growth gives 4, L log L ~2.2,
            L^1.5 ~2.8.
    """
    l1, l2 = lengths
    p1, op1 = peak_numel(lambda: run_at(l1))
    p2, op2 = peak_numel(lambda: run_at(l2))
    assert p2 < l2 * l2, f"largest tensor at L={l2} has {p2} >= L*L = {l2 * l2} elements (op {op2})"
    assert p2 <= growth * p1, (
        f"peak tensor size grows {p2 / p1:.2f}x from L={l1} ({p1}, {op1}) to L={l2} ({p2}, {op2}); "
        f"allowed {growth}x (quadratic is 4x)"
    )


def assert_causal(
    fn: Callable[[Tensor], Tensor], x: Tensor, atol: float = 1e-6, seed: int = 0, steps: Iterable[int] | None = None
) -> None:
    """Causality of a sequence map fn: (B, T, D) -> (B, T, D').

    1. For each checked t, replacing x[:, t+1:] by other values leaves fn(x)[:, :t+1] unchanged
       (within ``atol``; the functions are re-seeded so random kernels are comparable).
    2. The autograd Jacobian from output t to inputs after t is exactly zero.

    ``steps``: the t to check (default: every t < T - 1; a subset only for expensive callers,
    since a leak from token j to output i is caught only by a checked t with i <= t < j).
    """
    t_len = x.shape[1]
    if steps is None:
        steps = range(t_len - 1)
    steps = sorted(t for t in set(steps) if 0 <= t < t_len - 1)
    torch.manual_seed(seed)
    base = fn(x).detach()
    for t in steps:
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randn_like(x2[:, t + 1 :]) * 3
        torch.manual_seed(seed)
        out = fn(x2).detach()
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=atol, rtol=0, msg=lambda m, t=t: f"future tokens after {t} changed the past: {m}")
    xg = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = fn(xg)
    r = torch.randn_like(y)
    for t in steps:
        (g,) = torch.autograd.grad((y[:, t] * r[:, t]).sum(), xg, retain_graph=True)
        future = g[:, t + 1 :]
        assert torch.count_nonzero(future) == 0, (
            f"output {t} has a nonzero gradient to future inputs (max |dy/dx| = {future.abs().max().item():.3g})"
        )
        assert torch.isfinite(g).all(), f"non-finite gradient from output {t}"


def assert_padding_invariant(fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, mask: Tensor, atol: float = 1e-6, seed: int = 0) -> None:
    """Random values in padded slots (mask False) change no valid output of fn(x, mask)."""
    torch.manual_seed(seed)
    a = fn(x, mask).detach()
    x2 = x.clone()
    pad = ~mask
    x2[pad] = torch.randn_like(x2[pad]) * 100
    torch.manual_seed(seed)
    b = fn(x2, mask).detach()
    torch.testing.assert_close(b[mask], a[mask], atol=atol, rtol=0, msg=lambda m: f"padded slots changed valid outputs: {m}")
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "non-finite outputs (padded rows included)"


def assert_finite_grads(module: nn.Module, allow_none: Iterable[str] = ()) -> None:
    """After a backward pass: every trainable parameter has a finite gradient.

    ``allow_none``: fnmatch patterns of parameter names that may legitimately get no gradient
    (the kind declares them as ``contract_no_grad``); a matching parameter that does get one
    must still be finite.
    """
    patterns = tuple(allow_none)
    missing = []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            if not any(fnmatch.fnmatch(name, pat) for pat in patterns):
                missing.append(name)
            continue
        assert torch.isfinite(p.grad).all(), f"parameter {name} has a non-finite gradient"
    assert not missing, f"parameters without a gradient: {missing} (declare contract_no_grad patterns if intended)"
