"""Attention kernels against their ground truth (module level), and the complexity contract.

- every ``exact`` kind x every positional kind it accepts equals ``reference_forward`` (dense
  masked softmax attention restricted to the kernel's ``pattern``) within 1e-5 in float32, on
  random inputs with causal/bidirectional masks, key padding, episode boundaries and (for kinds
  that take memory) prefix keys;
- every ``approximate`` kind that declares ``contract_convergence`` gets closer to dense
  attention as its budget grows;
- every kind's peak tensor size at L = 2048 and 4096 (PeakNumel) against the capabilities its
  configuration declares: a ``subquadratic`` one never materialises an L x L tensor and grows
  sub-quadratically, every one at most quadratically.
"""

from __future__ import annotations

import pytest
import torch
from contract_checks import assert_subquadratic, peak_numel
from contract_variants import BASE, B, D, T, caps_of, config_cls, kind_backbone, kind_fields, position_for

from rl_tformers.backbone_config import BackboneConfig, BuildContext
from rl_tformers.registry import ATTENTION, POSITION
from rl_tformers.types import AttnContext

M = 4  # memory/prefix keys in the prefix case


def _module(kind: str, position: str, seq_len: int = T, causal: bool = True, **fields):
    """(attention module of layer 0, its BackboneConfig), seeded."""
    cfg = dict(BASE)
    cfg["attention"] = {"kind": kind, **kind_fields("attention", kind, seq_len), **fields}
    cfg["position"] = {"kind": position}
    cfg["causal"] = causal
    for k, v in kind_backbone("attention", kind, seq_len).items():
        if k != "position":
            cfg[k] = v
    bcfg = BackboneConfig.from_dict(cfg)
    ctx = BuildContext(bcfg).at_layer(0)
    torch.manual_seed(4321)
    mod = bcfg.attention.build(ctx, bcfg.position.build(ctx))
    return mod.eval(), bcfg


def _accepted_positions(kind: str) -> list[str]:
    allowed = caps_of("attention", kind).positions
    return [p for p in POSITION.kinds() if allowed is None or p in allowed]


def _cases(caps) -> list[str]:
    out = []
    if caps.causal:
        out += ["causal", "causal_episodes"]
        if caps.memory:
            out.append("causal_prefix")
    if caps.bidirectional:
        out.append("bidirectional")
    return out


