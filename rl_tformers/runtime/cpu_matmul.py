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
- ``auto``: whichever of the two is faster on this host, measured (:func:`choose_cpu_matmul`):
  the three products of each of the run's ``nn.Linear`` shapes (:func:`linear_shapes`) with
  both libraries, round-robin, at the process's thread count; oneDNN only when its GFLOP/s
  exceed MKL's by more than :data:`AUTO_MARGIN` (5%), else PyTorch's default, MKL. The
  measurement (about a second; up to 2 on a loaded host) is cached per CPU model, thread count, torch version and shapes
  in ``cpu_matmul.json`` of the cache folder (:func:`rl_tformers.runtime.host.cache_dir`). No
  vendor name enters the choice: on one AMD EPYC host oneDNN ran the DT's products at twice
  MKL's rate; on another (Zen 4) its peak was 106-110 GFLOP/s against MKL's 93-99, and a run
  with it 2-3% faster at 1 thread but 9% slower at 2.

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

import contextlib
import functools
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules import module as torch_module
from torch.utils import flop_counter
from torch.utils.flop_counter import register_flop_formula

from rl_tformers.runtime.host import cache_dir, cpu_identity
from rl_tformers.runtime.timing import interleaved_timing

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
    has no functorch rules). Without gradients (``torch.no_grad``, ``torch.inference_mode``:
    acting, evaluation) oneDNN's product is called directly, not through the autograd function
    (the same values; about 0.1 ms less per call).
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
        if torch.is_grad_enabled():
            y = _OneDNNLinearFunction.apply(x2, self.weight, b, relu)  # (M, N)
        else:  # no_grad / inference_mode (acting, evaluation): the product alone, without the
            y = _lin(x2, self.weight, b, "relu" if relu else "none")  # autograd Function's ~0.1 ms a call
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


# -- cpu_matmul: auto ------------------------------------------------------------------------------

#: oneDNN is chosen only when its GFLOP/s exceed MKL's by more than this fraction. Two runs of
#: the same products on one host gave rates 4-6% apart (``bench gemm`` on a Zen 4 host: oneDNN
#: 106-110, MKL 93-99 GFLOP/s; a loaded host drifts far more: docs/performance.md); a smaller
#: gap is noise, and PyTorch's default (MKL) is kept.
AUTO_MARGIN = 0.05
#: most float32 FLOPs of one library's products in one measurement round: a wider or larger
#: batch model is measured on fewer rows M (:func:`linear_shapes`), so the measurement stays
#: under about a second; the DT paper's 3840-row products (3.4 GFLOP) fit whole
MAX_ROUND_FLOPS = 3.5e9
#: rounds of the measurement: untimed warm-up rounds, then at most ``TIMED_ROUNDS`` timed ones
#: (each round calls every product of every shape with both libraries once, in a rotated order);
#: no round starts after :data:`MEASURE_BUDGET_S` seconds once ``MIN_TIMED_ROUNDS`` are timed
#: (a loaded host measures on fewer rounds, never on other products)
WARMUP_ROUNDS, MIN_TIMED_ROUNDS, TIMED_ROUNDS = 1, 3, 8
MEASURE_BUDGET_S = 1.0
#: the DT paper's products (64 windows x 60 tokens, width 128, feed-forward 512): ``auto``
#: without a run config (an old run's, ``bench train``'s)
DEFAULT_SHAPES = ((3840, 128, 512), (3840, 512, 128), (3840, 128, 128))
CACHE_FILE = "cpu_matmul.json"
CACHE_VERSION = 1
#: the largest cache file read (an entry is about 400 bytes): a larger one is ignored as corrupted
CACHE_MAX_BYTES = 4 << 20
PRODUCTS = ("forward", "grad_input", "grad_weight")


@dataclass(frozen=True)
class MatmulChoice:
    """What ``cpu_matmul: auto`` chose and why.

    Attributes:
        library: ``mkl`` or ``onednn``.
        gflops: measured float32 GFLOP/s of each library on ``shapes`` (``{"mkl": .., "onednn": ..}``;
            empty when nothing was measured: no oneDNN operator in this build).
        source: ``measured`` (in this process), ``cache`` (an earlier measurement of the same
            key) or ``no-onednn``.
        threads: torch intra-op threads of the measurement.
        shapes: ``(M, K, N)`` of each ``x (M x K) . W^T (N x K)`` product measured.
    """

    library: str
    gflops: dict[str, float]
    source: str
    threads: int
    shapes: tuple[tuple[int, int, int], ...]


