"""Early exit per token (depth kind ``early_exit``): Depth-Adaptive Transformer and CALM.

Elbayad et al. 2020, "Depth-Adaptive Transformer" (sec. 2-3) and Schuster et al. 2022,
"Confident Adaptive Language Modeling" (CALM, sec. 3-4). N distinct blocks, as ``fixed``;
after each layer n < N a token may *exit*: its state ``h^n`` becomes its output and is copied
to every layer above (CALM sec. 3.3 "state propagation"), where later tokens still attend to it
(the layers above see the copied state, so their keys/values for that token are computed from
it). The output head belongs to the agent; the backbone output of an exited token is
``final_norm(h^n)``, so the agent's usual ``head(backbone(x).hidden)`` gives early-exit
predictions.

Exit decisions: a token exits after layer n (1-based, n < N) when its confidence
``c^n >= threshold``; every confidence lies in [0, 1], so threshold 0 exits every token after
layer 1 and a threshold above 1 (the default, ``None`` = +inf) never exits early: the output is
then the full model's. ``confidence``:

- ``softmax`` (CALM sec. 3.5): top-1 minus top-2 probability of ``softmax(exit_head(h^n))``;
  needs ``exit_head`` (discrete actions).
- ``saturation`` (CALM sec. 3.5): hidden-state saturation ``(1 + cos(h^n, h^{n-1})) / 2``
  (``h^0`` = the layer-1 input), rescaled from cos to [0, 1].
- ``classifier`` (CALM sec. 3.5, default): ``sigmoid(w . LN(h^n) + b)``, shared over layers
  (``per_layer_classifier`` for one per layer), trained on "layer n agrees with the last
  layer" labels.
- ``geometric`` (Elbayad sec. 3.2, token-specific geometric-like): per-layer halting
  ``chi^n = sigmoid(w_n . LN(h^n) + b_n)``; ``q(n) = chi^n prod_{n'<n} (1 - chi^{n'})``.
- ``multinomial`` (Elbayad sec. 3.2, token-specific): ``q(n) = softmax(W LN(h^1) + b)``
  from the first layer's state; the confidence after layer n is ``sum_{n'<=n} q(n')`` (the
  predicted probability of having exited), so threshold 0.5 exits at the median of q.
- ``sequence`` (Elbayad sec. 3.1, sequence-specific): as ``multinomial`` from the mean of
  ``LN(h^1)`` over the row's valid tokens: one depth per row. The decision depends on the
  whole window (not causal in its depth choice; DT decides at the last token, so it is
  harmless there).

``LN`` is a parameter-free layer norm of the classifier input. The exit classifiers are
trained by :meth:`EarlyExitDepth.exit_classifier_loss` on detached states against their
oracles (Elbayad sec. 3.3: likelihood-based ``argmax_n LL^n - lambda n``, optionally smoothed
over time with ``kappa(t, t') = exp(-|t - t'|^2 / sigma)``, or correctness-based; CALM: agreement
with the last layer), so they never change the policy.

Training the heads on every exit (Elbayad sec. 2.2; CALM sec. 4): ``backbone(x,
output_hidden_states=True)`` then :func:`exit_predictions` and :func:`exit_loss` (``weighted``:
CALM's ``sum_n n L_n / sum_n n``; ``uniform``: Elbayad's aligned training; ``sampled``: one
random exit per token). ``exit_layers=`` forces given exits in ``forward`` (Elbayad's mixed
training with copied states, and tests).

Threshold calibration (CALM sec. 4, Learn-then-Test, Angelopoulos et al. 2021):
:func:`calibrate_threshold` tests candidate thresholds from the most conservative down with
fixed-sequence testing and the Hoeffding p-value ``exp(-2 n (delta - R)^2)`` on the held-out
inconsistency R (fraction of decisions whose early-exit action differs from the full model's:
argmax for discrete actions, max-abs difference above ``tol`` for continuous ones), and returns
the smallest threshold for which every larger candidate was accepted: with probability at least
1 - epsilon its expected inconsistency is at most delta.

Compute: without a state the loop stops as soon as every deciding token has exited (the
speed-up). With a state, it stops early only when no layer above holds a cache (Transformer-XL
or compressive memory: their memories of the skipped layers receive the copied states);
with a KV cache or a kNN store above, all layers run and the exited tokens' outputs are kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.depth.base import DepthConfig, DepthModule, DepthOutput
from rl_tformers.depth.fixed import build_blocks
from rl_tformers.registry import DEPTH, Capabilities
from rl_tformers.types import AttnContext, LayerState

CONFIDENCES = ("softmax", "saturation", "classifier", "geometric", "multinomial", "sequence")
SCHEMES = ("weighted", "uniform", "sampled")
ORACLES = ("likelihood", "correctness")


def _ln(h: Tensor) -> Tensor:
    """Parameter-free layer norm of classifier inputs: (..., D) -> (..., D)."""
    return F.layer_norm(h, h.shape[-1:])


def softmax_response(logits: Tensor) -> Tensor:
    """CALM softmax response: top-1 minus top-2 probability. (..., A) -> (...) in [0, 1]."""
    p = torch.softmax(logits.float(), dim=-1)
    if p.shape[-1] < 2:
        return torch.ones_like(p[..., 0])
    top = p.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def saturation(h: Tensor, h_prev: Tensor) -> Tensor:
    """CALM hidden-state saturation rescaled to [0, 1]: (1 + cos(h, h_prev)) / 2. (B, T, D) -> (B, T)."""
    return (1.0 + F.cosine_similarity(h.float(), h_prev.float(), dim=-1)) / 2


class EarlyExitDepth(DepthModule):
    """N blocks with per-token early exit (module docstring).

    ``forward(x, ctx, layer_states, need_hidden, *, exit_head=None, exit_threshold=None,
    exit_mask=None, exit_layers=None)``:

    Args (keywords, passed through ``Backbone.forward(..., **depth_kwargs)``):
        exit_head: ``h (B, T, D) -> logits (B, T, A)`` applied to raw layer outputs (use
            :func:`with_final_norm` to give it what the backbone output would be); needed by
            ``confidence='softmax'`` only.
        exit_threshold: float threshold; default the module's calibrated buffer
            ``exit_threshold`` (+inf unless set by config or :meth:`set_threshold`).
        exit_mask: (B, T) bool, tokens whose output is used (e.g. DT's state tokens); only
            they decide to exit and the loop stops when all of them exited. Others never exit
            on their own (default: every valid token decides).
        exit_layers: (B, T) long, force token exits after layer ``exit_layers + 1`` (0-based
            layer index; >= N - 1 = no early exit), bypassing the confidences.

    Metrics: ``exit/mean_layer`` (mean 1-based exit layer of deciding tokens),
    ``exit/early_frac``, ``exit/layers_run``.

    Raises:
        IncompatibleConfig: the block kind is reversible (at construction).
        ValueError: ``forward`` with ``confidence='softmax'``, early exit active (a threshold
            <= 1, N > 1) and no ``exit_head`` nor ``exit_layers``.
    """

    def __init__(self, ctx, cfg: EarlyExitConfig) -> None:
        super().__init__()
        self.blocks = build_blocks(ctx, ctx.n_layers)
        if getattr(self.blocks[0], "reversible", False):
            raise IncompatibleConfig(
                f"depth.kind='early_exit' cannot copy states through backbone.block.kind={ctx.config.block.kind!r} "
                f"(a reversible stack)"
            )
        n, d = ctx.n_layers, ctx.d_model
        self.n_layers, self.kind = n, cfg.confidence
        self.cfg = cfg
        self.exit_classifier: nn.Module | None = None
        if cfg.confidence == "classifier":
            self.exit_classifier = (
                nn.ModuleList(nn.Linear(d, 1) for _ in range(max(1, n - 1))) if cfg.per_layer_classifier else nn.Linear(d, 1)
            )
        elif cfg.confidence == "geometric":
            self.exit_classifier = nn.ModuleList(nn.Linear(d, 1) for _ in range(max(1, n - 1)))
        elif cfg.confidence in ("multinomial", "sequence"):
            self.exit_classifier = nn.Linear(d, n)
        thr = math.inf if cfg.threshold is None else float(cfg.threshold)
        self.register_buffer("exit_threshold", torch.tensor(thr))

    # -- thresholds ------------------------------------------------------------------------------
    def set_threshold(self, threshold: float) -> None:
        """Store a calibrated threshold (saved with the module's state dict)."""
        self.exit_threshold.fill_(float(threshold))

    # -- confidences -----------------------------------------------------------------------------
    def _binary(self, i: int, h: Tensor) -> Tensor:
        """Logit of the CALM classifier / Elbayad chi^n after layer i: (B, T, D) -> (B, T)."""
        clf = self.exit_classifier
        lin = clf[min(i, len(clf) - 1)] if isinstance(clf, nn.ModuleList) else clf
        return lin(_ln(h)).squeeze(-1)

    def depth_logits(self, h1: Tensor, valid: Tensor) -> Tensor:
        """Elbayad's multinomial depth classifiers from the first layer's output.

        Args:
            h1: (B, T, D) output of layer 1.
            valid: (B, T) bool.
        Returns:
            (B, T, N) logits of q(n): per token (``multinomial``) or the row's (``sequence``),
            broadcast over T.
        """
        f = _ln(h1)
        if self.kind == "sequence":
            m = valid[..., None].to(f.dtype)
            f = ((f * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1)).expand_as(f)  # (B, T, D)
        return self.exit_classifier(f)

    def confidence(self, i: int, h: Tensor, h_prev: Tensor, exit_head, q_cdf: Tensor | None) -> Tensor:
        """Confidence c^{i+1} in [0, 1] of every token after layer index i: (B, T)."""
        if self.kind == "softmax":
            return softmax_response(exit_head(h))
        if self.kind == "saturation":
            return saturation(h, h_prev)
        if self.kind in ("classifier", "geometric"):
            return torch.sigmoid(self._binary(i, h).float())
        return q_cdf[..., i]

    # -- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor,
        ctx: AttnContext,
        layer_states: list[LayerState] | None,
        need_hidden: bool = False,
        *,
        exit_head: Callable[[Tensor], Tensor] | None = None,
        exit_threshold: float | None = None,
        exit_mask: Tensor | None = None,
        exit_layers: Tensor | None = None,
    ) -> DepthOutput:
        """x (B, T, D) -> :class:`DepthOutput` with hidden (B, T, D) (exited tokens: their state
        at the exit layer); keyword arguments and errors in the class docstring."""
        b, t, _ = x.shape
        n = self.n_layers
        valid = ctx.key_valid[:, -t:] if ctx.key_valid is not None else torch.ones(b, t, dtype=torch.bool, device=x.device)
        decide = valid if exit_mask is None else valid & exit_mask.to(torch.bool)
        thr = float(self.exit_threshold) if exit_threshold is None else float(exit_threshold)
        forced = exit_layers is not None
        active = (forced or thr <= 1.0) and n > 1
        if active and not forced and self.kind == "softmax" and exit_head is None:
            raise ValueError("depth.confidence='softmax' needs exit_head=... (logits of the agent's action head)")
        exited = torch.zeros(b, t, dtype=torch.bool, device=x.device)
        exit_at = torch.full((b, t), n - 1, dtype=torch.long, device=x.device)
        out = DepthOutput(hidden=x, layer_inputs=[], caches=[], weights=[])
        hidden: list[Tensor] = []
        q_cdf = None
        run = n
        any_decide: bool | None = None  # decide.any(), synced once (it does not change across layers)
        for i, block in enumerate(self.blocks):
            h = self.run_layer(i, block, x, ctx, layer_states, out)
            if active:
                h = torch.where(exited[..., None], x, h)  # exited tokens: state copied upward
            if need_hidden:
                hidden.append(h)
            if active and i < n - 1:
                if forced:
                    new = decide & ~exited & (exit_layers.to(x.device) <= i)
                else:
                    if q_cdf is None and self.kind in ("multinomial", "sequence"):
                        q_cdf = torch.softmax(self.depth_logits(h, valid).float(), -1).cumsum(-1)  # (B, T, N)
                    conf = self.confidence(i, h, x, exit_head, q_cdf)
                    new = decide & ~exited & (conf >= thr)
                exit_at = torch.where(new, torch.full_like(exit_at, i), exit_at)
                exited = exited | new
                if any_decide is None:
                    any_decide = bool(decide.any())
                if any_decide and bool((exited | ~decide).all()) and self._can_skip(i, layer_states):
                    run = i + 1
                    self._skip_above(i, h, ctx, out, hidden if need_hidden else None)
                    x = h
                    break
            x = h
        out.hidden = x
        out.hidden_states = tuple(hidden) if need_hidden else None
        self._exit_metrics(out, decide, exit_at, run)
        return out

    def _exit_metrics(self, out: DepthOutput, decide: Tensor, exit_at: Tensor, run: int) -> None:
        """``out.metrics``: ``exit/mean_layer`` (mean 1-based exit layer of the deciding tokens
        ``decide`` (B, T), exit layers ``exit_at`` (B, T) 0-based), ``exit/early_frac`` and
        ``exit/layers_run`` (``run``)."""
        nd = decide.sum().clamp_min(1)
        layer = (exit_at + 1).float()
        out.metrics["exit/mean_layer"] = ((layer * decide).sum() / nd).detach()
        out.metrics["exit/early_frac"] = (((exit_at < self.n_layers - 1) & decide).sum() / nd).detach().float()
        out.metrics["exit/layers_run"] = float(run)

    def _skip_above(self, i: int, h: Tensor, ctx: AttnContext, out: DepthOutput, hidden: list[Tensor] | None) -> None:
        """Every token exited after layer ``i``: the layers above are not run and keep the copied
        states ``h`` (B, T, D) (their inputs, for memories; no cache, weights or extras; ``hidden``
        gets ``h`` once per skipped layer when given)."""
        for j in range(i + 1, self.n_layers):
            out.layer_inputs.append(self.blocks[j].attn.position.embed(h, ctx.pos_q))
            out.caches.append(None)
            out.weights.append(None)
            out.extras.append(None)
            if hidden is not None:
                hidden.append(h)

    @staticmethod
    def _can_skip(i: int, layer_states: list[LayerState] | None) -> bool:
        """True when no layer above i holds a cache that must receive this segment."""
        return layer_states is None or all(ls.cache is None for ls in layer_states[i + 1 :])

    # -- training the exit classifiers -----------------------------------------------------------
    def exit_classifier_loss(
        self,
        hidden_states: Sequence[Tensor],
        token_loss: Tensor | None = None,
        mask: Tensor | None = None,
        consistent: Tensor | None = None,
        correct: Tensor | None = None,
    ) -> Tensor:
        """Loss of the exit classifier against its oracle, weighted by ``classifier_weight``.

        The states are detached: the loss trains the classifier only.

        Args:
            hidden_states: N per-layer outputs (B, T, D) (``output_hidden_states=True``).
            token_loss: (N, B, T) per-layer, per-token loss of the agent's head (negative log
                likelihood or squared error); the likelihood oracle of ``geometric``,
                ``multinomial`` and ``sequence``.
            mask: (B, T) bool, tokens to train on (default all).
            consistent: (N, B, T) or (N - 1, B, T) bool, layer n's prediction agrees with the
                last layer's (:func:`consistency_labels`); the labels of ``classifier``.
            correct: (N, B, T) bool, layer n's prediction is correct: the correctness oracle
                (``oracle='correctness'``).
        Returns:
            0-d tensor (zero for the parameter-free ``softmax`` and ``saturation``).
        Raises:
            ValueError: ``hidden_states`` does not hold N entries, or the labels this confidence
                kind needs are missing (``consistent`` for ``classifier``; ``token_loss``, or
                ``correct`` with ``oracle='correctness'``, for the others with a classifier).
        """
        hs = [h.detach() for h in hidden_states]
        n = self.n_layers
        if len(hs) != n:
            raise ValueError(f"exit_classifier_loss: expected {n} hidden states, got {len(hs)}")
        b, t, _ = hs[0].shape
        m = torch.ones(b, t, dtype=torch.bool, device=hs[0].device) if mask is None else mask.to(torch.bool)
        mf = m.float()
        zero = hs[0].new_zeros(())
        if self.exit_classifier is None or n == 1:
            return zero
        w = self.cfg.classifier_weight
        if self.kind == "classifier":
            if consistent is None:
                raise ValueError("confidence='classifier' is trained on consistent=(N, B, T) labels (consistency_labels)")
            logits = torch.stack([self._binary(i, hs[i]) for i in range(n - 1)])  # (N-1, B, T)
            y = consistent[: n - 1].to(logits.dtype)
            bce = F.binary_cross_entropy_with_logits(logits.float(), y.float(), reduction="none")
            return w * (bce * mf).sum() / (mf.sum() * (n - 1)).clamp_min(1)
        score = self._oracle_score(token_loss, correct)  # (N, B, T), higher = better
        if self.kind == "geometric":
            nll = self._geometric_nll(hs, score, m)  # (B, T)
            return w * (nll * mf).sum() / mf.sum().clamp_min(1)
        level = "sequence" if self.kind == "sequence" else "token"
        target = oracle_depth(score, m, self.cfg.depth_penalty, self.cfg.oracle_sigma, level=level)
        logq = torch.log_softmax(self.depth_logits(hs[0], m).float(), -1)  # (B, T, N)
        if level == "sequence":
            ce = -logq[:, 0].gather(-1, target[:, :1])[:, 0]  # (B,): the row's depth distribution
            rows = m.any(1).float()
            return w * (ce * rows).sum() / rows.sum().clamp_min(1)
        ce = -logq.gather(-1, target[..., None])[..., 0]  # (B, T)
        return w * (ce * mf).sum() / mf.sum().clamp_min(1)

    def _geometric_nll(self, hs: list[Tensor], score: Tensor, m: Tensor) -> Tensor:
        """(B, T) -log q(n*) of Elbayad's geometric exit distribution ``q(n) = chi_n prod_{n'<n}
        (1 - chi_n')`` from the per-layer classifiers on the detached states ``hs``; n* is the
        oracle depth of ``score`` (N, B, T) over the tokens ``m`` (B, T)."""
        n = self.n_layers
        target = oracle_depth(score, m, self.cfg.depth_penalty, self.cfg.oracle_sigma)  # (B, T)
        chi_logit = torch.stack([self._binary(i, hs[i]) for i in range(n - 1)]).float()  # (N-1, B, T)
        log_chi, log_not = F.logsigmoid(chi_logit), F.logsigmoid(-chi_logit)
        cum_not = torch.cat([torch.zeros_like(log_not[:1]), log_not.cumsum(0)])  # (N, B, T): sum_{n'<n}
        log_q = cum_not + torch.cat([log_chi, torch.zeros_like(log_chi[:1])])  # (N, B, T) log q(n)
        return -log_q.gather(0, target[None])[0]  # (B, T)

    def _oracle_score(self, token_loss: Tensor | None, correct: Tensor | None) -> Tensor:
        if self.cfg.oracle == "correctness":
            if correct is None:
                raise ValueError("depth.oracle='correctness' needs correct=(N, B, T) bool")
            return correct.float()
        if token_loss is None:
            raise ValueError(f"depth.confidence={self.kind!r} with the likelihood oracle needs token_loss=(N, B, T)")
        return -token_loss.detach().float()


def oracle_depth(score: Tensor, mask: Tensor, penalty: float = 0.0, sigma: float = 0.0, level: str = "token") -> Tensor:
    """Elbayad et al. 2020 oracles (sec. 3.3): the best exit per token or per sequence.

    ``n* = argmax_n  S^n - penalty * n`` with S the log-likelihood (or correctness) of the
    exit-n prediction; token level optionally smoothed over time with
    ``kappa(t, t') = exp(-|t - t'|^2 / sigma)`` (masked tokens excluded); sequence level sums S
    over the row's valid tokens.

    Args:
        score: (N, B, T), higher = better.
        mask: (B, T) bool.
        penalty: lambda, per-layer cost favouring early exits (score units).
        sigma: RBF width of the temporal smoothing (0 = none).
        level: ``token`` or ``sequence``.
    Returns:
        (B, T) long 0-based exit layer (sequence level: the row's, broadcast over T).
    """
    n, b, t = score.shape
    s = score.float() * mask.float()
    if level == "sequence":
        s = s.sum(-1, keepdim=True).expand(n, b, t)  # (N, B, T): the row's total
    elif sigma > 0:
        d = torch.arange(t, device=score.device, dtype=torch.float32)
        kern = torch.exp(-((d[:, None] - d[None, :]) ** 2) / sigma)  # (T, T') kappa(t, t')
        s = torch.einsum("nbs,ts->nbt", s, kern)
    layers = torch.arange(1, n + 1, device=score.device, dtype=torch.float32).view(n, 1, 1)  # (N, 1, 1)
    return (s - penalty * layers).argmax(0)


# -- helpers for agents --------------------------------------------------------------------------
def with_final_norm(backbone: nn.Module, head: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``h -> head(backbone.final_norm(h))``: the exit head seeing what the backbone would output."""
    return lambda h: head(backbone.final_norm(h))


def exit_predictions(backbone: nn.Module, hidden_states: Sequence[Tensor], head: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """The head's prediction after every layer: ``head(final_norm(h^n))`` for n = 1..N.

    ``hidden_states`` comes from ``backbone(x, output_hidden_states=True)``; the last entry
    equals the full model's prediction.
    """
    return [head(backbone.final_norm(h)) for h in hidden_states]


def exit_loss(token_losses: Tensor, mask: Tensor | None = None, scheme: str = "weighted", generator: torch.Generator | None = None) -> Tensor:
    """Combine per-exit losses into one training loss.

    Args:
        token_losses: (N, B, T) loss of the head at every exit.
        mask: (B, T) bool, tokens that count (default all).
        scheme: ``weighted`` (CALM sec. 4: sum_n n L_n / sum_n n), ``uniform`` (Elbayad
            sec. 2.2 aligned training: mean over exits) or ``sampled`` (one uniformly random
            exit per token).
        generator: for ``sampled``.
    Returns:
        0-d tensor.
    Raises:
        ValueError: ``scheme`` is not one of :data:`SCHEMES`.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r}; choose one of {', '.join(SCHEMES)}")
    n, b, t = token_losses.shape
    m = torch.ones(b, t, device=token_losses.device) if mask is None else mask.to(token_losses.dtype)
    denom = m.sum().clamp_min(1)
    per_layer = (token_losses * m).sum((1, 2)) / denom  # (N,)
    if scheme == "uniform":
        return per_layer.mean()
    if scheme == "weighted":
        w = torch.arange(1, n + 1, device=token_losses.device, dtype=token_losses.dtype)
        return (w * per_layer).sum() / w.sum()
    pick = torch.randint(0, n, (b, t), device=token_losses.device, generator=generator)
    chosen = token_losses.gather(0, pick[None])[0]  # (B, T)
    return (chosen * m).sum() / denom


def consistency_labels(predictions: Sequence[Tensor], discrete: bool, tol: float = 0.0) -> Tensor:
    """(N, B, T) bool: exit n's prediction agrees with the last exit's.

    Discrete: same argmax of the logits (B, T, A); continuous: max |a^n - a^N| <= tol.
    """
    last = predictions[-1]
    return torch.stack([_agree(p, last, discrete, tol) for p in predictions])


def _agree(a: Tensor, b: Tensor, discrete: bool, tol: float) -> Tensor:
    if discrete:
        return a.argmax(-1) == b.argmax(-1)
    return (a - b).abs().amax(-1) <= tol


# -- calibration (CALM sec. 4, Learn-then-Test) ----------------------------------------------------
@dataclass
class Calibration:
    """Result of :func:`calibrate_threshold`.

    Attributes:
        threshold: the smallest accepted threshold (+inf: none was, never exit early).
        delta: tolerated inconsistency rate; epsilon: allowed failure probability.
        n: held-out decisions per candidate.
        risks: empirical inconsistency per tested candidate.
        p_values: Hoeffding p-value per tested candidate.
    """

    threshold: float
    delta: float
    epsilon: float
    n: int
    risks: dict[float, float] = field(default_factory=dict)
    p_values: dict[float, float] = field(default_factory=dict)


def hoeffding_p_value(risk: float, delta: float, n: int) -> float:
    """p-value of H0 "true risk > delta" given empirical risk over n samples (Hoeffding)."""
    if risk >= delta:
        return 1.0
    return math.exp(-2.0 * n * (delta - risk) ** 2)


def calibrate_threshold(
    evaluate: Callable[[float], Tensor], candidates: Iterable[float], delta: float = 0.05, epsilon: float = 0.05
) -> Calibration:
    """Learn-then-Test calibration of the exit threshold (CALM sec. 4; Angelopoulos et al. 2021).

    Candidates are tested from the largest (most conservative) down; a candidate is accepted
    when its Hoeffding p-value is at most ``epsilon``; testing stops at the first rejection
    (fixed-sequence testing controls the family-wise error at ``epsilon``). The smallest
    accepted threshold keeps the expected inconsistency at most ``delta`` with probability at
    least ``1 - epsilon``.

    Args:
        evaluate: ``threshold -> (n,) bool``, True where the early-exit decision agrees with
            the full model on held-out data (:func:`consistency_evaluator`).
        candidates: thresholds to try (any order).
        delta: tolerated inconsistency rate.
        epsilon: failure probability of the guarantee.
    Returns:
        :class:`Calibration`.
    """
    cal = Calibration(threshold=math.inf, delta=delta, epsilon=epsilon, n=0)
    for lam in sorted({float(c) for c in candidates}, reverse=True):
        ok = evaluate(lam).reshape(-1)
        cal.n = int(ok.numel())
        risk = 1.0 - float(ok.float().mean()) if ok.numel() else 1.0
        p = hoeffding_p_value(risk, delta, cal.n)
        cal.risks[lam], cal.p_values[lam] = risk, p
        if p > epsilon:
            break
        cal.threshold = lam
    return cal


def consistency_evaluator(
    backbone: nn.Module,
    head: Callable[[Tensor], Tensor],
    batches: Sequence[dict[str, Any]],
    discrete: bool,
    tol: float = 0.0,
) -> Callable[[float], Tensor]:
    """``threshold -> (n,) bool`` agreement of early-exit and full-model predictions.

    Args:
        backbone: a backbone with depth kind ``early_exit`` (in eval mode).
        head: the agent's head, ``(B, T, D) -> (B, T, A)`` on backbone outputs.
        batches: held-out ``Backbone.forward`` keyword arguments (``x`` and optionally
            ``positions``, ``mask``, ``exit_mask``...); the decisions compared are the tokens
            of ``exit_mask`` (else ``mask``, else all).
        discrete: compare argmax (True) or max-abs difference <= ``tol`` (False).
        tol: tolerance of the continuous comparison, in action units.
    Returns:
        ``evaluate(threshold)``: (n,) bool over every compared decision of all ``batches``;
        the full-model predictions are computed once, here.
    """
    full = []
    with torch.no_grad():
        for kw in batches:
            full.append(head(backbone(**kw).hidden))

    def evaluate(threshold: float) -> Tensor:
        agree = []
        with torch.no_grad():
            for kw, ref in zip(batches, full):
                pred = head(backbone(**kw, exit_head=with_final_norm(backbone, head), exit_threshold=threshold).hidden)
                sel = kw.get("exit_mask", kw.get("mask"))
                a = _agree(pred, ref, discrete, tol)
                agree.append(a[sel.to(torch.bool)] if sel is not None else a.reshape(-1))
        return torch.cat(agree)

    return evaluate


@DEPTH.register(
    "early_exit",
    description="Per-token early exit after any layer (confidence or exit classifier), exited states copied upward",
    paper="Elbayad et al. 2020, Depth-Adaptive Transformer (sec. 2-3); Schuster et al. 2022, CALM (sec. 3-4)",
    capabilities=Capabilities(memory=True, incremental=True, exact_chunking=True),
)
@dataclass(frozen=True)
class EarlyExitConfig(DepthConfig):
    """Early-exit depth.

    Attributes:
        confidence: ``classifier`` (default), ``softmax``, ``saturation``, ``geometric``,
            ``multinomial`` or ``sequence`` (module docstring).
        threshold: exit when confidence >= threshold; ``None`` = never (until calibrated with
            :meth:`EarlyExitDepth.set_threshold` or passed as ``exit_threshold=``).
        per_layer_classifier: one CALM classifier per layer instead of a shared one.
        classifier_weight: weight of :meth:`EarlyExitDepth.exit_classifier_loss`.
        oracle: ``likelihood`` or ``correctness`` (Elbayad's classifiers).
        depth_penalty: lambda of the oracles, >= 0 (a cost per layer: favours early exits).
        oracle_sigma: RBF smoothing width of the token-level oracle over time, in squared
            tokens (``kappa = exp(-|t - t'|^2 / sigma)``; 0 = none).

    Raises:
        ValueError: an unknown ``confidence`` or ``oracle``; ``threshold``, ``oracle_sigma``,
            ``depth_penalty`` or ``classifier_weight`` < 0.
    """

    confidence: str = "classifier"
    threshold: float | None = None
    per_layer_classifier: bool = False
    classifier_weight: float = 1.0
    oracle: str = "likelihood"
    depth_penalty: float = 0.0
    oracle_sigma: float = 0.0

    #: the exit classifiers are trained only by exit_classifier_loss.
    contract_no_grad = ("depth.exit_classifier*",)

    def __post_init__(self) -> None:
        if self.confidence not in CONFIDENCES:
            raise ValueError(f"depth.confidence={self.confidence!r}; choose one of {', '.join(CONFIDENCES)}")
        if self.oracle not in ORACLES:
            raise ValueError(f"depth.oracle={self.oracle!r}; choose one of {', '.join(ORACLES)}")
        if self.threshold is not None and self.threshold < 0:
            raise ValueError(f"depth.threshold must be >= 0, got {self.threshold}")
        if self.oracle_sigma < 0:
            raise ValueError(f"depth.oracle_sigma must be >= 0, got {self.oracle_sigma}")
        if self.depth_penalty < 0:
            # lambda is a cost per layer (Elbayad et al. sec. 3.3): a negative one rewards depth,
            # training the classifiers towards the last layer whatever the earlier ones predict
            raise ValueError(f"depth.depth_penalty must be >= 0 (a cost per layer that favours early exits; "
                             f"0: none), got {self.depth_penalty}")
        if self.classifier_weight < 0:
            # a negative weight trains the exit classifier to disagree with its oracle (gradient
            # ascent on its loss), which diverges; 0 leaves the classifier untrained
            raise ValueError(f"depth.classifier_weight must be >= 0 (0: the exit classifier is not trained), "
                             f"got {self.classifier_weight}")

    def build(self, ctx) -> DepthModule:
        return EarlyExitDepth(ctx, self)
