"""Linformer attention (``linformer``; Wang et al. 2020, "Linformer: Self-Attention with Linear
Complexity", arXiv:2006.04768)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.dropout import dropout
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext, AttnOutput, to_acc

SHARING = ("none", "headwise", "kv", "layerwise")
PROJECTIONS = ("linear", "pool", "max_pool", "conv")


class LinformerAttention(AttentionModule):
    """Low-rank attention: keys and values projected along the sequence to k rows.

    Wang et al. 2020, sec. 4, eq. 7::

        head_i = softmax( Q W_i^Q (E_i K W_i^K)^T / sqrt(Dh) ) (F_i V W_i^V),   E_i, F_i in R^{k x n}

    so the score matrix is (T x k) instead of (T x S): O(S k Dh) time and memory.

    Projections (``projection``):

    * ``linear`` (the paper's): learned E, F (k x ``max_len``), initialised N(0, 1/k) (a
      Johnson-Lindenstrauss projection, their Theorem 1). Sequences shorter than ``max_len``
      use the first S columns (the same as zero-padding to ``max_len``, as the paper does);
      longer ones raise. **Needs a fixed maximum length.** Sharing (sec. 4, "parameter
      sharing"): ``none`` (E_i, F_i per head), ``headwise`` (one E, one F per layer), ``kv``
      (E = F, one per layer), ``layerwise`` (a single matrix for all layers, heads, keys and
      values; needs one k for all layers).
    * ``pool``: the paper's pooling alternative (sec. 4, "general projections: mean/max
      pooling"): mean of k contiguous segments of the valid keys and values, weighted by segment
      size (a log-count score term), so that with k = S it *is* dense attention; no
      parameters, any length.
    * ``max_pool``: the same segments, each projected key and value the elementwise maximum
      of its segment's valid keys and values (an empty segment takes no weight); with k = S it
      is dense attention; no parameters, any length.
    * ``conv`` (sec. 4, "convolution where the kernel and stride is set to n/k"): a learned
      convolution along the sequence, Dh -> Dh channels, kernel = stride = ceil(n / k) over the
      keys zero-padded to k ceil(n / k) rows: projected row r mixes keys r kw ... (r + 1) kw - 1.
      Sharing as ``linear`` (a convolution per head with ``none``). **Needs ``max_len``** as
      ``linear`` does (shorter sequences: the rows past S are zero keys and values).

    ``k`` may differ per layer (a tuple, one entry per layer: the paper uses smaller k higher
    up, sec. 4). Padded keys are zeroed before projection (``linear``, ``conv``) or excluded
    from the segment means and maxima (``pool``, ``max_pool``), so padding content never matters; a query whose row has no valid
    key returns zeros. Where the padding sits does matter with ``linear`` (column j of E and F
    multiplies key j): padding after the real keys leaves the result equal to the unpadded
    sequence's, padding before them moves the real keys to other columns and changes it (also
    for cross-attention over a left-padded encoder output), and with ``pool`` the segment
    boundaries follow the padded length; both are properties of a fixed-length projection.

    Cannot: causal attention (E mixes future keys into every projected key: declared
    ``causal=False``; the backbone refuses it causally and points at DT's last-action mode),
    several episodes in one row (the projection mixes them: raises), memory or incremental
    decoding, score-based positions, ``need_weights``.
    """

    #: the config section this module's options come from, named by its messages: ``attention``
    #: in a backbone; the encoder-decoder sets ``cross_attention`` / ``encoder.attention``
    option = "attention"

    def __init__(self, ctx, position, cfg: LinformerConfig) -> None:
        super().__init__(ctx, position)
        if position.needs_scores:
            raise IncompatibleConfig(
                f"backbone.position.kind={ctx.config.position.kind!r} needs (T, S) scores; "
                f"backbone.attention.kind='linformer' only forms (T, k) ones; use none, sinusoidal, learned or rotary"
            )
        self.cfg = cfg
        self.k = cfg.k_at(max(ctx.layer_idx, 0))
        self.kernel = -(-cfg.max_len // self.k)  # conv: kernel = stride = ceil(n / k)
        self.e_proj: nn.Parameter | None = None
        self.f_proj: nn.Parameter | None = None
        if cfg.projection in ("linear", "conv"):
            shape, std = self._param_shape()
            if cfg.sharing == "layerwise":
                store = ctx.shared  # one dict per backbone build: the same Parameter in every layer
                key = (f"linformer.{cfg.projection}", self.k, cfg.max_len)
                if key not in store:
                    store[key] = nn.Parameter(torch.randn(shape) * std)
                self.e_proj = store[key]
            else:
                self.e_proj = nn.Parameter(torch.randn(shape) * std)
                if cfg.sharing in ("none", "headwise"):
                    self.f_proj = nn.Parameter(torch.randn(shape) * std)

    def _param_shape(self) -> tuple[tuple[int, ...], float]:
        """(shape, initial std) of E / F: ``linear`` (H, k, n) or (k, n), N(0, 1/k); ``conv``
        weights (H, Dh, Dh, ceil(n / k)) or (Dh, Dh, ceil(n / k)), N(0, 1 / (Dh ceil(n / k)))
        (per head with ``sharing: none``)."""
        head = (self.n_heads,) if self.cfg.sharing == "none" else ()
        if self.cfg.projection == "linear":
            return (*head, self.k, self.cfg.max_len), self.k**-0.5
        return (*head, self.head_dim, self.head_dim, self.kernel), (self.head_dim * self.kernel) ** -0.5

    def _project_conv(self, x: Tensor, weight: Tensor) -> Tensor:
        """x (B, H, S, Dh) -> (B, H, k, Dh): a convolution along the sequence with kernel = stride
        = ceil(n / k) over x zero-padded to k ceil(n / k) rows (Wang et al. 2020, sec. 4,
        "general projections"); ``weight`` (Dh, Dh, kw) shared by the heads or (H, Dh, Dh, kw)."""
        b, h, s, dh = x.shape
        n = self.k * self.kernel
        xs = F.pad(x, (0, 0, 0, n - s)).transpose(-1, -2)  # (B, H, Dh, k kw)
        if weight.dim() == 3:
            y = F.conv1d(xs.reshape(b * h, dh, n), weight, stride=self.kernel)  # (B H, Dh, k)
        else:  # one convolution per head: grouped over the heads
            y = F.conv1d(xs.reshape(b, h * dh, n), weight.reshape(h * dh, dh, self.kernel), stride=self.kernel,
                         groups=h)  # (B, H Dh, k)
        return y.reshape(b, h, dh, self.k).transpose(-1, -2)  # (B, H, k, Dh)

    def _max_pool(self, x: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Max over the valid keys of k contiguous segments (the segments of ``pool``): x (B, H, S,
        Dh) -> (B, H, k, Dh) (0 for an empty segment) and (B, k) bool, the non-empty segments."""
        b, h, s, dh = x.shape
        kk = min(self.k, s)
        seg = torch.arange(s, device=x.device) * kk // s  # (S,) segment of each key
        low = torch.finfo(x.dtype).min
        src = x.masked_fill(~valid[:, None, :, None], low)  # padded keys never win a max
        init = torch.full((b, h, kk, dh), low, dtype=x.dtype, device=x.device)
        pooled = init.scatter_reduce(2, seg.view(1, 1, s, 1).expand(b, h, s, dh), src, reduce="amax")
        live = torch.zeros(b, kk, device=x.device).index_add_(1, seg, valid.float()) > 0  # (B, k)
        return torch.where(live[:, None, :, None], pooled, torch.zeros_like(pooled)), live

    def _project_linear(self, x: Tensor, mat: Tensor) -> Tensor:
        """x (B, H, S, Dh) -> (B, H, k, Dh) with E[:, :S] (per head or shared)."""
        s = x.shape[2]
        e = mat[..., :s]  # (H, k, S) or (k, S)
        if e.dim() == 3:
            return torch.einsum("hks,bhsd->bhkd", e, x)
        return torch.einsum("ks,bhsd->bhkd", e, x)

    def _segments(self, s: int, valid: Tensor) -> tuple[Tensor, Tensor]:
        """Pooling matrix (B, k, S) of segment means over valid keys, and log segment sizes (B, k)."""
        kk = min(self.k, s)
        seg = torch.arange(s, device=valid.device) * kk // s  # (S,) segment of each key
        onehot = F.one_hot(seg, kk).T.float()[None] * valid[:, None, :].float()  # (B, k, S)
        size = onehot.sum(-1)  # (B, k)
        return onehot / size.clamp_min(1)[..., None], torch.log(size)  # log 0 = -inf: empty segment

    def _projected(self, k: Tensor, v: Tensor, valid: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Keys and values k, v (B, H, S, Dh) projected to (B, H, k, Dh) each, and a score bias
        (B, 1, 1, k) (log segment sizes for ``pool``, the most negative float for an empty
        ``max_pool`` segment) or None.

        Raises:
            ValueError: more keys than ``max_len`` with ``linear`` or ``conv``.
        """
        s = k.shape[2]
        proj = self.cfg.projection
        if proj in ("linear", "conv"):
            if s > self.cfg.max_len:
                raise ValueError(
                    f"attention kind 'linformer': {s} keys exceed {self.option}.max_len={self.cfg.max_len} "
                    f"(E and F have a fixed length)"
                )
            vm = valid[:, None, :, None].to(k.dtype)
            k, v = k * vm, v * vm  # padding contributes nothing
            f = self.e_proj if self.f_proj is None else self.f_proj
            if proj == "conv":
                return self._project_conv(k, self.e_proj), self._project_conv(v, f), None
            return self._project_linear(k, self.e_proj), self._project_linear(v, f), None  # (B, H, k, Dh)
        if proj == "max_pool":
            (pk, live), (pv, _) = self._max_pool(k, valid), self._max_pool(v, valid)
            bias = torch.where(live, 0.0, torch.finfo(torch.float32).min)  # (B, k): empty segments
            return pk, pv, bias[:, None, None, :]
        pool, log_size = self._segments(s, valid)  # (B, k, S), (B, k)
        pk = torch.einsum("bks,bhsd->bhkd", pool.to(k.dtype), k)
        pv = torch.einsum("bks,bhsd->bhkd", pool.to(v.dtype), v)
        return pk, pv, log_size[:, None, None, :]  # segment sizes (and -inf for empty ones)

    def forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext, cache=None) -> AttnOutput:
        if cache is not None:
            raise NotImplementedError("attention kind 'linformer' has no incremental (cached) form")
        if ctx.causal:
            raise ValueError("attention kind 'linformer' has no causal form (backbone.causal must be false)")
        q, k, v = self.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S, Dh) x2
        b, _, t, _ = q.shape
        s = k.shape[2]
        if s != ctx.k_len:
            raise ValueError(f"attention: {s} keys but the context describes {ctx.k_len}")
        if ctx.seg_k is not None and s > 1:
            sk = ctx.seg_k if ctx.key_valid is None else ctx.seg_k.masked_fill(~ctx.key_valid, -(2**62))
            lo = sk.masked_fill(sk == -(2**62), 2**62).amin(1)
            if bool((sk.amax(1) > lo).any()):
                raise ValueError(
                    "attention kind 'linformer' projects all keys together and cannot keep several episodes "
                    "of one row apart; feed one episode per row"
                )
        q = self.position.rotate(q, ctx.pos_q)
        k = self.position.rotate(k, ctx.pos_k)
        valid = torch.ones(b, s, dtype=torch.bool, device=q.device) if ctx.key_valid is None else ctx.key_valid
        pk, pv, bias = self._projected(k, v, valid)  # (B, H, k, Dh) x2, (B, 1, 1, k) or None
        with torch.autocast(q.device.type, enabled=False):  # float32 scores (bf16 autocast too; float64 stays)
            scores = (to_acc(q) @ to_acc(pk).transpose(-1, -2)) * self.scale  # (B, H, T, k)
            if bias is not None:  # empty segments: the most negative finite score (finite gradients)
                scores = (scores + bias).clamp_min(torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1)
            probs = probs * valid.any(1).view(b, 1, 1, 1)  # a row without valid keys -> 0
            if self.dropout_p > 0:
                probs = dropout(probs, self.dropout_p)
            y = (probs @ to_acc(pv)).to(v.dtype)  # (B, H, T, Dh)
        return AttnOutput(self.o_proj(self.merge_heads(y)))


@ATTENTION.register(
    "linformer",
    description="Linformer: keys/values projected along the sequence to k rows (E, F; or mean/max pooling, a strided "
                "convolution), sharing options, per-layer k",
    paper="Wang et al. 2020, Linformer: Self-Attention with Linear Complexity (sec. 4, eq. 7)",
    capabilities=Capabilities(
        causal=False, exact=False, approximate=True, subquadratic=True,
        positions=("none", "sinusoidal", "learned", "rotary"),
    ),
)
@dataclass(frozen=True)
class LinformerConfig(AttentionConfig):
    """Linformer options.

    Attributes:
        k: projected length (one int, or a tuple with one entry per layer).
        max_len: n, the fixed maximum number of keys of the ``linear`` projection.
        projection: ``linear`` (learned E, F), ``pool`` (segment means; exact at k = S),
            ``max_pool`` (segment maxima; exact at k = S) or ``conv`` (a learned convolution
            along the sequence with kernel = stride = ceil(max_len / k)).
        sharing: ``none``, ``headwise``, ``kv`` or ``layerwise`` (``linear`` and ``conv``).
    """

    k: int | tuple[int, ...] = 64
    max_len: int = 512
    projection: str = "linear"
    sharing: str = "headwise"

    def __post_init__(self) -> None:
        ks = self.k if isinstance(self.k, tuple) else (self.k,)
        if not ks or min(ks) < 1:
            raise ValueError(f"attention.k must be >= 1, got {self.k}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"attention.projection must be one of {', '.join(PROJECTIONS)}, got {self.projection!r}")
        if self.sharing not in SHARING:
            raise ValueError(f"attention.sharing must be one of {', '.join(SHARING)}, got {self.sharing!r}")
        if self.max_len < 1:
            raise ValueError(f"attention.max_len must be >= 1, got {self.max_len}")
        if self.sharing == "layerwise" and len(set(ks)) > 1:
            raise ValueError("attention.sharing='layerwise' shares one E for all layers: use one k for all layers")

    @property
    def max_keys(self) -> int | None:
        """Longest sequence this kind takes: ``max_len`` with the ``linear`` and ``conv``
        projections (E and F, the convolution's output length, are fixed), ``None`` (no limit)
        with ``pool`` and ``max_pool``."""
        return self.max_len if self.projection in ("linear", "conv") else None

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Contract-suite fields: E, F long enough for the test length."""
        return {"k": 8, "max_len": max(seq_len, 64)}

    @classmethod
    def contract_convergence(cls, seq_len: int) -> list[dict]:
        """Growing k with segment-mean projections (exact at k = S)."""
        return [{"projection": "pool", "k": k} for k in sorted({max(1, seq_len // 6), max(1, seq_len // 3), seq_len})]

    def k_at(self, layer: int) -> int:
        """Projected length at ``layer``."""
        return self.k[layer] if isinstance(self.k, tuple) else self.k

    def check(self, backbone_cfg) -> None:
        if isinstance(self.k, tuple) and len(self.k) != backbone_cfg.n_layers:
            raise IncompatibleConfig(
                f"backbone.attention.k has {len(self.k)} entries but backbone.n_layers={backbone_cfg.n_layers}"
            )

    def build(self, ctx, position) -> AttentionModule:
        return LinformerAttention(ctx, position, self)
