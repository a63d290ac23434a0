"""Which library runs the float32 matrix products of ``nn.Linear`` layers on the CPU.

PyTorch's CPU build sends a float32 ``nn.Linear`` (``aten::addmm``/``mm``) to MKL's SGEMM. MKL
picks its fastest code paths only on Intel CPUs: on an AMD EPYC (AVX-512) host of this
project's machine type, MKL's 1-thread SGEMM reached 96 GFLOP/s at n = 2048 where oneDNN, the
other GEMM library inside the same PyTorch build (``torch.ops.mkldnn._linear_pointwise``, which
dispatches by instruction set, not by vendor), reached 210; on the DT's own shapes (3840 x 128
x 512 and the like) oneDNN took 0.44-0.69x of MKL's time for the forward product and both
backward ones (``rl-tformers bench gemm``, ``rl-tformers bench train`` and docs/performance.md).

``cpu_matmul`` (a top-level run option) picks the library:

- ``mkl``: PyTorch's default (``F.linear``), nothing changes;
- ``onednn``: every ``nn.Linear`` of the model computes its float32 CPU forward and both
  backward products (``dL/dx = g W``, ``dL/dW = g^T x``, ``dL/db = sum g``) with oneDNN
  (:class:`OneDNNLinear`); the same function up to float rounding (another summation order,
  relative differences of about 1e-7);
- ``auto``: ``onednn`` on x86 CPUs that are not Intel's (where MKL is known to fall back to
  slower code), when this PyTorch build has the oneDNN op; else ``mkl``.

The choice applies only to float32 inputs on the CPU outside autocast, ``torch.compile`` and
``torch.func`` transforms: a CUDA/MPS tensor, a float64 model, bf16 autocast (which PyTorch
already sends to oneDNN), a compiled model (whose compiler picks the kernels) and ``vmap`` /
``grad`` / ``jacrev`` run ``F.linear`` unchanged; a backward that is itself differentiated
(``create_graph=True``) computes its products with ``mm``. The resolved library is written into the run's config (``cpu_matmul: onednn``),
so a resume computes with the library the run was trained with. What it cannot do: batched
matrix products (attention's ``bmm``) keep PyTorch's own kernels, and ``torch.ops.mkldnn.
_linear_pointwise`` is an internal PyTorch operator (the one inductor's CPU backend emits), so a
build without it falls back to ``mkl`` (``auto``) or is refused by name (``onednn``).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules import module as torch_module
from torch.utils import flop_counter
from torch.utils.flop_counter import register_flop_formula

CPU_MATMUL = ("auto", "mkl", "onednn")


@functools.lru_cache(maxsize=1)
def onednn_linear_available() -> bool:
    """True when this PyTorch build has oneDNN and its fused linear operator (CPU)."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:  # the operator exists but a build may lack its CPU kernel
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return bool(torch.equal(op(x, w, None, "none", [], ""), torch.full((2, 4), 3.0)))
    except (RuntimeError, NotImplementedError):
        return False


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The CPU vendor string (``GenuineIntel``, ``AuthenticAMD``...; ``""`` when unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def resolve_cpu_matmul(spec: str) -> str:
    """``mkl`` or ``onednn`` for a ``cpu_matmul`` option (see the module docstring).

    Raises:
        ValueError: naming ``cpu_matmul`` for an unknown value, or for ``onednn`` on a PyTorch
            build without oneDNN's linear operator.
    """
    spec = str(spec).strip().lower()
    if spec not in CPU_MATMUL:
        raise ValueError(f"cpu_matmul={spec!r}; use one of {', '.join(CPU_MATMUL)}")
    if spec == "auto":
        x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
        vendor = cpu_vendor()
        return "onednn" if x86 and vendor and vendor != "GenuineIntel" and onednn_linear_available() else "mkl"
    if spec == "onednn" and not onednn_linear_available():
        raise ValueError("cpu_matmul=onednn, but this PyTorch build has no oneDNN linear operator "
                         "(torch.ops.mkldnn._linear_pointwise); use cpu_matmul=mkl or auto")
    return spec


def _register_flop_formula() -> None:
    """Count oneDNN's linear in ``torch.utils.flop_counter`` (2 M K N, as ``aten.mm``), so FLOP
    counts and MFU (``rl-tformers bench train``) see the same work under either library.
    Idempotent: a second call (``importlib.reload`` of this module, an autoreloading notebook)
    keeps the registered formula instead of raising ``duplicate registrations``."""
    if not onednn_linear_available():
        return
    op = torch.ops.mkldnn._linear_pointwise
    registry = getattr(flop_counter, "flop_registry", {})
    if op in registry or op.default in registry:  # keyed by the packet: a reload registers nothing
        return

    @register_flop_formula(op)  # the default overload (x, w, b, ...); the binary one is not used here
    def _linear_flop(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
        m = 1
        for d in x_shape[:-1]:
            m *= d
        return 2 * m * x_shape[-1] * w_shape[0]


def _lin(x: Tensor, w: Tensor, b: Tensor | None, post: str = "none") -> Tensor:
    """oneDNN's ``post(x w^T + b)`` for a 2-D ``x`` (M, K) and ``w`` (N, K); returns (M, N);
    ``post``: ``none`` or ``relu`` (a post-op in the same kernel)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, post, [], "")


def weight_grad(g2: Tensor, x2: Tensor) -> Tensor:
    """oneDNN's weight gradient ``g^T x`` (N, K) of ``g2`` (M, N) and ``x2`` (M, K).

    oneDNN's operator reads both operands with the summed axis M contiguous, so each is
    transposed into a copy; the operand with fewer rows goes first (for N > K it computes
    ``(x^T g)^T``): on the DT's shapes that order was 1.2-1.3x faster per product and +6.5% per
    update (same-process A/B, AMD EPYC host; ``rl-tformers bench gemm`` times it).
    """
    n, k = g2.shape[1], x2.shape[1]
    if n > k:
        return _lin(x2.t(), g2.t(), None).t().contiguous()  # (K, N) -> (N, K)
    return _lin(g2.t(), x2.t(), None)  # (N, K)


class _OneDNNLinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` (``relu=True``: ``y = max(x W^T + b, 0)``, the ReLU fused into the
    product's kernel) with its three products in oneDNN, for a contiguous 2-D ``x`` (M, K),
    ``weight`` (N, K) and a contiguous ``bias`` (N,) or None; returns ``y`` (M, N), not a view
    (the caller reshapes it outside, so an in-place op on the output works as on ``F.linear``'s).

    A backward that is itself differentiated (``create_graph=True``: double backward, Hessians,
    gradient penalties) computes its products with PyTorch's differentiable ``mm`` instead:
    oneDNN's operator has no autograd formula, and its products would silently count as
    constants in the second-order gradient.
    """

    @staticmethod
    def forward(ctx, x2: Tensor, weight: Tensor, bias: Tensor | None, relu: bool = False) -> Tensor:
        y = _lin(x2, weight, bias, "relu" if relu else "none")  # (M, N)
        ctx.save_for_backward(x2, weight, y if relu else None)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x2, weight, y = ctx.saved_tensors
        g2 = grad if grad.is_contiguous() else grad.contiguous()  # (M, N)
        if y is not None:  # through the fused ReLU: zero where the output was clamped
            g2 = torch.ops.aten.threshold_backward(g2, y, 0)
        differentiable = torch.is_grad_enabled()  # create_graph=True: this backward is differentiated
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:  # g W: (M, K)
            gx = g2 @ weight if differentiable else _lin(g2, weight.t().contiguous(), None)
        if ctx.needs_input_grad[1]:  # g^T x: (N, K)
            gw = g2.t() @ x2 if differentiable else weight_grad(g2, x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0)  # (N,)
        return gx, gw, gb, None


def _hooked(module: nn.Module) -> bool:
    """True when calling ``module`` runs hooks (its own or global ones: forward pre-hooks,
    forward hooks, backward hooks; ``FlopCounterMode``'s module tracker is one)."""
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, n, None) or getattr(torch_module, "_global" + n, None) for n in names)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose float32 CPU products run in oneDNN (module docstring).

    Same parameters, state-dict keys and function as ``nn.Linear``: x (..., in_features) ->
    (..., out_features), gradients of any order, in-place ops on the output. Anything else than
    a float32 CPU input and weight outside autocast (CUDA, MPS, float64, bf16 autocast, an input
    or a weight without elements) calls ``F.linear``, and so does a forward that
    ``torch.compile`` traces (``train.compile=true``: the compiler picks its own kernels;
    inductor cannot lower this operator inside a training graph) or that runs under a
    ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``...: the custom autograd function
    has no functorch rules).
    """

    def _onednn(self, x: Tensor) -> bool:
        w = self.weight
        return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
                and w.device.type == "cpu" and x.numel() > 0 and w.numel() > 0
                and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
                and not torch._C._are_functorch_transforms_active())

    def _linear(self, x: Tensor, relu: bool) -> Tensor:
        """oneDNN's product on ``x`` (..., K) -> (..., N) (``relu``: with the ReLU fused)."""
        x2 = x.reshape(-1, x.shape[-1])  # (M, K), M = every leading axis
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        b = self.bias
        if b is not None and not b.is_contiguous():  # oneDNN reads a strided bias as if packed
            b = b.contiguous()
        y = _OneDNNLinearFunction.apply(x2, self.weight, b, relu)  # (M, N)
        return y.view(*x.shape[:-1], y.shape[-1])  # (..., N)

    def forward(self, x: Tensor) -> Tensor:
        if self._onednn(x):
            return self._linear(x, False)
        return F.linear(x, self.weight, self.bias)

    def forward_relu(self, x: Tensor) -> Tensor:
        """``relu(self(x))`` with the ReLU inside oneDNN's product (one pass over the output
        less; the feed-forward network's first layer, :class:`rl_tformers.blocks.base.FeedForward`).
        A module with hooks is called (``relu(self(x))``, unfused), so its hooks see the
        pre-activation output as with ``nn.Linear``."""
        if _hooked(self):
            return F.relu(self(x))
        if self._onednn(x):
            return self._linear(x, True)
        return F.relu(F.linear(x, self.weight, self.bias))


def apply_cpu_matmul(model: nn.Module, library: str) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to ``library`` in place; returns how many.

    ``onednn`` turns each module whose class is exactly ``nn.Linear`` into
    :class:`OneDNNLinear` (parameters, hooks and state-dict keys unchanged); ``mkl`` turns
    :class:`OneDNNLinear` modules back. Subclasses of ``nn.Linear`` (e.g. quantised or
    non-dynamic-quantisable variants) are left as they are.

    Raises:
        ValueError: for a library other than ``mkl`` / ``onednn`` (resolve ``auto`` first).
    """
    if library not in ("mkl", "onednn"):
        raise ValueError(f"apply_cpu_matmul: library must be mkl or onednn (resolve auto first), got {library!r}")
    src, dst = (nn.Linear, OneDNNLinear) if library == "onednn" else (OneDNNLinear, nn.Linear)
    n = 0
    for m in model.modules():
        if type(m) is src:
            m.__class__ = dst
            n += 1
    return n


_register_flop_formula()