def choose_library(mkl_gflops: float, onednn_gflops: float, margin: float = AUTO_MARGIN) -> str:
    """``onednn`` when ``onednn_gflops > (1 + margin) * mkl_gflops``, else ``mkl`` (a tie, a gap
    within ``margin`` and a non-finite or non-positive rate keep PyTorch's default)."""
    rates = (mkl_gflops, onednn_gflops)
    if not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in rates):
        return "mkl"
    return "onednn" if onednn_gflops > (1.0 + margin) * mkl_gflops else "mkl"


def linear_shapes(cfg: Any = None) -> tuple[tuple[int, int, int], ...]:
    """``(M, K, N)`` of the run's ``nn.Linear`` products: the feed-forward network's two layers
    and the attention projections, ``(M, D, F)``, ``(M, F, D)``, ``(M, D, D)`` (D =
    ``backbone.d_model``, F = ``backbone.d_ff`` or 4 D; equal pairs once), at M =
    ``train.batch_size`` x the tokens of one sample: 3 per step of ``agent.context_len`` (the
    DT's return, state and action tokens), else ``agent.seq_len``, else 60. M is capped so one
    library's products of a round stay within :data:`MAX_ROUND_FLOPS` (at least 1 row).
    ``cfg`` None: :data:`DEFAULT_SHAPES`. A pure function of the config."""
    if cfg is None:
        return DEFAULT_SHAPES
    backbone, agent = cfg.get("backbone") or {}, cfg.get("agent") or {}
    d = int(backbone.get("d_model") or 128)
    f = int(backbone.get("d_ff") or 4 * d)
    if agent.get("context_len"):
        tokens = 3 * int(agent.get("context_len"))
    elif agent.get("seq_len"):
        tokens = int(agent.get("seq_len"))
    else:
        tokens = 60
    kn = list(dict.fromkeys([(d, f), (f, d), (d, d)]))
    per_row = 2 * len(PRODUCTS) * sum(k * n for k, n in kn)  # FLOPs of one row through every product
    m = max(1, min(int(cfg.train.batch_size) * tokens, int(MAX_ROUND_FLOPS // per_row)))
    return tuple((m, k, n) for k, n in kn)


def product_fns(m: int, k: int, n: int) -> dict[tuple[str, str], Callable[[], Any]]:
    """The six timed callables of one ``x (M x K) . W^T (N x K)`` shape, ``(product, library) ->
    f()``: forward ``x W^T + b``, input gradient ``g W``, weight gradient ``g^T x``, with MKL
    (``F.linear``, ``mm``: PyTorch's default) and with oneDNN as :class:`OneDNNLinear` computes
    them (including the contiguous ``W^T`` copy and :func:`weight_grad`). Seeded inputs."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    grad = torch.randn(m, n, generator=g)
    return {
        ("forward", "mkl"): lambda: F.linear(x, w, b),
        ("forward", "onednn"): lambda: _lin(x, w, b),
        ("grad_input", "mkl"): lambda: grad @ w,
        ("grad_input", "onednn"): lambda: _lin(grad, w.t().contiguous(), None),
        ("grad_weight", "mkl"): lambda: grad.t() @ x,
        ("grad_weight", "onednn"): lambda: weight_grad(grad, x),
    }


def library_gflops(median_ms: Mapping[tuple[int, int, int, str, str], float]) -> dict[str, float]:
    """GFLOP/s of each library over every product: the FLOPs of all of them (2 M K N each) over
    the sum of their median milliseconds; ``median_ms`` is keyed ``(M, K, N, product, library)``."""
    flops: dict[str, float] = {}
    ms: dict[str, float] = {}
    for (m, k, n, _, lib), t in median_ms.items():
        flops[lib] = flops.get(lib, 0.0) + 2.0 * m * k * n
        ms[lib] = ms.get(lib, 0.0) + t
    return {lib: flops[lib] / (ms[lib] * 1e-3) / 1e9 for lib in sorted(flops)}


def measure_gflops(shapes: Sequence[tuple[int, int, int]], rounds: int = TIMED_ROUNDS,
                   warmup: int = WARMUP_ROUNDS) -> dict[str, float]:
    """Float32 GFLOP/s of MKL and oneDNN on ``shapes`` at the current thread count: every
    product of :func:`product_fns` of every shape, timed round-robin (``warmup`` rounds, then
    ``rounds`` or, once :data:`MEASURE_BUDGET_S` has passed, at least :data:`MIN_TIMED_ROUNDS`:
    :func:`~rl_tformers.runtime.timing.interleaved_timing`), then :func:`library_gflops` of the
    medians. Which products run depends on ``shapes`` only.

    Raises:
        RuntimeError: this PyTorch build has no oneDNN linear operator.
    """
    if not onednn_linear_available():
        raise RuntimeError("this PyTorch build has no oneDNN linear operator (torch.ops.mkldnn._linear_pointwise)")
    fns = {(m, k, n, p, lib): fn for m, k, n in shapes for (p, lib), fn in product_fns(m, k, n).items()}
    timing = interleaved_timing(fns, repeats=rounds, warmup=warmup, budget_s=MEASURE_BUDGET_S,
                                min_repeats=min(MIN_TIMED_ROUNDS, rounds))
    return library_gflops({key: t["median_ms"] for key, t in timing.items()})


def cache_key(shapes: Sequence[tuple[int, int, int]], threads: int) -> str:
    """The cache entry of a measurement: CPU identity (vendor, family, model, model name, the
    ``avx512_bf16`` / ``amx`` flags, architecture), thread count, torch version and shapes."""
    c = cpu_identity()
    cpu = "/".join(str(c[f]) for f in ("machine", "vendor", "family", "model", "model_name"))
    flags = f"avx512_bf16={int(c['avx512_bf16'])},amx={int(c['amx'])}"
    dims = ",".join(f"{m}x{k}x{n}" for m, k, n in shapes)
    return f"{cpu}|{flags}|threads={threads}|torch={torch.__version__}|{dims}"


def cache_path() -> Path:
    """``cpu_matmul.json`` in rl-tformers' cache folder (``$RL_TFORMERS_CACHE_DIR`` relocates it)."""
    return cache_dir() / CACHE_FILE


def _valid_rates(entry: Any) -> bool:
    rates = entry.get("gflops") if isinstance(entry, dict) else None
    return isinstance(rates, dict) and all(
        isinstance(rates.get(lib), (int, float)) and not isinstance(rates.get(lib), bool)
        and math.isfinite(rates[lib]) and rates[lib] > 0 for lib in ("mkl", "onednn"))


def read_cache(path: Path) -> dict[str, Any]:
    """The entries of the cache file ``path`` (``{key: {"gflops": {...}, ...}}``; ``{}`` when it
    does not exist). A file that is not UTF-8 JSON of this layout, not a regular file (a link to a
    device or a pipe) or over :data:`CACHE_MAX_BYTES` is ignored with a warning (the caller
    measures again and rewrites it); it is parsed as JSON only, never run."""
    try:
        if not path.is_file():
            if path.exists():
                raise OSError("not a regular file")
            return {}
        with open(path, "rb") as fh:
            raw = fh.read(CACHE_MAX_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        warnings.warn(f"{path}: cannot read the cpu_matmul cache ({exc.strerror or exc}); measuring again", stacklevel=3)
        return {}
    if len(raw) > CACHE_MAX_BYTES:
        warnings.warn(f"{path}: corrupted cpu_matmul cache (over {CACHE_MAX_BYTES} bytes); ignored, measuring again",
                      stacklevel=3)
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; deep nesting recurses
        warnings.warn(f"{path}: corrupted cpu_matmul cache ({type(exc).__name__}: {str(exc)[:200]}); ignored, "
                      f"measuring again", stacklevel=3)
        return {}
    if not (isinstance(data, dict) and data.get("version") == CACHE_VERSION and isinstance(data.get("entries"), dict)):
        warnings.warn(f"{path}: corrupted cpu_matmul cache (not a version {CACHE_VERSION} cache); ignored, "
                      f"measuring again", stacklevel=3)
        return {}
    return data["entries"]


def _write_cache(path: Path, entries: Mapping[str, Any]) -> None:
    """Replace ``path`` atomically with ``entries``; a folder that cannot be written is a warning."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": dict(entries)}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # no temporary file, or none can exist (a file above the folder)
            tmp.unlink()
        warnings.warn(f"{path}: cannot write the cpu_matmul cache ({exc.strerror or exc}); "
                      f"the next run measures again", stacklevel=3)


@contextlib.contextmanager
def _cache_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``'s ``.lock`` sibling: processes resolving at the same time
    (the ranks of a DDP run, the runs of a sweep) measure one at a time and the later ones read
    the first one's entry. Without a writable folder or ``fcntl``, no lock."""
    try:
        import fcntl  # POSIX only
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path.with_name(path.name + ".lock"), "a")
    except (ImportError, OSError):
        yield
        return
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _load() -> float | None:
    """The 1-minute load average (None where the system has none): a cache entry measured on a
    busy host says so (delete the file to measure again on a quiet one)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


#: the choices ``auto`` resolved in this process, by :func:`cache_key`
_CHOSEN: dict[str, MatmulChoice] = {}


def choose_cpu_matmul(shapes: Sequence[tuple[int, int, int]] = DEFAULT_SHAPES, threads: int | None = None, *,
                      measure: Callable[[Sequence[tuple[int, int, int]]], Mapping[str, float]] | None = None,
                      path: Path | None = None) -> MatmulChoice:
    """``cpu_matmul: auto``'s choice for ``shapes`` at ``threads`` (default: the current torch
    thread count): the cached measurement of this :func:`cache_key` in ``path`` (default
    :func:`cache_path`), else ``measure(shapes)`` (default :func:`measure_gflops`, run at the
    current thread count) written to the cache; the library by :func:`choose_library`. A build
    without oneDNN's operator: ``mkl``, nothing measured."""
    threads = int(torch.get_num_threads() if threads is None else threads)
    shapes = tuple(tuple(int(v) for v in s) for s in shapes)
    if not onednn_linear_available():
        return MatmulChoice("mkl", {}, "no-onednn", threads, shapes)
    key, path = cache_key(shapes, threads), cache_path() if path is None else path
    with _cache_lock(path):
        entries = read_cache(path)
        entry = entries.get(key)
        if entry is not None and not _valid_rates(entry):
            warnings.warn(f"{path}: corrupted cpu_matmul cache entry for {key}; ignored, measuring again", stacklevel=2)
            entry = None
        if entry is not None:
            rates, source = {lib: float(entry["gflops"][lib]) for lib in ("mkl", "onednn")}, "cache"
        else:
            rates = {lib: float(v) for lib, v in (measure or measure_gflops)(shapes).items()}
            source = "measured"
            entries = {k: v for k, v in entries.items() if _valid_rates(v)}
            entries[key] = {"gflops": rates, "library": choose_library(rates["mkl"], rates["onednn"]),
                            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg_1": _load()}
            _write_cache(path, entries)
    choice = MatmulChoice(choose_library(rates["mkl"], rates["onednn"]), rates, source, threads, shapes)
    _CHOSEN[key] = choice
    return choice


def recorded_choice(cfg: Any = None) -> MatmulChoice | None:
    """The choice ``auto`` resolved in this process for ``cfg``'s shapes at the current thread
    count (:func:`linear_shapes`), or None when it resolved none."""
    return _CHOSEN.get(cache_key(linear_shapes(cfg), torch.get_num_threads()))


def resolve_cpu_matmul(spec: str, cfg: Any = None) -> str:
    """``mkl`` or ``onednn`` for a ``cpu_matmul`` option (see the module docstring); ``auto`` is
    measured on ``cfg``'s shapes (:func:`linear_shapes`; None: the DT paper's) by
    :func:`choose_cpu_matmul`.

    Raises:
        ValueError: naming ``cpu_matmul`` for an unknown value, or for ``onednn`` on a PyTorch
            build without oneDNN's linear operator.
    """
    spec = str(spec).strip().lower()
    if spec not in CPU_MATMUL:
        raise ValueError(f"cpu_matmul={spec!r}; use one of {', '.join(CPU_MATMUL)}")
    if spec == "auto":
        return choose_cpu_matmul(linear_shapes(cfg)).library
    if spec == "onednn" and not onednn_linear_available():
        raise ValueError("cpu_matmul=onednn, but this PyTorch build has no oneDNN linear operator "
                         "(torch.ops.mkldnn._linear_pointwise); use cpu_matmul=mkl or auto")
    return spec


_register_flop_formula()