def _ctx_and_inputs(case: str, seq_len: int = T):
    """(x_q (B, T, D), x_kv (B, S, D), AttnContext) for one masking case."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B, seq_len, D, generator=g)
    pos = torch.arange(seq_len).expand(B, seq_len) + torch.tensor([[M], [M + 5]])  # caller positions, rows differ
    valid = torch.ones(B, seq_len, dtype=torch.bool)
    valid[0, -3:] = False  # right padding
    valid[1, :2] = False  # left padding
    if case == "causal":
        return x, x, AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=True)
    if case == "bidirectional":
        return x, x, AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=False)
    if case == "causal_episodes":
        starts = torch.zeros(B, seq_len, dtype=torch.long)
        starts[0, seq_len // 2] = 1  # a new episode in the middle of row 0
        seg = starts.cumsum(1)
        return x, x, AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, seg_q=seg, seg_k=seg, causal=True)
    if case == "causal_prefix":
        mem = torch.randn(B, M, D, generator=g)
        pos_m = torch.arange(-M, 0).expand(B, M) + pos[:, :1]
        valid_m = torch.ones(B, M, dtype=torch.bool)
        valid_m[1, :2] = False  # unfilled memory slots
        kv = torch.cat([mem, x], 1)  # (B, M + T, D)
        ctx = AttnContext(
            pos_q=pos, pos_k=torch.cat([pos_m, pos], 1), key_valid=torch.cat([valid_m, valid], 1), causal=True
        )
        return x, kv, ctx
    raise ValueError(case)


def _exact_params():
    params = []
    for e in ATTENTION:
        if not e.capabilities.exact:
            continue
        for p in _accepted_positions(e.kind):
            for case in _cases(e.capabilities):
                params.append(pytest.param(e.kind, p, case, id=f"{e.kind}-{p}-{case}"))
    return params


@pytest.mark.parametrize(("kind", "position", "case"), _exact_params())
def test_exact_kernel_equals_reference(kind: str, position: str, case: str):
    mod, _ = _module(kind, position, causal=case != "bidirectional")
    x_q, x_kv, ctx = _ctx_and_inputs(case)
    torch.manual_seed(0)
    with torch.no_grad():
        out = mod(x_q, x_kv, ctx).out
        ref = mod.reference_forward(x_q, x_kv, ctx).out
    valid_q = ctx.key_valid[:, ctx.k_len - ctx.q_len :]
    torch.testing.assert_close(out[valid_q], ref[valid_q], atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()


def test_reference_kind_is_checked_against_an_independent_computation():
    """The ground truth itself: reference_forward equals softmax(QK^T/sqrt(d) masked) V by hand."""
    mod, _ = _module("reference", "none")
    x, _, ctx = _ctx_and_inputs("causal")
    with torch.no_grad():
        got = mod.reference_forward(x, x, ctx).out
        q, k, v = mod.project(x, x)  # (B, H, T, Dh)
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, T, T)
        allowed = torch.ones(T, T).tril().bool()[None, None] & ctx.key_valid[:, None, None, :]
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        want = mod.o_proj((p @ v).transpose(1, 2).reshape(B, T, D))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def _approx_params():
    return [
        pytest.param(e.kind, id=e.kind)
        for e in ATTENTION
        if e.capabilities.approximate and hasattr(e.config_cls, "contract_convergence")
    ]


@pytest.mark.parametrize("kind", _approx_params())
def test_approximate_kernel_converges_to_dense(kind: str):
    caps = caps_of("attention", kind)
    budgets = list(config_cls("attention", kind).contract_convergence(T))
    assert len(budgets) >= 2, "contract_convergence must list at least two budgets"
    case = "causal" if caps.causal else "bidirectional"
    x_q, x_kv, ctx = _ctx_and_inputs(case)
    valid_q = ctx.key_valid[:, ctx.k_len - ctx.q_len :]
    errs = []
    for fields in budgets:
        mod, _ = _module(kind, position_for(caps), causal=caps.causal, **fields)
        with torch.no_grad():
            torch.manual_seed(0)
            out = mod(x_q, x_kv, ctx).out
            ref = mod.reference_forward(x_q, x_kv, ctx).out
        errs.append((out - ref)[valid_q].abs().mean().item())
    assert errs[-1] < 0.5 * errs[0], f"error to dense attention does not shrink with the budget: {errs}"


#: configurations measured besides each kind's contract_config: (kind, fields at every length);
#: a ``causal`` entry sets the mode (default: causal when the kind has a causal form)
EXTRA_CONFIGS = [
    ("blockwise", {"n_blocks": 2, "block": 0}),  # the paper's fixed n: L^2 / 2 per head, declared not subquadratic
    ("sinkhorn", {"sortcut": 2, "causal": False}),  # SortCut: S x 2b scores
    ("linformer", {"projection": "max_pool"}),
    ("linformer", {"projection": "conv"}),
]


def _complexity_params():
    params = [pytest.param(e.kind, None, id=e.kind) for e in ATTENTION]
    return params + [pytest.param(k, f, id=f"{k}-" + "-".join(f"{a}{b}" for a, b in f.items())) for k, f in EXTRA_CONFIGS]


def _peaks(kind: str, fields: dict | None, lengths: tuple[int, int]):
    """(whether the configuration declares ``subquadratic``, run_at(L)) for ``kind`` with its
    contract_config at each length updated by ``fields``; run_at is one forward pass at batch 1
    with 5 padded keys."""
    caps = caps_of("attention", kind)
    position = "none" if caps.positions is None or "none" in caps.positions else position_for(caps)
    fields = dict(fields or {})
    causal = fields.pop("causal", caps.causal)

    def build(n: int):
        return _module(kind, position, seq_len=n, causal=causal, **fields)

    def run_at(n: int) -> None:
        mod, _ = build(n)
        x = torch.randn(1, n, D)
        pos = torch.arange(n)[None]
        valid = torch.ones(1, n, dtype=torch.bool)
        valid[0, -5:] = False
        ctx = AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=causal)
        with torch.no_grad():
            mod(x, x, ctx)

    declared = {build(n)[1].attention.config_capabilities().subquadratic for n in lengths}
    assert len(declared) == 1, f"{kind}: the configuration declares subquadratic differently at L = {lengths}"
    return declared.pop(), run_at


@pytest.mark.parametrize(("kind", "fields"), _complexity_params())
def test_peak_tensor_growth_matches_the_declared_capability(kind: str, fields: dict | None):
    """Every attention kind (its contract configuration, and the EXTRA_CONFIGS): the largest
    tensor any op produces in a forward pass (PeakNumel) at L = 2048 and 4096. A configuration
    whose ``config_capabilities()`` declare ``subquadratic`` never builds an L x L tensor and
    grows at most 3.2x (L log L ~2.2x, L^1.5 ~2.8x); every kind grows at most quadratically
    (4x, with a margin for the linear terms)."""
    lengths = (2048, 4096)
    try:
        subquadratic, run_at = _peaks(kind, fields, lengths)
        if subquadratic:
            assert_subquadratic(run_at, lengths)
            return
        p1, _ = peak_numel(lambda: run_at(lengths[0]))
        p2, op2 = peak_numel(lambda: run_at(lengths[1]))
    except AssertionError:
        raise
    except Exception as exc:  # the message is the point
        pytest.fail(
            f"attention kind {kind!r} cannot run at L = 2048 / 4096 with fields "
            f"{fields or kind_fields('attention', kind, 4096)} ({type(exc).__name__}: {exc}); size it for the test "
            f"length in its config's contract_config(seq_len)"
        )
    assert p2 <= 4.2 * p1, f"{kind}: peak tensor grows {p2 / p1:.2f}x from L = 2048 to 4096 (op {op2}): beyond quadratic"


def test_blockwise_with_fixed_n_blocks_is_declared_and_measured_quadratic():
    """BlockBERT with the paper's fixed n_blocks: blocks of L / n keys, so the score blocks grow
    as L^2 / n (4x from L to 2L); its configuration does not declare subquadratic, while a
    fixed block length does (and grows 2x)."""
    lengths = (2048, 4096)
    subquadratic, run_at = _peaks("blockwise", {"n_blocks": 2, "block": 0}, lengths)
    assert not subquadratic
    p1, _ = peak_numel(lambda: run_at(lengths[0]))
    p2, _ = peak_numel(lambda: run_at(lengths[1]))
    assert p2 >= 3.9 * p1 and p2 >= lengths[1] ** 2 // 2
    subquadratic, run_at = _peaks("blockwise", {"n_blocks": 2, "block": 64}, lengths)
    assert subquadratic
    p1, _ = peak_numel(lambda: run_at(lengths[0]))
    p2, _ = peak_numel(lambda: run_at(lengths[1]))
    assert p2 <= 2.05 * p1


def test_cases_cover_every_registered_exact_kind():
    exact = {e.kind for e in ATTENTION if e.capabilities.exact}
    covered = {p.values[0] for p in _exact_params()}
    assert exact == covered and {"sdpa", "reference"} <= covered
