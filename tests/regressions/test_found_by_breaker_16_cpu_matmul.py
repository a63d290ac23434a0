"""Regressions found by breaker 16 in ``cpu_matmul: onednn`` (rl_tformers/runtime/cpu_matmul.py).

``auto`` resolves to oneDNN on non-Intel x86 hosts, so these were the default behaviour there.
Each test compares a switched layer (:class:`OneDNNLinear`) with the same ``nn.Linear`` left on
PyTorch's default (MKL):

1. Second-order gradients were silently wrong: the backward's products ran in oneDNN's operator,
   which has no autograd formula, so under ``create_graph=True`` (double backward, Hessians,
   gradient penalties) they counted as constants (Hessian off by 1.2, only a "may lead to
   silently incorrect behavior" warning). A differentiated backward now uses ``mm``.
2. An in-place op on the output (``y = lin(x); y += 1``, ``F.relu(lin(x), inplace=True)``)
   raised "Output 0 of _OneDNNLinearFunction is a view and is being modified inplace": the
   autograd function returned a view of its result. It now returns the (M, N) result and the
   reshape happens outside it.
3. A non-contiguous bias (a strided or expanded ``nn.Parameter``) gave wrong outputs (1.8 off):
   oneDNN reads the bias as if packed. It is made contiguous first.
4. ``nn.Linear(K, 0)`` (no output features) crashed in backward (``reshape`` of 0 elements into
   [-1, 0]); a weight without elements now takes ``F.linear``.
5. ``FeedForward``'s fused ReLU (``fc1.forward_relu``) bypassed ``fc1.__call__``: forward
   pre-hooks, forward hooks and backward hooks registered on the first layer never ran, and
   ``FlopCounterMode``'s per-module counts lost ``ffn.fc1``. A layer with hooks is now called
   (unfused), its hooks seeing the pre-activation output as with MKL.
6. ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``) raised "In order to use an
   autograd.Function with functorch transforms ... it must override the setup_context
   staticmethod"; under a transform the layer now takes ``F.linear``.
7. Registering the FLOP formula a second time (``importlib.reload`` of the module, an
   autoreloading notebook) raised "duplicate registrations for mkldnn._linear_pointwise": the
   guard looked for the ``default`` overload in a registry keyed by the overload packet.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from rl_tformers.blocks.base import FeedForward
from rl_tformers.runtime import cpu_matmul as cm

pytestmark = pytest.mark.skipif(not cm.onednn_linear_available(), reason="this PyTorch build has no oneDNN linear op")


def _pair(k: int = 5, n: int = 6, bias: bool = True, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    """(the MKL reference, a copy switched to oneDNN) with the same weights."""
    torch.manual_seed(seed)
    ref = nn.Linear(k, n, bias=bias)
    lin = copy.deepcopy(ref)
    assert cm.apply_cpu_matmul(lin, "onednn") == 1 and type(lin) is cm.OneDNNLinear
    return ref, lin


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_(True)


# -- 1. second-order gradients --------------------------------------------------------------------

def test_1_hessian_and_double_backward_equal_mkl_s() -> None:
    ref, lin = _pair()
    v = torch.randn(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "an autograd kernel was not registered ... silently incorrect"
        h = torch.autograd.functional.hessian(lambda x: lin(x).pow(2).sum(), v)
    h_ref = torch.autograd.functional.hessian(lambda x: ref(x).pow(2).sum(), v)
    torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_ref, 2 * ref.weight.t() @ ref.weight, rtol=1e-5, atol=1e-5)  # d2/dx2 |W x + b|^2
    # a gradient penalty: |dL/dx|^2 differentiated w.r.t. the input and the parameters, plain and fused ReLU
    for fused in (False, True):
        grads = []
        for m in (ref, lin):
            m.zero_grad()
            x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
            y = (F.relu(m(x)) if m is ref else lin.forward_relu(x)) if fused else m(x)
            (gx,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
            gx.pow(2).sum().backward()
            grads.append((x.grad, m.weight.grad, m.bias.grad))
        assert grads[0][0].abs().sum() > 0
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


# -- 2. in-place ops on the output ----------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 5), (5,)])
def test_2_in_place_ops_on_the_output_work_as_on_f_linear_s(shape) -> None:
    ref, lin = _pair()
    x = torch.randn(*shape)
    out = []
    for m in (ref, lin):
        xx = _leaf(x)
        y = m(xx)
        y.mul_(3.0)
        y.add_(1.0)
        F.relu(y, inplace=True)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        out.append((y.detach(), xx.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # the fused ReLU saves its output for backward, as F.relu does: modifying it is refused alike
    for y in (F.relu(ref(_leaf(x))), lin.forward_relu(_leaf(x))):
        y.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


# -- 3. a non-contiguous bias ---------------------------------------------------------------------

@pytest.mark.parametrize("make_bias", [lambda: torch.randn(12)[::2], lambda: torch.randn(1).expand(6)],
                         ids=["strided", "expanded"])
def test_3_a_non_contiguous_bias_gives_f_linear_s_output_and_gradient(make_bias) -> None:
    ref, lin = _pair()
    b = make_bias()
    assert not b.is_contiguous()
    ref.bias, lin.bias = nn.Parameter(b.clone()), nn.Parameter(b)
    x = torch.randn(4, 5)
    y, y_ref = lin(x), ref(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lin.forward_relu(x), F.relu(y_ref), rtol=1e-5, atol=1e-6)
    y.pow(2).sum().backward()
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


# -- 4. no output features ------------------------------------------------------------------------

def test_4_a_layer_without_output_features_trains_as_nn_linear() -> None:
    ref, lin = _pair(3, 0)
    for m in (ref, lin):
        x = torch.randn(4, 3, requires_grad=True)
        y = m(x)
        assert y.shape == (4, 0)
        y.sum().backward()
        assert torch.equal(x.grad, torch.zeros(4, 3)) and m.bias.grad.shape == (0,)


# -- 5. hooks on the feed-forward network's first layer ---------------------------------------------

def _hooked_ffn(library: str, calls: list) -> FeedForward:
    torch.manual_seed(5)
    ffn = FeedForward(6, 9, "relu", 0.0)
    cm.apply_cpu_matmul(ffn, library)
    fc1 = ffn.fc1
    fc1.register_forward_pre_hook(lambda m, args: calls.append(("pre", tuple(args[0].shape))))
    fc1.register_forward_hook(lambda m, args, out: calls.append(("fwd", bool((out < 0).any()))))
    fc1.register_full_backward_hook(lambda m, gin, gout: calls.append(("bwd", tuple(gout[0].shape))))
    return ffn


def test_5_hooks_of_the_fused_relu_layer_run_and_see_the_pre_activation_output() -> None:
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(6))
    results = {}
    for library in ("mkl", "onednn"):
        calls: list = []
        ffn = _hooked_ffn(library, calls)
        xx = _leaf(x)
        y = ffn(xx)
        y.sum().backward()
        results[library] = (calls, y.detach(), xx.grad)
    assert results["mkl"][0] == [("pre", (2, 4, 6)), ("fwd", True), ("bwd", (2, 4, 9))]
    assert results["onednn"][0] == results["mkl"][0]
    for a, b in zip(results["mkl"][1:], results["onednn"][1:]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_5_flop_counter_s_per_module_counts_equal_mkl_s() -> None:
    counts = {}
    for library in ("mkl", "onednn"):
        torch.manual_seed(7)
        ffn = FeedForward(6, 9, "relu", 0.0)
        cm.apply_cpu_matmul(ffn, library)
        with FlopCounterMode(display=False) as fc:
            ffn(torch.randn(2, 4, 6, requires_grad=True)).sum().backward()
        counts[library] = {k: sum(v.values()) for k, v in fc.get_flop_counts().items()}
    # fc1 (6 -> 9) and fc2 (9 -> 6) on 8 rows: 2 M K N forward, twice that backward
    assert counts["mkl"]["FeedForward.fc1"] == 3 * 2 * 8 * 6 * 9
    assert counts["onednn"] == counts["mkl"]
    # without hooks (no FlopCounterMode) the feed-forward network still takes the fused product
    torch.manual_seed(7)
    ffn = FeedForward(6, 9, "relu", 0.0)
    cm.apply_cpu_matmul(ffn, "onednn")
    used = []
    original = cm._OneDNNLinearFunction.apply
    cm._OneDNNLinearFunction.apply = lambda *a, _o=original: used.append(a[3]) or _o(*a)
    try:
        ffn(torch.randn(2, 4, 6))
    finally:
        cm._OneDNNLinearFunction.apply = original
    assert used == [True, False]  # fc1 with the ReLU fused, fc2 plain


# -- 6. torch.func transforms ---------------------------------------------------------------------

def test_6_torch_func_transforms_give_mkl_s_results() -> None:
    ref, lin = _pair()
    x = torch.randn(3, 5)
    torch.testing.assert_close(torch.func.vmap(lin)(x), torch.func.vmap(ref)(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.func.grad(lambda v: lin(v).pow(2).sum())(x[0]),
                               torch.func.grad(lambda v: ref(v).pow(2).sum())(x[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.func.jacrev(lin)(x[0]), ref.weight, rtol=0, atol=0)
    # per-sample gradients, the torch.func recipe: vmap(grad(functional_call))
    params = {k: v.detach() for k, v in lin.named_parameters()}

    def loss(m, p, xi):
        return torch.func.functional_call(m, p, (xi,)).pow(2).sum()

    per = torch.func.vmap(torch.func.grad(lambda p, xi: loss(lin, p, xi)), in_dims=(None, 0))(params, x)
    per_ref = torch.func.vmap(torch.func.grad(lambda p, xi: loss(ref, p, xi)), in_dims=(None, 0))(params, x)
    assert per["weight"].shape == (3, 6, 5)
    for k in per:
        torch.testing.assert_close(per[k], per_ref[k], rtol=1e-5, atol=1e-5)


# -- 7. the FLOP formula registers once ------------------------------------------------------------

def test_7_registering_the_flop_formula_again_keeps_the_first_and_counts_alike() -> None:
    from torch.utils import flop_counter

    op = torch.ops.mkldnn._linear_pointwise
    before = flop_counter.flop_registry[op]
    cm._register_flop_formula()  # what importlib.reload(rl_tformers.runtime.cpu_matmul) runs
    assert flop_counter.flop_registry[op] is before
    ref, lin = _pair(8, 3)
    totals = []
    for m in (ref, lin):
        with FlopCounterMode(display=False) as fc:
            m(torch.randn(2, 7, 8, requires_grad=True)).sum().backward()
        totals.append(fc.get_total_flops())
    assert totals == [3 * 2 * 14 * 8 * 3] * 2  # forward + both backward products, 2 M K N each
