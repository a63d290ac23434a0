"""Random Feature Attention (``rfa``; Peng et al. 2021, "Random Feature Attention", ICLR 2021)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.attention._linear import (
    LINEAR_POSITIONS,
    KernelAttention,
    acc_dtype,
    maybe_redraw_random_features,
    redraw_random_features,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.registry import ATTENTION, Capabilities
from rl_tformers.types import AttnContext, AttnOutput

__all__ = ["RFAAttention", "RFAConfig", "maybe_redraw_random_features", "redraw_random_features"]


class RFAAttention(KernelAttention):
    """RFA: attention with sin/cos random Fourier features, learned sigma, optional gate.

    Peng et al. 2021, sec. 2.2-3: with unit-norm queries and keys (sec. 3.1, "we l2-normalise
    q and k"), ``exp(q . k / s^2)`` is proportional to the Gaussian kernel
    ``exp(-|q - k|^2 / 2 s^2)``, whose random Fourier features (Rahimi & Recht 2007, eq. 2) are::

        phi(x) = 1 / sqrt(D) [sin(w_1 . x), ..., sin(w_D . x), cos(w_1 . x), ..., cos(w_D . x)]

    so ``RFA(q_t) = phi(q_t)^T S_t / phi(q_t) . z_t`` (eq. 5), S = sum_j phi(k_j) v_j^T,
    z = sum_j phi(k_j). The random directions are ``w_i = sigma * eps_i`` (eps_i ~ N(0, I), a
    buffer; sigma (H, Dh) learned per head and dimension by reparameterisation, sec. 3.1), which
    gives ``E[phi(x) . phi(y)] = exp(-sum_d sigma_d^2 (x_d - y_d)^2 / 2)``: sigma acts as the
    inverse temperature (large sigma = sharp attention, and a noisier estimate).

    Gated form (sec. 3.2, eq. 7), causal only: ``g_t = sigmoid(w_g . x_t + b_g)`` per head and
    ``S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T``, ``z_t = g_t z_{t-1} + (1 - g_t) phi(k_t)``:
    a learned recency bias. A padded key is skipped (``S_t = S_{t-1}``): its gate does not decay
    the state, so padding content never changes a valid output. The (S, z) state is the
    incremental-decoding cache (:class:`~rl_tformers.attention._linear.LinearCache`), so
    step-by-step decoding equals the full pass; the full pass evaluates the recurrence
    chunk-wise with a scan, not a token loop.

    sin/cos features can make the normaliser ``phi(q) . z`` small or negative when D is small;
    its magnitude is clamped to ``eps`` (sign kept), and rows with no allowed key return 0.

    Redraw policy as for the Performer: ``eps`` is a buffer changed only by :meth:`redraw`
    (explicit call, or the trainer's schedule via ``maybe_redraw_random_features``).

    Cost: O(L D Dh) time, O(L C + (L / C) D Dh) memory per head. Cannot: score-based positions,
    attention dropout, ``need_weights``; the gate has no bidirectional form.
    """

    random_buffers = ("eps_dirs",)

    def __init__(self, ctx, position, cfg: RFAConfig) -> None:
        super().__init__(ctx, position, kind=cfg.kind, chunk_size=cfg.chunk_size, eps=cfg.normaliser_eps,
                         redraw_every=cfg.redraw_every)
        self.d_feat = cfg.num_features
        gen = None
        if cfg.seed is not None:
            gen = torch.Generator().manual_seed(cfg.seed + 7919 * max(ctx.layer_idx, 0))
        self.register_buffer("eps_dirs", torch.randn(self.n_heads, self.d_feat, self.head_dim, generator=gen))
        log_sigma = torch.full((self.n_heads, self.head_dim), math.log(cfg.sigma_init))
        self.log_sigma = nn.Parameter(log_sigma, requires_grad=cfg.learn_sigma)  # (H, Dh)
        self.gate = nn.Linear(self.d_model, self.n_heads) if cfg.gate else None

    @property
    def n_features(self) -> int:
        return 2 * self.d_feat

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw new eps directions in place (explicit call only)."""
        self.eps_dirs.copy_(torch.randn(self.eps_dirs.shape, generator=generator).to(self.eps_dirs.device))

    def features(self, x: Tensor, is_query: bool, valid: Tensor | None) -> Tensor:
        """phi(x / |x|): x (B, H, L, Dh) -> (B, H, L, 2D) in ``acc_dtype(x.dtype)`` (float32, or float64)."""
        x = F.normalize(x.to(acc_dtype(x.dtype)), dim=-1)
        w = self.eps_dirs.to(x.dtype) * self.log_sigma.to(x.dtype).exp()[:, None, :]  # (H, D, Dh)
        proj = torch.einsum("bhld,hnd->bhln", x, w)  # (B, H, L, D)
        return torch.cat([proj.sin(), proj.cos()], dim=-1) / math.sqrt(self.d_feat)

    def key_decay(self, x_kv: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """Gated form: log g_j (B, H, S) and key weight 1 - g_j (B, H, S); (None, None) ungated."""
        if self.gate is None:
            return None, None
        z = self.gate(x_kv.to(self.gate.weight.dtype))
        z = z.to(acc_dtype(z.dtype)).transpose(1, 2)  # (B, H, S)
        return F.logsigmoid(z), torch.sigmoid(-z)

    def reference_forward(self, x_q: Tensor, x_kv: Tensor, ctx: AttnContext) -> AttnOutput:
        """The exact (feature-free) attention RFA estimates, O(T S): weights proportional to
        ``exp(-sum_d sigma_d^2 (q^_d - k^_d)^2 / 2)`` on unit-norm q^, k^ (times
        ``(1 - g_j) prod_{j<l<=t} g_l`` in the gated form, with g_l = 1 for padded keys l),
        masked by ``ctx.allowed()``.
        Shapes: x_q (B, T, D), x_kv (B, S, D) -> out (B, T, D), weights (B, H, T, S). Tests only.
        """
        q, k, v = self.project(x_q, x_kv)
        pos = self.position
        q = F.normalize(pos.rotate(pos.content_query(q), ctx.pos_q).float(), dim=-1)  # (B, H, T, Dh)
        k = F.normalize(pos.rotate(k, ctx.pos_k).float(), dim=-1)  # (B, H, S, Dh)
        s2 = (2 * self.log_sigma.float()).exp()[None, :, None, :]  # (1, H, 1, Dh) sigma^2
        diff2 = ((q[:, :, :, None, :] - k[:, :, None, :, :]) ** 2 * s2[:, :, :, None, :]).sum(-1)  # (B, H, T, S)
        logits = -0.5 * diff2
        if self.gate is not None:
            log_g, w = self.key_decay(x_kv)  # (B, H, S)
            if ctx.key_valid is not None:  # a padded key does not decay the state (g = 1)
                log_g = log_g.masked_fill(~ctx.key_valid[:, None, :], 0.0)
            c = log_g.double().cumsum(-1)  # (B, H, S)
            m = ctx.prefix_len
            decay = c[:, :, m:, None] - c[:, :, None, :]  # (B, H, T, S): sum_{j<l<=M+t} log g_l
            logits = logits + decay.float().clamp_max(0) + w.log()[:, :, None, :]
        allowed = ctx.allowed()  # (B|1, 1, T, S)
        logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
        probs = torch.softmax(logits, dim=-1) * allowed.any(-1, keepdim=True)  # rows with no allowed key -> 0
        out = probs @ v.float()  # (B, H, T, Dh)
        return AttnOutput(self.o_proj(self.merge_heads(out.to(v.dtype))), weights=probs)


@ATTENTION.register(
    "rfa",
    description="Random Feature Attention: sin/cos random features, learned sigma, optional gate, (S, z) recurrent state",
    paper="Peng et al. 2021, Random Feature Attention (sec. 2.2, 3.1, 3.2 eq. 5-7)",
    capabilities=Capabilities(
        memory=True, incremental=True, exact=False, approximate=True, subquadratic=True,
        exact_chunking=True, positions=LINEAR_POSITIONS,
    ),
)
@dataclass(frozen=True)
class RFAConfig(AttentionConfig):
    """RFA options.

    Attributes:
        num_features: D random directions (the feature map has 2D entries; the paper asks D >= Dh).
        sigma_init: initial sigma (all heads and dimensions).
        learn_sigma: learn sigma (sec. 3.1); False keeps it fixed.
        gate: the gated recurrent form (sec. 3.2); causal only.
        chunk_size: chunk length of the causal scan (memory/speed only).
        normaliser_eps: smallest |phi(q) . z| (sign kept).
        redraw_every: redraw period in updates for ``maybe_redraw_random_features`` (0 = never).
        seed: seed of the initial draw (per layer: seed + 7919 * layer); None: global RNG.
    """

    num_features: int = 128
    sigma_init: float = 1.0
    learn_sigma: bool = True
    gate: bool = False
    chunk_size: int = 64
    normaliser_eps: float = 1e-6
    redraw_every: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.num_features < 1 or self.sigma_init <= 0 or self.chunk_size < 1 or self.normaliser_eps <= 0:
            raise ValueError("attention: rfa needs num_features >= 1, sigma_init > 0, chunk_size >= 1, normaliser_eps > 0")
        if self.redraw_every < 0:  # a negative period silently never redrew
            raise ValueError(f"attention.redraw_every must be >= 0 (0 = never redraw), got {self.redraw_every}")

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Contract-suite fields: small chunks, fixed seed."""
        return {"chunk_size": 4, "seed": 0}

    @classmethod
    def contract_convergence(cls, seq_len: int) -> list[dict]:
        """Growing numbers of random directions D: the error to the Gaussian-kernel attention shrinks."""
        return [{"num_features": d} for d in (16, 64, 256, 1024)]

    def check(self, backbone_cfg) -> None:
        if self.gate and not backbone_cfg.causal:
            raise IncompatibleConfig(
                "backbone.attention.gate=true (gated RFA) is a causal recurrence; set backbone.causal=true "
                "or backbone.attention.gate=false"
            )

    def build(self, ctx, position) -> AttentionModule:
        return RFAAttention(ctx, position, self)
