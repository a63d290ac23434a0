"""Fixed-pattern sparse kernels (local, local_2d, strided, fixed, blockwise, etc, sliding_window,
longformer, bigbird, adaptive_span) against dense attention.

Every expected mask here is written independently of the kernels, from the papers'
definitions, with Python loops over (query, key) pairs; the kernels never build such a mask.
Checks: equality with dense masked attention (1e-5, float32, padding, episodes, prefix keys,
several positional kinds), the special cases of issue 7 (window >= L, identity permutation,
all-global, z = S), causality (exact zero Jacobian to the future), padding invariance, finite
empty rows (also bf16), incremental decoding with bounded caches, construction refusals.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.attention.base import attention_reference
from rl_tformers.backbone_config import BuildContext, IncompatibleConfig
from rl_tformers.types import AttnContext

D, H = 16, 4


def build(kind: str, causal: bool, position: str = "none", layer: int = 0, n_heads: int = H, **fields):
    cfg = BackboneConfig(
        d_model=D, n_heads=n_heads, n_layers=2, attn_dropout=0.0, causal=causal,
        attention={"kind": kind, **fields}, position={"kind": position},
    )
    ctx = BuildContext(cfg, layer)
    torch.manual_seed(7)
    return cfg.attention.build(ctx, cfg.position.build(ctx)).eval()


def inputs(t: int, m: int = 0, b: int = 2, episodes: bool = True, seed: int = 0):
    """x_q (B, T, D), x_kv (B, M + T, D) and the context pieces (padding, an episode boundary)."""
    g = torch.Generator().manual_seed(seed)
    s = m + t
    x_kv = torch.randn(b, s, D, generator=g)
    pos = torch.arange(s).expand(b, s) + torch.arange(b)[:, None] * 3  # caller positions, rows differ
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[0, -2:] = False  # right padding
    valid[-1, m : m + 2] = False  # left padding of the segment
    seg = None
    if episodes:
        seg = torch.zeros(b, s, dtype=torch.long)
        seg[0, m + t // 2 :] = 1  # a new episode in the middle of row 0
    return x_kv[:, m:], x_kv, pos, valid, seg


def context(pos, valid, seg, t: int, causal: bool) -> AttnContext:
    m = pos.shape[1] - t
    return AttnContext(
        pos_q=pos[:, m:], pos_k=pos, key_valid=valid, causal=causal,
        seg_q=None if seg is None else seg[:, m:], seg_k=seg,
    )


def dense(mod, x_q, x_kv, ctx: AttnContext, pattern: torch.Tensor | None) -> torch.Tensor:
    """Dense masked softmax attention with the module's projections and positional hooks;
    ``pattern`` (1|B, 1|H, T, S) bool is ANDed with causality, padding and episodes."""
    q, k, v = mod.project(x_q, x_kv)  # (B, H, T, Dh), (B, H, S, Dh)
    pos = mod.position
    bias = pos.score_bias(q, ctx.pos_q, ctx.pos_k) if pos.additive_bias else None
    q = pos.rotate(pos.content_query(q), ctx.pos_q)
    k = pos.rotate(k, ctx.pos_k)
    allowed = ctx.allowed() if pattern is None else ctx.allowed() & pattern
    out, _ = attention_reference(
        q, k, v, allowed, scale=mod.scale, bias=bias,
        transform=(lambda sc: pos.transform_scores(sc, ctx.pos_q, ctx.pos_k)) if pos.transforms_scores else None,
        value_term=(lambda p: pos.value_term(p, ctx.pos_q, ctx.pos_k)) if pos.value_bias else None,
    )
    return mod.o_proj(mod.merge_heads(out))


def loop_mask(t: int, s: int, heads: int, rule) -> torch.Tensor:
    """(1, heads, T, S) bool from ``rule(h, a, j)`` with a, j absolute key indices (a = M + i)."""
    m = s - t
    out = torch.zeros(1, heads, t, s, dtype=torch.bool)
    for h in range(heads):
        for i in range(t):
            for j in range(s):
                out[0, h, i, j] = bool(rule(h, m + i, j))
    return out


# --------------------------------------------------------------------------------------------
# Independent pattern definitions (papers' formulas); causal restriction j <= a comes from ctx
# --------------------------------------------------------------------------------------------
def rule_local(block, memory, causal):
    def rule(h, a, j):
        start = (a // block) * block  # the query block [start, start + block)
        hi = start + block + (0 if causal else memory)
        return start - memory <= j < hi

    return rule


def rule_local_2d(width, qs, fl, causal):
    def rule(h, a, j):
        ra, ca, rj, cj = a // width, a % width, j // width, j % width
        top, left = (ra // qs[0]) * qs[0], (ca // qs[1]) * qs[1]
        rows = top - fl[0] <= rj < top + qs[0] + (0 if causal else fl[0])
        return rows and left - fl[1] <= cj < left + qs[1] + fl[1]

    return rule


def rule_strided(stride, plan, causal):
    def rule(h, a, j):
        a1 = 0 <= a - j <= stride if causal else abs(a - j) <= stride  # A1: the previous l (and i)
        a2 = (a - j) % stride == 0  # A2: every l-th back
        return {"a1": a1, "a2": a2, "union": a1 or a2}[plan[h]]

    return rule


def rule_fixed(stride, c, plan):
    def rule(h, a, j):
        a1 = a // stride == j // stride  # own block
        a2 = j % stride >= stride - c  # summary positions
        return {"a1": a1, "a2": a2, "union": a1 or a2}[plan[h]]

    return rule


def rule_window(window, dilations, causal, globals_=()):
    def rule(h, a, j):
        if a in globals_ or j in globals_:
            return True
        d, diff = dilations[h], a - j
        if diff % d:
            return False
        return 0 <= diff // d <= window - 1 if causal else abs(diff // d) <= window // 2

    return rule


def rule_blockwise(n, b, shifts):
    return lambda h, a, j: j // b == (a // b + shifts[h]) % n


def rule_etc(radius, g, g2l_segment=0):
    def rule(h, a, j):
        qg, kg = a in g, j in g
        if not qg and not kg:
            return abs(a - j) <= radius  # l2l
        if not qg:
            return True  # l2g
        if kg:
            return True  # g2g
        return (a < j < a + g2l_segment) if g2l_segment else True  # g2l

    return rule


POSITIONS = ["none", "rotary", "alibi", "shaw"]


def check(kind, fields, rule_for, causal, t=14, m=0, positions=POSITIONS, layer=0, heads=H):
    """Kernel == dense attention with the independently built mask, for every positional kind."""
    x_q, x_kv, pos, valid, seg = inputs(t, m)
    ctx = context(pos, valid, seg, t, causal)
    for p in positions:
        mod = build(kind, causal, p, layer=layer, n_heads=heads, **fields)
        with torch.no_grad():
            got = mod(x_q, x_kv, ctx).out
            want = dense(mod, x_q, x_kv, ctx, loop_mask(t, m + t, heads, rule_for(mod)))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda s, p=p: f"{kind} {fields} {p}: {s}")


# --------------------------------------------------------------------------------------------
# Equality with dense attention under the papers' masks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("m", [0, 3])
def test_local_1d_equals_dense_with_block_mask(causal, m):
    check("local", {"block": 4, "memory": 3}, lambda mod: rule_local(4, 3, causal), causal, m=m)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("m", [0, 3])
def test_local_2d_equals_dense_with_rectangle_mask(causal, m):
    f = {"width": 5, "query_shape": (2, 3), "flange": (1, 2)}
    check("local_2d", f, lambda mod: rule_local_2d(5, (2, 3), (1, 2), causal), causal, m=m)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["union", "interleaved", "heads"])
def test_strided_equals_dense_with_factorised_mask(causal, mode):
    for layer in (0, 1):  # interleaved: layer 0 uses A1, layer 1 A2
        fields = {"stride": 3, "mode": mode}
        if mode == "heads":
            fields["head_patterns"] = ("a1", "a2", "union", "a2")
        check("strided", fields, lambda mod: rule_strided(3, mod.plan, causal), causal, m=2, layer=layer)
    assert build("strided", True, mode="interleaved", layer=1).plan == ["a2"] * H


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["union", "interleaved", "heads"])
def test_fixed_equals_dense_with_factorised_mask(causal, mode):
    for layer in (0, 1):
        check("fixed", {"stride": 4, "summary": 2, "mode": mode}, lambda mod: rule_fixed(4, 2, mod.plan), causal,
              m=2, layer=layer)
    assert build("fixed", True, stride=4, mode="heads").plan == ["a1", "a2", "a1", "a2"]


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_with_dilated_heads_and_per_layer_sizes(causal):
    fields = {"window": (5, 3), "dilation": (1, 2), "dilated_heads": 2}
    check("sliding_window", fields, lambda mod: rule_window(5, [1, 1, 1, 1], causal), causal, m=3, layer=0)
    check("sliding_window", fields, lambda mod: rule_window(3, [1, 1, 2, 2], causal), causal, m=3, layer=1)


def test_longformer_window_plus_global_tokens():
    t = 14
    g = {0, 13, 6}  # segment indices (0, -1, 6) at M = 0
    fields = {"window": 4, "dilation": 2, "global_tokens": (0, -1, 6)}
    check("longformer", fields, lambda mod: rule_window(4, [2] * H, False, g), False, t=t)


def test_blockwise_shifted_permutations_per_head():
    t, m = 14, 1  # S = 15 keys in n = 3 blocks of 5
    fields = {"n_blocks": 3, "heads_per_shift": (2, 1, 1)}
    check("blockwise", fields, lambda mod: rule_blockwise(3, 5, [0, 0, 1, 2]), False, t=t, m=m)
    check("blockwise", {"n_blocks": 2, "block": 4}, lambda mod: rule_blockwise(4, 4, [0, 0, 1, 1]), False, t=t, m=m)


def test_etc_four_pieces_full_and_segment_g2l():
    check("etc", {"radius": 2, "global_tokens": (0, 7)}, lambda mod: rule_etc(2, {0, 7}), False)
    fields = {"radius": 1, "global_tokens": (), "global_every": 4, "g2l": "segment"}
    check("etc", fields, lambda mod: rule_etc(1, {0, 4, 8, 12}, g2l_segment=4), False)


def test_bigbird_window_blocks_without_random_and_globals():
    def rule(mod):
        return lambda h, a, j: abs(j // 2 - a // 2) <= 1 or a == 0 or j == 0

    check("bigbird", {"block": 2, "random_blocks": 0, "global_tokens": (0,)}, rule, False)


def test_bigbird_random_blocks_are_distinct_outside_the_window_and_fixed():
    mod = build("bigbird", False, block=2, random_blocks=3, global_tokens=())
    pat1 = mod.pattern(context(*inputs(40)[2:], 40, False))[0, 0]
    pat2 = mod.pattern(context(*inputs(40)[2:], 40, False))[0, 0]
    assert torch.equal(pat1, pat2)  # the draw is fixed: a rollout and its update see one function
    for i in range(40):
        blocks = {j // 2 for j in range(40) if pat1[i, j]}
        window = {b for b in blocks if abs(b - i // 2) <= 1}
        assert len(blocks - window) == 3  # exactly r random blocks outside the window
    other_layer = build("bigbird", False, layer=1, block=2, random_blocks=3, global_tokens=())
    assert not torch.equal(other_layer.pattern(context(*inputs(40)[2:], 40, False))[0, 0], pat1)
    # the kernel follows the same draw
    x_q, x_kv, pos, valid, seg = inputs(40)
    ctx = context(pos, valid, seg, 40, False)
    with torch.no_grad():
        torch.testing.assert_close(mod(x_q, x_kv, ctx).out, dense(mod, x_q, x_kv, ctx, mod.pattern(ctx)), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# The special cases of issue 7: equal to the dense kernel itself
# --------------------------------------------------------------------------------------------
def sdpa_twin(mod, causal: bool, position: str = "none"):
    """A dense ``sdpa`` module with the same projection weights."""
    twin = build("sdpa", causal, position)
    twin.load_state_dict(mod.state_dict(), strict=False)
    return twin


@pytest.mark.parametrize(
    ("kind", "fields", "causal"),
    [
        ("local", {"block": 20, "memory": 0}, True),  # window >= L
        ("local", {"block": 8, "memory": 20}, False),
        ("sliding_window", {"window": 20}, True),
        ("sliding_window", {"window": 40}, False),
        ("local_2d", {"width": 4, "query_shape": (5, 4), "flange": (0, 0)}, True),
        ("longformer", {"window": 2, "global_tokens": tuple(range(14))}, False),  # all global
        ("bigbird", {"block": 2, "random_blocks": 1, "global_tokens": tuple(range(14))}, False),
        ("etc", {"radius": 0, "global_tokens": tuple(range(14))}, False),
        ("adaptive_span", {"max_span": 20, "init": 1.0}, True),  # z = S
        ("adaptive_span", {"max_span": 20, "init": 1.0}, False),
        ("adaptive_span", {"max_span": 20, "ramp": 4, "init": 1.0, "dynamic": True}, True),
        ("strided", {"stride": 1}, True),  # l = 1: every key is in A2
    ],
)
@pytest.mark.parametrize("position", ["none", "rotary", "alibi"])
def test_degenerate_patterns_equal_the_dense_sdpa_kernel(kind, fields, causal, position):
    t = 14
    mod = build(kind, causal, position, **fields)
    if fields.get("dynamic"):
        with torch.no_grad():
            mod.span_proj.bias.fill_(30.0)  # sigmoid -> 1: z_t = S
    x_q, x_kv, pos, valid, seg = inputs(t)
    ctx = context(pos, valid, seg, t, causal)
    with torch.no_grad():
        got = mod(x_q, x_kv, ctx).out
        want = sdpa_twin(mod, causal, position)(x_q, x_kv, ctx).out
    rows = valid  # padded query rows are unspecified for sdpa (no key at all in causal rows)
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=0)


def test_blockwise_identity_permutation_is_block_diagonal_dense():
    t = 12
    mod = build("blockwise", False, n_blocks=3, heads_per_shift=(H,))
    x_q, x_kv, pos, valid, seg = inputs(t)
    ctx = context(pos, valid, seg, t, False)
    blk = torch.arange(t) // 4
    block_diag = (blk[:, None] == blk[None, :])[None, None]  # (1, 1, T, T)
    with torch.no_grad():
        torch.testing.assert_close(mod(x_q, x_kv, ctx).out, dense(mod, x_q, x_kv, ctx, block_diag), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------------
# Adaptive span: soft mask formula, penalty, metrics, gradients
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dynamic", [False, True])
def test_adaptive_span_equals_the_soft_mask_formula(causal, dynamic):
    """a_ij = m_z(i - j) exp(s_ij) / sum_r m_z(i - r) exp(s_ir), m_z(x) = clip((R + z - x) / R, 0, 1)."""
    t, m, S, R = 14, 3, 9, 3.0
    mod = build("adaptive_span", causal, max_span=S, ramp=int(R), init=0.3, dynamic=dynamic)
    with torch.no_grad():
        if dynamic:
            mod.span_proj.weight.normal_(0, 0.5)
        else:
            mod.span.copy_(torch.tensor([0.0, 0.25, 0.6, 1.7]))  # the last one clamps to z = S
    x_q, x_kv, pos, valid, seg = inputs(t, m)
    ctx = context(pos, valid, seg, t, causal)
    with torch.no_grad():
        got = mod(x_q, x_kv, ctx).out
        q, k, v = mod.project(x_q, x_kv)
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, S)
        if dynamic:
            z = S * torch.sigmoid(x_q @ mod.span_proj.weight.t() + mod.span_proj.bias).transpose(1, 2)[..., None]
        else:
            z = S * mod.span.clamp(0, 1).view(1, H, 1, 1)
        a = torch.arange(t)[:, None] + m
        j = torch.arange(m + t)[None, :]
        x = (a - j).abs().float()
        w = ((R + z - x) / R).clamp(0, 1) * (x < S) * ctx.allowed()  # soft mask times the hard mask
        e = w * torch.exp(s - s.amax(-1, keepdim=True))
        p = e / e.sum(-1, keepdim=True).clamp_min(1e-30)
        want = mod.o_proj(mod.merge_heads(p @ v))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(mod.reference_forward(x_q, x_kv, ctx).out, want, atol=1e-5, rtol=0)


def test_adaptive_span_penalty_metrics_and_span_gradient():
    mod = build("adaptive_span", True, max_span=16, ramp=4, init=0.25, loss_coef=0.01).train()
    x_q, x_kv, pos, valid, seg = inputs(12)
    out = mod(x_q, x_kv, context(pos, valid, seg, 12, True))
    assert set(out.aux) == {"span_l1"} and set(out.metrics) == {"span", "span_max"}
    torch.testing.assert_close(out.aux["span_l1"], torch.tensor(0.01 * H * 4.0))  # lambda * sum_h z_h
    assert float(out.metrics["span"]) == pytest.approx(4.0)
    (out.out.square().sum() + out.aux["span_l1"]).backward()
    assert mod.span.grad is not None and torch.isfinite(mod.span.grad).all() and mod.span.grad.abs().sum() > 0
    # the span clamps to [0, S] in value but keeps a gradient (straight-through), as the
    # paper's in-place clamp after each step does
    with torch.no_grad():
        mod.span.fill_(-0.5)
    mod.zero_grad()
    out = mod(x_q, x_kv, context(pos, valid, seg, 12, True))
    assert float(out.metrics["span"]) == 0.0
    out.aux["span_l1"].backward()
    torch.testing.assert_close(mod.span.grad, torch.full((H,), 0.01 * 16.0))


def test_adaptive_span_computes_only_the_spans_it_needs():
    mod = build("adaptive_span", True, max_span=64, ramp=4, init=0.0)
    z = mod.spans(torch.zeros(1, 3, D))
    assert mod.width(z) == 4  # ceil(max z) + R keys, not S
    with torch.no_grad():
        mod.span.fill_(0.5)
    assert mod.width(mod.spans(torch.zeros(1, 3, D))) == 36


# --------------------------------------------------------------------------------------------
# Causality, padding, empty rows, incremental decoding, construction
# --------------------------------------------------------------------------------------------
CAUSAL_KINDS = {
    "local": {"block": 4, "memory": 3},
    "local_2d": {"width": 4, "query_shape": (2, 2), "flange": (1, 1)},
    "strided": {"stride": 3},
    "fixed": {"stride": 3, "summary": 1},
    "sliding_window": {"window": 4, "dilation": 2, "dilated_heads": 1},
    "adaptive_span": {"max_span": 6, "ramp": 2, "init": 0.5},
}
BIDIRECTIONAL_ONLY = {
    "blockwise": {"n_blocks": 3, "heads_per_shift": (0, 1, 1)},  # the backbones here have 2 heads
    "etc": {"radius": 2},
    "longformer": {"window": 4},
    "bigbird": {"block": 2, "random_blocks": 1},
}
ALL_KINDS = {**CAUSAL_KINDS, **BIDIRECTIONAL_ONLY}


def backbone(kind, causal, **over):
    cfg = {"d_model": D, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": causal,
           "attention": {"kind": kind, **ALL_KINDS[kind]}}
    cfg.update(over)
    torch.manual_seed(3)
    return Backbone(cfg).eval()


@pytest.mark.parametrize("kind", sorted(CAUSAL_KINDS))
def test_zero_jacobian_to_the_future(kind):
    bb = backbone(kind, True, position={"kind": "rotary"})
    x = torch.randn(2, 10, D, requires_grad=True)
    out = bb(x).hidden  # (B, T, D)
    w = torch.randn_like(out)
    for t in range(10):  # row t of the Jacobian, contracted with random output weights
        (g,) = torch.autograd.grad((out[:, t] * w[:, t]).sum(), x, retain_graph=True)
        assert torch.equal(g[:, t + 1 :], torch.zeros_like(g[:, t + 1 :]))  # exactly zero, not small
        assert t == 0 or g[:, :t].abs().sum() > 0  # and the past does matter


@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
def test_padding_invariance_and_finite_empty_rows(kind):
    causal = kind in CAUSAL_KINDS
    bb = backbone(kind, causal)
    x = torch.randn(2, 13, D)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 9:] = False
    mask[1, :3] = False
    garbage = x.clone()
    garbage[~mask] = 1e3 * torch.randn(int((~mask).sum()), D)
    with torch.no_grad():
        a, b = bb(x, mask=mask).hidden, bb(garbage, mask=mask).hidden
    torch.testing.assert_close(a[mask], b[mask], atol=1e-5, rtol=0)
    # a row with no valid key at all: finite, and the attention output is exactly zero
    mod = bb.blocks[0].attn
    pos = torch.arange(13)[None].expand(2, 13)
    ctx = AttnContext(pos_q=pos, pos_k=pos, key_valid=torch.zeros(2, 13, dtype=torch.bool), causal=causal)
    with torch.no_grad():
        out = mod(x, x, ctx).out
        torch.testing.assert_close(out, mod.o_proj.bias.expand_as(out), atol=0, rtol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out16 = mod(x, x, ctx).out
    assert torch.isfinite(out16).all()


@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
def test_bf16_autocast_forward_backward_is_finite(kind):
    bb = backbone(kind, kind in CAUSAL_KINDS).train()
    x = torch.randn(2, 20, D, requires_grad=True)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :5] = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bb(x, mask=mask).hidden
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all() and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kind", sorted(CAUSAL_KINDS))
def test_incremental_decoding_equals_full_pass_with_a_bounded_cache(kind):
    bb = backbone(kind, True, position={"kind": "alibi"})
    x = torch.randn(2, 23, D)
    full = bb(x).hidden
    st = bb.initial_state(2)
    outs = []
    with torch.no_grad():
        for t in range(0, 23, 2):  # chunks of 2 tokens, then 1
            o = bb(x[:, t : t + 2], state=st)
            st, _ = o.state, outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)
    lookback = bb.blocks[0].attn.lookback()
    kept = st.layers[0].cache.k.shape[2]
    assert kept == (23 if lookback is None else min(23, lookback))


@pytest.mark.parametrize("kind", sorted(BIDIRECTIONAL_ONLY))
def test_kinds_without_causal_form_are_refused_causally_pointing_at_last_action(kind):
    with pytest.raises(IncompatibleConfig, match="last_action"):
        Backbone({"d_model": D, "n_heads": 2, "causal": True, "attention": {"kind": kind}})
    with pytest.raises(NotImplementedError):
        backbone(kind, False).initial_state(1)  # no incremental form


def test_configuration_errors_name_the_option():
    with pytest.raises(IncompatibleConfig, match="window has 3 per-layer values"):
        Backbone({"d_model": D, "n_layers": 2, "attention": {"kind": "sliding_window", "window": [4, 8, 16]}})
    with pytest.raises(IncompatibleConfig, match="n_heads >= 2"):
        Backbone({"d_model": D, "n_heads": 1, "attention": {"kind": "strided", "mode": "heads"}})
    with pytest.raises(IncompatibleConfig, match="heads_per_shift"):
        Backbone({"d_model": D, "n_heads": 2, "causal": False, "attention": {"kind": "blockwise", "heads_per_shift": [1, 2]}})
    with pytest.raises(Exception, match="global_every"):
        Backbone({"d_model": D, "causal": False, "attention": {"kind": "etc", "g2l": "segment"}})
    with pytest.raises(Exception, match="summary"):
        Backbone({"d_model": D, "attention": {"kind": "fixed", "stride": 4, "summary": 5}})


# --------------------------------------------------------------------------------------------
# Inside the agents' backbones: one override, T = 60 (DT: 3 tokens x K = 20), with memory
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(ALL_KINDS))
def test_default_config_trains_at_dt_length_and_with_xl_memory(kind):
    causal = kind in CAUSAL_KINDS
    cfg = {"d_model": 32, "n_layers": 2, "n_heads": 2, "causal": causal, "attention": {"kind": kind}}
    bb = Backbone(cfg)  # the kind's defaults, one override
    x = torch.randn(3, 60, 32, requires_grad=True)
    mask = torch.ones(3, 60, dtype=torch.bool)
    mask[0, :12] = False
    out = bb(x, mask=mask)
    (out.hidden[mask].square().mean() + sum(out.aux.values(), torch.zeros(()))).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bb.parameters())
    mem = Backbone({**cfg, "memory": {"kind": "xl", "mem_len": 30}, "dropout": 0.0, "attn_dropout": 0.0}).eval()
    st = mem.initial_state(3)
    with torch.no_grad():
        o1 = mem(x[:, :30], state=st)
        o2 = mem(x[:, 30:], state=o1.state)
    assert torch.isfinite(o2.hidden).all()
    assert (o2.hidden - mem(x[:, 30:]).hidden).abs().max() > 1e-4  # the memory is attended
