"""Performer attention, FAVOR+ (``performer``; Choromanski et al. 2021, "Rethinking Attention
with Performers", ICLR 2021)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rl_tformers.attention._linear import (
    LINEAR_POSITIONS,
    KernelAttention,
    acc_dtype,
    maybe_redraw_random_features,
    orthogonal_gaussian,
    redraw_random_features,
)
from rl_tformers.attention.base import AttentionConfig, AttentionModule
from rl_tformers.registry import ATTENTION, Capabilities

__all__ = ["PerformerAttention", "PerformerConfig", "maybe_redraw_random_features", "redraw_random_features"]


class PerformerAttention(KernelAttention):
    """FAVOR+: softmax attention estimated with positive orthogonal random features.

    Choromanski et al. 2021, sec. 2.3, Lemma 1 (positive random features for the softmax kernel)::

        exp(x . y) = E_w[ phi(x) . phi(y) ],  phi(x) = exp(-|x|^2 / 2) / sqrt(m) [exp(w_1 . x), ..., exp(w_m . x)]

    with w_i ~ N(0, I_Dh), drawn orthogonal in blocks (sec. 2.4), and x = q / Dh^(1/4),
    y = k / Dh^(1/4) so that x . y = q . k / sqrt(Dh). The estimate is unbiased and, being
    positive, has a positive normaliser (no sign cancellation, unlike sin/cos features).

    Causal form: the prefix sums of sec. 2.6 ("unidirectional"), evaluated chunk-wise without a
    loop over tokens (:func:`~rl_tformers.attention._linear.causal_linear`); bidirectional form:
    one (m x Dh) sum. Incremental decoding carries ``[S | z]`` (B, H, m, Dh + 1) in the cache.

    Numerical stabilisation (both cancel exactly in the ratio): each query's features are scaled
    by exp(-max_i(w_i . x - |x|^2/2)) (its own row only, so causality is untouched); keys use the
    data-independent shift in the causal form (a max over keys would let future keys change the
    scale of past outputs; :func:`causal_key_shift`: the bound ``w_i . y - |y|^2/2 <= B =
    max_i |w_i|^2 / 2``, capped at 60 so that typical keys, whose logits are near 0, do not give
    subnormal features: with Dh = 128 (the DT's one 128-wide head) B is about 90, and exp(-90)
    made 99.9% of the key features subnormal floats, 20-50x slower matmuls and results that
    depended on subnormal rounding) and the max over the valid keys, detached, in the
    bidirectional form.

    Redraw policy: the features ``omega`` (m, Dh) are a buffer (in checkpoints), drawn at
    construction (``seed`` or the global RNG) and redrawn only by :meth:`redraw`, i.e. by
    :func:`redraw_random_features` / :func:`maybe_redraw_random_features` (every
    ``redraw_every`` updates) called by the trainer *between* updates, never inside forward:
    a rollout and the update that learns from it use the same function.

    Cost: O(L m Dh) time, O(L C + (L / C) m Dh) memory per head (C = chunk size).
    Cannot: score-based positions (ALiBi, Shaw, XL relative, DA), attention dropout,
    ``need_weights``.
    """

    random_buffers = ("omega",)

    def __init__(self, ctx, position, cfg: PerformerConfig) -> None:
        super().__init__(ctx, position, kind=cfg.kind, chunk_size=cfg.chunk_size, eps=torch.finfo(torch.float32).tiny,
                         redraw_every=cfg.redraw_every)
        self.m = cfg.nb_features or max(1, int(round(self.head_dim * math.log(max(self.head_dim, 2)))))
        self.orthogonal = cfg.orthogonal
        gen = None
        if cfg.seed is not None:
            gen = torch.Generator().manual_seed(cfg.seed + 7919 * max(ctx.layer_idx, 0))
        self.register_buffer("omega", self._draw(gen))  # (m, Dh)

    @property
    def n_features(self) -> int:
        return self.m

    def _draw(self, generator: torch.Generator | None) -> Tensor:
        if self.orthogonal:
            return orthogonal_gaussian(self.m, self.head_dim, generator)
        return torch.randn(self.m, self.head_dim, generator=generator)

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw new features in place (explicit call; see the class docstring)."""
        self.omega.copy_(self._draw(generator).to(self.omega.device))

    def features(self, x: Tensor, is_query: bool, valid: Tensor | None) -> Tensor:
        """Positive random features phi(x / Dh^(1/4)): x (B, H, L, Dh) -> (B, H, L, m) in
        ``acc_dtype(x.dtype)`` (float32, float64 for a float64 model)."""
        x = x.to(acc_dtype(x.dtype)) * self.head_dim**-0.25
        logits = x @ self.omega.to(x.dtype).T - 0.5 * (x * x).sum(-1, keepdim=True)  # (B, H, L, m)
        if is_query:
            stab = logits.amax(dim=-1, keepdim=True).detach()  # per query row
        elif self.causal:
            stab = causal_key_shift(self.omega)  # data-independent (see the class docstring)
        else:
            if valid is None:
                stab = logits.amax(dim=(-1, -2), keepdim=True).detach()  # (B, H, 1, 1)
            else:  # max over the valid keys; a row without any uses 0 (its features are never read)
                masked = logits.masked_fill(~valid[:, None, :, None], torch.finfo(logits.dtype).min)
                stab = masked.amax(dim=(-1, -2), keepdim=True).detach()  # (B, H, 1, 1)
                stab = torch.where(valid.any(-1)[:, None, None, None], stab, 0.0)
        return torch.exp(logits - stab) / math.sqrt(self.m)


#: Cap of the causal key shift (:func:`causal_key_shift`): exp(-60) ~ 9e-27 keeps the features of
#: keys with logits near 0 (the typical ones) far above float32's smallest normal (1.2e-38).
KEY_SHIFT_CAP = 60.0
#: Largest ``B - shift``: a key at the bound gets a feature <= exp(78) / sqrt(m) ~ 7e33, so sums
#: over thousands of keys (times values of order 10) stay below float32's maximum (3.4e38).
KEY_SHIFT_HEADROOM = 78.0


def causal_key_shift(omega: Tensor) -> Tensor:
    """The data-independent shift of the causal key features' logits: a () float32 tensor.

    ``B = max_i |w_i|^2 / 2`` bounds every logit ``w_i . y - |y|^2 / 2`` (maximised at y = w_i);
    the shift is ``max(min(B, KEY_SHIFT_CAP), B - KEY_SHIFT_HEADROOM)``: B itself when B <= 60
    (Dh up to about 90: unchanged from the plain bound), else 60, or B - 78 when that is larger
    (Dh above about 200, where no shift keeps both ends in float32's normal range). It cancels
    exactly in the attention ratio and depends on ``omega`` only, so outputs stay exactly causal.
    """
    bound = 0.5 * (omega.float() ** 2).sum(-1).max()
    return torch.maximum(bound.clamp(max=KEY_SHIFT_CAP), bound - KEY_SHIFT_HEADROOM)


@ATTENTION.register(
    "performer",
    description="FAVOR+: softmax attention via positive orthogonal random features, causal prefix sums",
    paper="Choromanski et al. 2021, Rethinking Attention with Performers (sec. 2.3-2.6, Lemma 1)",
    capabilities=Capabilities(
        memory=True, incremental=True, exact=False, approximate=True, subquadratic=True,
        exact_chunking=True, positions=LINEAR_POSITIONS,
    ),
)
@dataclass(frozen=True)
class PerformerConfig(AttentionConfig):
    """FAVOR+ options.

    Attributes:
        nb_features: m random features per layer (None: round(Dh ln Dh), the paper's m = Theta(d log d)).
        orthogonal: orthogonal random features (sec. 2.4); False: i.i.d. Gaussian.
        chunk_size: chunk length of the causal prefix sums (memory/speed trade-off only).
        redraw_every: redraw period in updates for :func:`maybe_redraw_random_features` (0 = never).
        seed: seed of the initial draw (per layer: seed + 7919 * layer); None: global RNG.
    """

    nb_features: int | None = None
    orthogonal: bool = True
    chunk_size: int = 64
    redraw_every: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.nb_features is not None and self.nb_features < 1:
            raise ValueError(f"attention.nb_features must be >= 1, got {self.nb_features}")
        if self.chunk_size < 1:
            raise ValueError(f"attention.chunk_size must be >= 1, got {self.chunk_size}")
        if self.redraw_every < 0:
            raise ValueError(f"attention.redraw_every must be >= 0 (0 = never redraw), got {self.redraw_every}")

    @classmethod
    def contract_config(cls, seq_len: int) -> dict:
        """Contract-suite fields: small chunks (several chunks at test length), fixed seed."""
        return {"chunk_size": 4, "seed": 0}

    @classmethod
    def contract_convergence(cls, seq_len: int) -> list[dict]:
        """Growing feature budgets m: the FAVOR+ error to softmax attention shrinks."""
        return [{"nb_features": m} for m in (16, 64, 256, 1024)]

    def build(self, ctx, position) -> AttentionModule:
        return PerformerAttention(ctx, position, self)
