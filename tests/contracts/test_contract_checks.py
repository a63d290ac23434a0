"""The checkers themselves: each one must fail on a component that breaks its contract."""

from __future__ import annotations

import pytest
import torch
from contract_checks import (
    PeakNumel,
    assert_causal,
    assert_finite_grads,
    assert_padding_invariant,
    assert_subquadratic,
    peak_numel,
)
from contract_variants import D, padding_mask

from rl_tformers.attention.base import attention_sdpa


def test_peak_numel_sees_a_dense_score_matrix():
    n = 256
    q = torch.randn(1, 2, n, 8)
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    peak, op = peak_numel(lambda: torch.matmul(q, q.transpose(-1, -2)))
    assert peak == 2 * n * n and "mm" in op
    with PeakNumel() as mode:
        attention_sdpa(q, q, q, allowed, scale=0.5)
    assert mode.peak >= n * n  # the (1, 1, T, S) mask at least


def test_assert_subquadratic_rejects_dense_and_accepts_linear():
    def dense(n):
        x = torch.randn(1, n, 4)
        return torch.softmax(x @ x.transpose(-1, -2), -1) @ x

    def linear(n):
        x = torch.randn(1, n, 4)
        return torch.cumsum(x, 1) * 2

    with pytest.raises(AssertionError, match="L\\*L|grows"):
        assert_subquadratic(dense, lengths=(128, 256))
    assert_subquadratic(linear, lengths=(128, 256))


def test_assert_causal_catches_a_leak_to_the_future():
    x = torch.randn(2, 6, D)
    assert_causal(lambda v: torch.cumsum(v, 1), x)  # causal: passes
    with pytest.raises(AssertionError):
        assert_causal(lambda v: v + v[:, -1:], x)  # every output reads the last token


def test_assert_causal_catches_a_gradient_only_leak():
    """Forward values unchanged but a nonzero Jacobian to the future (e.g. 0 * future)."""
    x = torch.randn(2, 6, D)

    def sneaky(v):
        return v + 1e-30 * v.flip(1)  # value change below float resolution, gradient is not zero

    with pytest.raises(AssertionError, match="nonzero gradient"):
        assert_causal(sneaky, x)


def test_assert_padding_invariant_catches_attention_to_padding():
    x = torch.randn(2, 12, D)
    mask = padding_mask()
    assert_padding_invariant(lambda v, m: v * 2, x, mask)
    with pytest.raises(AssertionError):
        assert_padding_invariant(lambda v, m: v + v.mean(1, keepdim=True), x, mask)


def test_assert_finite_grads_reports_missing_and_nonfinite():
    lin, unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    mod = torch.nn.ModuleDict({"lin": lin, "unused": unused})
    lin(torch.randn(3, 2)).sum().backward()
    with pytest.raises(AssertionError, match="unused.weight"):
        assert_finite_grads(mod)
    assert_finite_grads(mod, allow_none=("unused.*",))
    lin.weight.grad[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_finite_grads(mod, allow_none=("unused.*",))
