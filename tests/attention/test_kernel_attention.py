"""Content-based, low-rank and kernel attention kinds: lsh, routing, linformer, rfa, performer, sinkhorn.

Exactness in the limits the papers give (1e-5), convergence to dense attention as the budget
grows, causality/padding/finiteness, incremental decoding, the float32 linear-attention scan
against a token loop, explicit-only random-feature redraws, routing's EMA step, use inside the
backbone (DT-like and GTrXL-like), and the complexity contract at L = 16384.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rl_tformers import Backbone
from rl_tformers.attention._linear import (
    causal_linear,
    maybe_redraw_random_features,
    orthogonal_gaussian,
    redraw_random_features,
)
from rl_tformers.backbone_config import BackboneConfig, BuildContext, IncompatibleConfig
from rl_tformers.registry import ATTENTION
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from rl_tformers.types import AttnContext, BackboneState
from tests.contracts.contract_checks import (
    assert_causal,
    assert_finite_grads,
    assert_padding_invariant,
    peak_numel,
)
from tests.runtime.ddp_helpers import read_metrics, two_ranks

KINDS = ("lsh", "routing", "linformer", "rfa", "performer", "sinkhorn")
D, H = 16, 2
SMALL = {
    "lsh": {"bucket_size": 4, "n_buckets": 4, "seed": 0},
    "routing": {"n_clusters": 3, "local_window": 4, "cluster_window": 4, "seed": 0},
    "linformer": {"k": 8, "max_len": 64},
    "rfa": {"chunk_size": 4, "seed": 0},
    "performer": {"chunk_size": 4, "seed": 0},
    "sinkhorn": {"block_size": 4, "max_len": 64},
}


def attn_module(kind: str, causal: bool = True, position: str = "none", torch_seed: int = 0, **fields):
    """Layer-0 attention module of a small backbone config (eval mode, seeded)."""
    cfg = BackboneConfig.from_dict(
        {"d_model": D, "n_layers": 1, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "causal": causal,
         "position": {"kind": position}, "attention": {"kind": kind, **fields}}
    )
    ctx = BuildContext(cfg).at_layer(0)
    torch.manual_seed(torch_seed)
    return cfg.attention.build(ctx, cfg.position.build(ctx)).eval()


def backbone(kind: str, causal: bool = True, **over) -> Backbone:
    cfg = {"d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "causal": causal,
           "attention": {"kind": kind, **SMALL[kind]}}
    cfg.update(over)
    torch.manual_seed(0)
    return Backbone(cfg)


def contexts(t: int = 23, causal: bool = True, prefix: int = 0):
    """(x_q, x_kv, ctx) cases: plain; padding + two episodes; prefix keys (memory)."""
    g = torch.Generator().manual_seed(3)
    s = t + prefix
    x = torch.randn(2, s, D, generator=g)
    pos = torch.arange(s).expand(2, s) + 3
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[1, :4] = False
    seg = torch.zeros(2, s, dtype=torch.long)
    seg[0, s // 2 :] = 1
    return [
        (x[:, prefix:], x, AttnContext(pos_q=pos[:, prefix:], pos_k=pos, causal=causal)),
        (x[:, prefix:], x, AttnContext(pos_q=pos[:, prefix:], pos_k=pos, key_valid=valid, seg_q=seg[:, prefix:],
                                       seg_k=seg, causal=causal)),
    ]


def valid_queries(ctx: AttnContext) -> torch.Tensor:
    if ctx.key_valid is None:
        return torch.ones(ctx.pos_q.shape, dtype=torch.bool)
    return ctx.key_valid[:, ctx.k_len - ctx.q_len :]


# -- registration --------------------------------------------------------------------------------
def test_kinds_are_registered_with_honest_capabilities():
    caps = {k: ATTENTION.get(k).capabilities for k in KINDS}
    assert not caps["linformer"].causal and caps["linformer"].bidirectional
    assert all(caps[k].causal for k in KINDS if k != "linformer")
    assert {k for k in KINDS if caps[k].incremental} == {"rfa", "performer"}
    assert {k for k in KINDS if caps[k].memory} == {"lsh", "routing", "rfa", "performer"}
    assert {k for k in KINDS if caps[k].approximate} == {"lsh", "linformer", "rfa", "performer"}
    assert all(caps[k].subquadratic and not caps[k].exact for k in KINDS)
    assert all(caps[k].positions is not None and "alibi" not in caps[k].positions for k in KINDS)
    for k in KINDS:
        assert ATTENTION.get(k).paper and ATTENTION.get(k).description


@pytest.mark.parametrize("kind", KINDS)
def test_score_based_positions_are_refused(kind):
    with pytest.raises(IncompatibleConfig, match="position"):
        Backbone({"d_model": D, "n_heads": H, "causal": kind != "linformer", "position": {"kind": "alibi"},
                  "attention": {"kind": kind}})


def test_causal_refusals_name_the_option():
    with pytest.raises(IncompatibleConfig, match="last_action"):
        Backbone({"d_model": D, "n_heads": H, "causal": True, "attention": {"kind": "linformer"}})
    with pytest.raises(IncompatibleConfig, match="gate"):
        Backbone({"d_model": D, "n_heads": H, "causal": False, "attention": {"kind": "rfa", "gate": True}})
    with pytest.raises(IncompatibleConfig, match="assignment"):
        Backbone({"d_model": D, "n_heads": H, "causal": True, "attention": {"kind": "routing", "assignment": "topk"}})


# -- exact limits ---------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("prefix", [0, 6])
def test_lsh_one_bucket_one_round_equals_dense_with_the_no_self_rule(causal, prefix):
    mod = attn_module("lsh", causal, position="rotary", n_buckets=1, n_hashes=1, bucket_size=64)
    for x_q, x_kv, ctx in contexts(causal=causal, prefix=prefix):
        with torch.no_grad():
            out, ref = mod(x_q, x_kv, ctx).out, mod.reference_forward(x_q, x_kv, ctx).out
        vq = valid_queries(ctx)
        torch.testing.assert_close(out[vq], ref[vq], atol=1e-5, rtol=0)


def test_lsh_attends_itself_only_when_alone():
    """Causal, first token: its only allowed key is itself, so it attends to it (value of token 0)."""
    mod = attn_module("lsh", True, n_buckets=1, n_hashes=1, bucket_size=8)
    x = torch.randn(1, 5, D)
    pos = torch.arange(5)[None]
    ctx = AttnContext(pos_q=pos, pos_k=pos, causal=True)
    with torch.no_grad():
        out = mod(x, x, ctx).out
        v0 = mod.o_proj(mod.v_proj(x[:, :1]))  # softmax over one key = its value
        ref = mod.reference_forward(x, x, ctx)
    torch.testing.assert_close(out[:, 0], v0[:, 0], atol=1e-6, rtol=0)
    assert (ref.weights[0].diagonal(dim1=-2, dim2=-1)[:, 1:] == 0).all()  # token i > 0 skips itself


@pytest.mark.parametrize(("causal", "fields"), [
    (True, {"assignment": "argmax", "cluster_window": 64}),
    (False, {"assignment": "topk"}),
    (False, {"assignment": "argmax", "cluster_window": 128}),
])
@pytest.mark.parametrize("prefix", [0, 6])
def test_routing_one_cluster_equals_dense(causal, fields, prefix):
    mod = attn_module("routing", causal, position="rotary", n_clusters=1, local_heads=0, **fields)
    for x_q, x_kv, ctx in contexts(causal=causal, prefix=prefix):
        with torch.no_grad():
            out, ref = mod(x_q, x_kv, ctx).out, mod.reference_forward(x_q, x_kv, ctx).out
        vq = valid_queries(ctx)
        torch.testing.assert_close(out[vq], ref[vq], atol=1e-5, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_routing_local_heads_with_a_window_covering_everything_equal_dense(causal):
    mod = attn_module("routing", causal, n_clusters=1, local_heads=H, local_window=64)
    for x_q, x_kv, ctx in contexts(causal=causal, prefix=5):
        with torch.no_grad():
            out, ref = mod(x_q, x_kv, ctx).out, mod.reference_forward(x_q, x_kv, ctx).out
        vq = valid_queries(ctx)
        torch.testing.assert_close(out[vq], ref[vq], atol=1e-5, rtol=0)


def test_linformer_is_exact_at_full_rank():
    x_q, x_kv, ctx = contexts(t=16, causal=False)[0]
    pool = attn_module("linformer", False, projection="pool", k=16)
    lin = attn_module("linformer", False, projection="linear", k=16, max_len=16, sharing="kv")
    with torch.no_grad():
        lin.e_proj.copy_(torch.eye(16))  # E = F = I
        for mod in (pool, lin):
            torch.testing.assert_close(mod(x_q, x_kv, ctx).out, mod.reference_forward(x_q, x_kv, ctx).out,
                                       atol=1e-5, rtol=0)
    # key padding: pooling over valid keys only, still exact at k = S
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1, :3] = False
    ctx2 = AttnContext(pos_q=ctx.pos_q, pos_k=ctx.pos_k, key_valid=valid, causal=False)
    with torch.no_grad():
        torch.testing.assert_close(pool(x_q, x_kv, ctx2).out, pool.reference_forward(x_q, x_kv, ctx2).out,
                                   atol=1e-5, rtol=0)


def test_linformer_sharing_options_and_per_layer_k():
    def n_params(sharing):
        bb = Backbone({"d_model": D, "n_layers": 3, "n_heads": H, "causal": False,
                       "attention": {"kind": "linformer", "k": 8, "max_len": 32, "sharing": sharing}})
        return bb, sum(p.numel() for p in bb.parameters())

    sizes = {s: n_params(s)[1] for s in ("none", "headwise", "kv", "layerwise")}
    e = 8 * 32
    base = sizes["kv"] - 3 * e
    assert sizes == {"none": base + 3 * 2 * H * e, "headwise": base + 3 * 2 * e, "kv": base + 3 * e, "layerwise": base + e}
    bb, _ = n_params("layerwise")
    assert bb.blocks[0].attn.e_proj is bb.blocks[2].attn.e_proj
    bb = Backbone({"d_model": D, "n_layers": 3, "n_heads": H, "causal": False,
                   "attention": {"kind": "linformer", "k": [8, 4, 2], "max_len": 32}})
    assert [b.attn.k for b in bb.blocks] == [8, 4, 2]
    with pytest.raises(IncompatibleConfig, match="n_layers"):
        Backbone({"d_model": D, "n_layers": 2, "n_heads": H, "causal": False,
                  "attention": {"kind": "linformer", "k": [8, 4, 2]}})
    x = torch.randn(1, 40, D)
    with pytest.raises(ValueError, match="max_len"):
        bb(x)


# -- convergence ---------------------------------------------------------------------------------
def _mean_error(kind: str, causal: bool, budgets: list[dict], seeds=(0, 1, 2), smooth: bool = False) -> list[float]:
    errs = []
    for fields in budgets:
        e = 0.0
        for seed in seeds:
            seeded = {"seed": seed} if kind in ("performer", "rfa", "lsh") else {}
            mod = attn_module(kind, causal, torch_seed=seed, **fields, **seeded)
            g = torch.Generator().manual_seed(100 + seed)
            x = torch.randn(2, 48, D, generator=g)
            if smooth:
                x = (x * 0.3).cumsum(1)
            pos = torch.arange(48).expand(2, 48)
            ctx = AttnContext(pos_q=pos, pos_k=pos, causal=causal)
            with torch.no_grad():
                e += (mod(x, x, ctx).out - mod.reference_forward(x, x, ctx).out).abs().mean().item() / len(seeds)
        errs.append(e)
    return errs


def _decreasing(errs: list[float]) -> bool:
    return all(b < a for a, b in zip(errs, errs[1:]))


@pytest.mark.parametrize("causal", [True, False])
def test_performer_error_decreases_with_features(causal):
    errs = _mean_error("performer", causal, [{"nb_features": m} for m in (16, 64, 256, 1024)], seeds=range(6))
    assert _decreasing(errs) and errs[-1] < 0.5 * errs[0], errs


@pytest.mark.parametrize("causal", [True, False])
def test_rfa_error_decreases_with_features(causal):
    errs = _mean_error("rfa", causal, [{"num_features": d} for d in (16, 64, 256, 1024)], seeds=range(6))
    assert _decreasing(errs) and errs[-1] < 0.5 * errs[0], errs


def test_lsh_error_decreases_with_hash_rounds():
    errs = _mean_error("lsh", True, [{"n_hashes": r, "n_buckets": 4, "bucket_size": 8} for r in (1, 2, 4, 8)])
    assert _decreasing(errs) and errs[-1] < 0.5 * errs[0], errs


def test_linformer_error_decreases_with_rank():
    errs = _mean_error("linformer", False, [{"projection": "pool", "k": k} for k in (6, 12, 24, 48)], smooth=True)
    assert _decreasing(errs) and errs[-1] < 1e-5, errs


# -- contract properties (beyond the shared contract suite: more lengths, all our modes) ----------
MODES = [(k, c) for k in KINDS for c in (True, False) if not (k == "linformer" and c)]


@pytest.mark.parametrize(("kind", "causal"), [m for m in MODES if m[1]])
def test_causal_jacobian_to_the_future_is_zero(kind, causal):
    bb = backbone(kind, True, n_layers=1).eval()
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :3] = False
    x = torch.randn(2, 10, D, generator=torch.Generator().manual_seed(1))
    assert_causal(lambda z: bb(z, mask=mask).hidden * mask[..., None], x)


@pytest.mark.parametrize(("kind", "causal"), MODES)
def test_padding_invariance_and_fully_masked_rows(kind, causal):
    bb = backbone(kind, causal).eval()
    x = torch.randn(2, 17, D, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 17, dtype=torch.bool)
    mask[0, :5] = False
    mask[1, 13:] = False
    assert_padding_invariant(lambda z, m: bb(z, mask=m).hidden, x, mask)
    bb.train()
    mask[1] = False  # every key of row 1 masked
    xg = x.clone().requires_grad_(True)
    out = bb(xg, mask=mask).hidden
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(xg.grad).all()
    assert_finite_grads(bb, allow_none=("*",))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bb(x, mask=mask).hidden
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize(("kind", "causal"), MODES)
def test_all_padding_row_is_exactly_zero_and_finite_under_bf16(kind, causal):
    """A row whose keys are all padding: attention output exactly 0 (the output is the o_proj
    bias), and forward + backward finite under bf16 autocast (masked scores are filled with
    finfo.min, never -inf, so no -inf - -inf reaches a softmax, log-sum-exp or stabiliser)."""
    mod = attn_module(kind, causal, **SMALL[kind]).train()
    x = torch.randn(2, 13, D, generator=torch.Generator().manual_seed(4))
    pos = torch.arange(13).expand(2, 13)
    valid = torch.ones(2, 13, dtype=torch.bool)
    valid[1] = False
    ctx = AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=causal)
    with torch.no_grad():
        out = mod(x, x, ctx).out
    torch.testing.assert_close(out[1], mod.o_proj.bias.expand(13, D), atol=0, rtol=0)
    xg = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mod(xg, xg, ctx).out
    assert torch.isfinite(out.float()).all()
    out.float().square().sum().backward()
    assert torch.isfinite(xg.grad).all() and xg.grad[0].abs().sum() > 0
    assert_finite_grads(mod, allow_none=("*",))


def test_group_attention_empty_rows_give_zero_output_minus_inf_lse_and_finite_grads():
    from rl_tformers.attention._grouped import group_attention, merge_lse

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 5, generator=g, requires_grad=True) for _ in range(3))  # (B, G, n|K, Dh)
    allowed = torch.rand(2, 3, 4, 4, generator=g) > 0.3
    allowed[0, 1, 2] = False  # one row with no allowed key
    allowed[1, 2] = False  # a whole group
    out, lse = group_attention(q, k, v, allowed, scale=0.5)
    dead = ~allowed.any(-1)
    assert torch.equal(out[dead], torch.zeros_like(out[dead])) and torch.isneginf(lse[dead]).all()
    assert torch.isfinite(lse[~dead]).all()
    ref = torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~allowed, float("-inf")), -1).nan_to_num(0) @ v
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    # merged with a second, live partial result: the empty one gets weight exactly 0
    merged = merge_lse(torch.stack([out, out + 1]), torch.stack([lse, lse.nan_to_num(neginf=0.0)]), dim=0)
    torch.testing.assert_close(merged[dead], out[dead] + 1, atol=0, rtol=0)
    (merged.sum() + out.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("kind", ["rfa", "performer"])
def test_linear_normalisers_accumulate_in_float32_under_bf16(kind):
    mod = attn_module(kind, True)
    x = torch.randn(1, 300, D)
    pos = torch.arange(300)[None]
    ctx = AttnContext(pos_q=pos, pos_k=pos, causal=True)
    with torch.no_grad():
        ref = mod(x, x, ctx).out
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = mod(x, x, ctx).out
    # only the bf16 projections differ: a bf16 running sum over 300 keys would be far worse
    assert (out.float() - ref).abs().max() < 0.05


@pytest.mark.parametrize("kind", ["rfa", "performer"])
def test_linear_features_and_running_sums_are_float32_under_bf16(kind, monkeypatch):
    """The dtypes themselves (the output tolerance above also passes an all-bf16 kernel): under
    bf16 autocast the query/key features, the values with their normaliser column, the running
    sums (S, z) the causal scan returns and an incremental cache are float32."""
    import rl_tformers.attention._linear as lin

    mod = attn_module(kind, True)
    seen = {}
    scan = lin.causal_linear

    def recording(fq, fk, v_aug, **kw):
        out, final = scan(fq, fk, v_aug, **kw)
        seen.update(fq=fq.dtype, fk=fk.dtype, v=v_aug.dtype, out=out.dtype, state=final.dtype)
        return out, final

    monkeypatch.setattr(lin, "causal_linear", recording)
    x = torch.randn(1, 40, D)
    pos = torch.arange(40)[None]
    ctx = AttnContext(pos_q=pos, pos_k=pos, causal=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        cache = mod.init_cache(1, torch.device("cpu"), torch.bfloat16)
        res = mod(x, x, ctx, cache)
    assert seen == {k: torch.float32 for k in ("fq", "fk", "v", "out", "state")}
    assert cache.state.dtype == torch.float32 and res.cache.state.dtype == torch.float32


# -- linear attention engine and incremental decoding ---------------------------------------------
def _naive(fq, fk, v, log_decay, reset, state0, strict):
    b, h, n, m = fq.shape
    st = torch.zeros(b, h, m, v.shape[-1]) if state0 is None else state0.clone()
    outs = []
    for t in range(n):  # the recurrence token by token (test oracle only)
        a = torch.ones(b, h) if log_decay is None else log_decay[:, :, t].exp()
        if reset is not None:
            a = a * (~reset[:, t]).float()[:, None]
        st = a[..., None, None] * st
        if strict:
            outs.append(torch.einsum("bhm,bhme->bhe", fq[:, :, t], st))
        st = st + fk[:, :, t, :, None] * v[:, :, t, None, :]
        if not strict:
            outs.append(torch.einsum("bhm,bhme->bhe", fq[:, :, t], st))
    return torch.stack(outs, 2), st


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("parts", ["plain", "decay", "reset", "all"])
def test_chunked_scan_equals_the_token_recurrence(chunk, strict, parts):
    g = torch.Generator().manual_seed(0)
    b, h, n, m, e = 2, 3, 29, 5, 4
    fq, fk = torch.rand(b, h, n, m, generator=g), torch.rand(b, h, n, m, generator=g)
    v = torch.randn(b, h, n, e, generator=g)
    log_decay = F.logsigmoid(torch.randn(b, h, n, generator=g) * 2) if parts in ("decay", "all") else None
    reset = (torch.rand(b, n, generator=g) < 0.15) if parts in ("reset", "all") else None
    state0 = torch.randn(b, h, m, e, generator=g) if parts == "all" else None
    out, final = causal_linear(fq, fk, v, log_decay=log_decay, reset=reset, state0=state0, chunk=chunk, strict=strict)
    want, want_final = _naive(fq, fk, v, log_decay, reset, state0, strict)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("att", [{"kind": "performer"}, {"kind": "rfa"}, {"kind": "rfa", "gate": True}])
@pytest.mark.parametrize("position", ["rotary", "learned"])
def test_incremental_decoding_carries_the_state_and_equals_the_full_pass(att, position):
    torch.manual_seed(0)
    bb = Backbone({"d_model": D, "n_layers": 2, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0,
                   "position": {"kind": position}, "attention": {**att, "chunk_size": 4}}).eval()
    x = torch.randn(3, 11, D)
    full = bb(x).hidden
    st = bb.initial_state(3)
    size0 = st.layers[0].cache.state.shape
    outs = []
    for lo, hi in ((0, 1), (1, 2), (2, 6), (6, 7), (7, 11)):
        o = bb(x[:, lo:hi], state=st)
        st = o.state
        outs.append(o.hidden)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=0)
    assert st.layers[0].cache.state.shape == size0  # (S, z) does not grow with decoded tokens
    assert st.layers[0].cache.state.dtype == torch.float32
    reset = bb.reset_state(st, torch.tensor([False, True, False]))
    o = bb(x[:, :4], state=reset)
    torch.testing.assert_close(o.hidden[1], bb(x[1:2, :4]).hidden[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["lsh", "routing", "rfa", "performer"])
def test_memory_kinds_train_with_xl_memory(kind):
    bb = backbone(kind, True, memory={"kind": "xl", "mem_len": 8}).train()
    x = torch.randn(2, 10, D)
    st = bb.initial_state(2)
    for _ in range(2):
        out = bb(x, state=st)
        st = out.state.detach()
    out.hidden.square().mean().backward()
    assert_finite_grads(bb)


def test_rfa_and_performer_segments_with_xl_memory_equal_one_pass():
    for kind in ("rfa", "performer"):
        bb = backbone(kind, True, memory={"kind": "xl", "mem_len": 16}).eval()
        x = torch.randn(2, 16, D)
        o1 = bb(x[:, :7], state=bb.initial_state(2))
        o2 = bb(x[:, 7:], state=o1.state)
        torch.testing.assert_close(torch.cat([o1.hidden, o2.hidden], 1), bb(x).hidden, atol=1e-5, rtol=0)


# -- state is explicit: random features, routing centroids -------------------------------------------
@pytest.mark.parametrize("kind", ["performer", "rfa", "lsh"])
def test_random_features_change_only_by_explicit_redraw(kind):
    bb = backbone(kind, True).train()
    buf = {k: v.clone() for k, v in bb.state_dict().items() if k.endswith(("omega", "eps_dirs", "rotations"))}
    assert buf
    x = torch.randn(2, 9, D)
    a = bb.eval()(x).hidden
    bb.train()(x).hidden.sum().backward()
    for k, v in bb.state_dict().items():
        if k in buf:
            assert torch.equal(v, buf[k]), f"{k} changed in forward"
    torch.testing.assert_close(bb.eval()(x).hidden, a, atol=0, rtol=0)
    assert maybe_redraw_random_features(bb, 5) == 0  # redraw_every = 0: never on a schedule
    assert redraw_random_features(bb, torch.Generator().manual_seed(9)) == 2
    assert any(not torch.equal(bb.state_dict()[k], v) for k, v in buf.items())
    assert (bb(x).hidden - a).abs().max() > 1e-6
    sched = backbone(kind, True, attention={"kind": kind, **SMALL[kind], "redraw_every": 3})
    assert [maybe_redraw_random_features(sched, s) for s in range(7)] == [0, 0, 0, 2, 0, 0, 2]


def test_routing_centroids_update_only_in_training_forwards_with_autograd():
    bb = backbone("routing", True, attention={"kind": "routing", **SMALL["routing"], "ema_decay": 0.5})
    mu = bb.blocks[0].attn.centroids.clone()
    x = torch.randn(2, 12, D)
    out = bb.eval()(x)
    assert torch.equal(bb.blocks[0].attn.centroids, mu)  # rollouts never change the module
    assert {"layer0/routing_commitment", "layer0/routing_cluster_entropy", "layer0/routing_coverage"} <= set(out.metrics)
    with torch.no_grad():
        bb.train()(x)
    assert torch.equal(bb.blocks[0].attn.centroids, mu)
    bb.train()(x).hidden.sum().backward()
    new = bb.blocks[0].attn.centroids
    assert not torch.equal(new, mu)
    torch.testing.assert_close(new.norm(dim=-1), torch.ones(new.shape[:-1]), atol=1e-5, rtol=0)


def test_routing_commitment_loss_is_in_aux_only_when_weighted():
    x = torch.randn(2, 12, D)
    assert not backbone("routing", True)(x).aux
    bb = backbone("routing", True, attention={"kind": "routing", **SMALL["routing"], "commitment_weight": 0.1})
    aux = bb(x).aux
    assert set(aux) == {"routing_commitment"} and aux["routing_commitment"].dim() == 0


def test_single_episode_kinds_refuse_several_episodes_in_a_row():
    for kind in ("linformer", "sinkhorn"):
        bb = backbone(kind, kind != "linformer")
        starts = torch.zeros(2, 12, dtype=torch.bool)
        starts[0, 6] = True
        with pytest.raises(ValueError, match="episode"):
            bb(torch.randn(2, 12, D), episode_start=starts)


# -- inside the agents' backbones ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_dt_like_backbone_trains_at_t60(kind):
    """DT: T = 60 tokens (K = 20 steps x 3), causal (Linformer: last-action mode, bidirectional)."""
    bb = Backbone({"d_model": 32, "n_layers": 2, "n_heads": 2, "causal": kind != "linformer",
                   "position": {"kind": "none"}, "attention": {"kind": kind}}).train()
    x = torch.randn(4, 60, 32)
    mask = torch.ones(4, 60, dtype=torch.bool)
    mask[0, :21] = False  # a window at an episode start: left padding
    out = bb(x, mask=mask)
    (out.hidden[mask].square().mean() + sum(out.aux.values(), torch.zeros(()))).backward()
    assert torch.isfinite(out.hidden).all()
    assert_finite_grads(bb)


@pytest.mark.parametrize("kind", ["lsh", "routing", "rfa", "performer"])
def test_gtrxl_like_backbone_with_gated_blocks_and_memory(kind):
    bb = Backbone({"d_model": 32, "n_layers": 1, "n_heads": 2, "block": {"kind": "gated"},
                   "memory": {"kind": "xl", "mem_len": 20}, "attention": {"kind": kind}}).train()
    x = torch.randn(3, 60, 32)
    st = bb.initial_state(3)
    out = bb(x, state=st, episode_start=torch.zeros(3, 60, dtype=torch.bool))
    out = bb(x, state=out.state.detach())
    out.hidden.square().mean().backward()
    assert torch.isfinite(out.hidden).all()


# -- complexity ------------------------------------------------------------------------------------
def test_no_kernel_materialises_l_by_l_at_16384():
    """L = 16384 would need 2^28 scores per head (1 GiB in float32): every kind stays far below."""
    n = 16384
    fields = {"linformer": {"max_len": n}, "sinkhorn": {"max_len": n, "block_size": 128}, "routing": {"n_clusters": 128}}
    for kind in KINDS:
        causal = kind != "linformer"
        mod = attn_module(kind, causal, **fields.get(kind, {}))
        x = torch.randn(1, n, D)
        pos = torch.arange(n)[None]
        valid = torch.ones(1, n, dtype=torch.bool)
        valid[0, :7] = False
        ctx = AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=causal)
        with torch.no_grad():
            peak, op = peak_numel(lambda m=mod, c=ctx, z=x: m(z, z, c))
        assert peak <= n * n // 16, f"{kind}: largest tensor {peak} elements ({op}) at L={n}"


def _module(kind: str, causal: bool, **fields):
    cfg = {
        "d_model": D, "n_layers": 1, "n_heads": H, "d_ff": 32, "dropout": 0.0, "attn_dropout": 0.0,
        "attention": {"kind": kind, **fields}, "position": {"kind": "none"}, "causal": causal,
    }
    bcfg = BackboneConfig.from_dict(cfg)
    ctx = BuildContext(bcfg).at_layer(0)
    torch.manual_seed(0)
    return bcfg.attention.build(ctx, bcfg.position.build(ctx)).eval()


# ------------------------------------------------- Performer's orthogonal features (FAVOR+)
def test_orthogonal_random_features_are_isotropic_and_unbiased():
    """Choromanski et al. 2021, sec. 2.4: every row must be marginally N(0, I). The raw Q of
    torch.linalg.qr (Householder) gives the first row of a block a non-positive first coordinate
    (fraction 1.0), which would make E[exp(w . x)] miss exp(|x|^2 / 2) by ~5% at |x| = 0.6."""
    dim, blocks = 4, 4000
    w = orthogonal_gaussian(dim * blocks, dim, torch.Generator().manual_seed(0))  # (rows, dim)
    first = w[0::dim, 0]  # first coordinate of the first row of every block
    frac_neg = (first < 0).float().mean().item()
    assert 0.45 < frac_neg < 0.55, frac_neg  # not 1.0
    assert w.mean(0).abs().max().item() < 0.05  # not ~0.1 per coordinate
    # still exactly orthogonal inside a block
    blk = w[:dim] / w[:dim].norm(dim=1, keepdim=True)
    torch.testing.assert_close(blk @ blk.T, torch.eye(dim), atol=1e-5, rtol=0)
    # the positive-feature identity E[exp(w . x)] = exp(|x|^2 / 2), both signs of x
    for s in (0.6, -0.6):
        x = torch.tensor([s, 0.0, 0.0, 0.0])
        est = torch.exp(w @ x).mean().item()
        assert abs(est / torch.exp((x * x).sum() / 2).item() - 1) < 0.01, (s, est)


# ------------------------------------------------------------ gated RFA and key padding
def _ctx(valid: torch.Tensor) -> AttnContext:
    pos = torch.arange(valid.shape[1]).expand(valid.shape[0], -1)
    return AttnContext(pos_q=pos, pos_k=pos, key_valid=valid, causal=True)


def test_gated_rfa_padded_key_does_not_decay_the_state():
    """A padded key (mask False) must not change a valid output (Capabilities.key_padding); its
    gate g_j = sigmoid(w . x_j + b) decayed S and z for every later query, so its content did."""
    mod = _module("rfa", True, gate=True, seed=0, chunk_size=4)
    t = 10
    x = torch.randn(2, t, D, generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[0, 4] = False  # padding in the middle of row 0
    valid[1, 6:8] = False
    x2 = x.clone()
    x2[~valid] = torch.randn(int((~valid).sum()), D, generator=torch.Generator().manual_seed(2)) * 10
    with torch.no_grad():
        a, b = mod(x, x, _ctx(valid)).out, mod(x2, x2, _ctx(valid)).out
        ra, rb = mod.reference_forward(x, x, _ctx(valid)).out, mod.reference_forward(x2, x2, _ctx(valid)).out
    torch.testing.assert_close(b[valid], a[valid], atol=1e-6, rtol=0)  # not off by ~0.2
    torch.testing.assert_close(rb[valid], ra[valid], atol=1e-6, rtol=0)  # the ground truth agrees


def test_gated_rfa_with_a_padded_key_equals_the_sequence_without_it():
    """Skipping the padded key (S_j = S_{j-1}) is the same as not having it at all."""
    mod = _module("rfa", True, gate=True, seed=0, chunk_size=4)
    x = torch.randn(1, 8, D, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(1, 8, dtype=torch.bool)
    valid[0, 3] = False
    keep = valid[0]
    with torch.no_grad():
        padded = mod(x, x, _ctx(valid)).out[:, keep]  # (1, 7, D)
        short = mod(x[:, keep], x[:, keep], _ctx(torch.ones(1, 7, dtype=torch.bool))).out
    torch.testing.assert_close(padded, short, atol=1e-5, rtol=0)


# ---------------------------------------------- sliding window as cross-attention (S < T)
def test_sliding_window_reference_with_fewer_keys_than_queries():
    """``sliding_window`` declares cross_attention; its pattern() (the reference's mask) works when
    S < T (slicing the global-token table by a negative prefix length would raise a shape error)."""
    mod = _module("sliding_window", False, window=3)
    t, s = 12, 7
    x = torch.randn(2, t, D, generator=torch.Generator().manual_seed(4))
    y = torch.randn(2, s, D, generator=torch.Generator().manual_seed(5))
    ctx = AttnContext(pos_q=torch.arange(t).expand(2, t), pos_k=torch.arange(s).expand(2, s), causal=False)
    pat = mod.pattern(ctx)
    assert pat.shape == (1, H, t, s)
    a = torch.arange(t)[:, None] + (s - t)  # key index of each query
    j = torch.arange(s)[None, :]
    assert torch.equal(pat[0, 0], (a - j).abs() <= 1)
    with torch.no_grad():
        torch.testing.assert_close(mod(x, y, ctx).out, mod.reference_forward(x, y, ctx).out, atol=1e-5, rtol=0)


# --------------------------------------- blockwise permutations over blocks that exist
def test_blockwise_short_sequence_never_maps_a_query_block_to_an_empty_block():
    """BlockBERT: head h attends block pi_h(i) = (i + k) mod n. With S = 6 and n_blocks = 4 the
    blocks of ceil(6 / 4) = 2 keys are only 3; block 2 (shift 1) mapped to block 3, which holds no
    key, so its queries got no key at all (zero outputs on that head)."""
    mod = _module("blockwise", False, n_blocks=4, heads_per_shift=(1, 1))
    for t in (6, 9):
        pos = torch.arange(t)[None]
        ctx = AttnContext(pos_q=pos, pos_k=pos, causal=False)
        pat = mod.pattern(ctx)  # (1, H, T, S)
        assert bool(pat.any(-1).all()), (t, (~pat.any(-1)).sum(-1))  # not 2 / 3 empty rows on head 1
        x = torch.randn(1, t, D, generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            torch.testing.assert_close(mod(x, x, ctx).out, mod.reference_forward(x, x, ctx).out, atol=1e-5, rtol=0)
    # S a multiple of n: exactly the paper's pattern, block i -> block (i + 1) mod 4
    pos = torch.arange(8)[None]
    pat = mod.pattern(AttnContext(pos_q=pos, pos_k=pos, causal=False))[0, 1]
    blk = torch.arange(8) // 2
    assert torch.equal(pat, blk[None, :] == (blk[:, None] + 1) % 4)


def _compressive_linear(attention: str, causal: bool = True) -> Backbone:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Backbone({
            "d_model": D, "n_heads": 2, "n_layers": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": causal,
            "attention": {"kind": attention},
            "memory": {"kind": "compressive", "mem_len": 4, "compressed_len": 4, "rate": 2},
        }).eval()


def _with_seg(state: BackboneState, seg: torch.Tensor) -> BackboneState:
    return BackboneState(layers=state.layers, pos=state.pos, valid=state.valid, seg=seg,
                         episode=state.episode, next_pos=state.next_pos)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("attention", ["performer", "rfa"])
def test_linear_kernels_read_a_compressive_memory_whose_unfilled_slots_have_no_episode(attention, causal):
    """The compressive memory keeps ``[compressed; FIFO]`` with unfilled FIFO slots (episode id
    -1) after filled compressed ones, so episode ids decrease along the keys. Linear attention
    must not read those invalid slots as episode boundaries (that would refuse a second or third
    segment with "episode ids ... must be non-decreasing": GTrXL with ``performer`` +
    ``compressive`` could not run): the ids they carry change nothing."""
    bb = _compressive_linear(attention, causal)
    torch.manual_seed(1)
    x = torch.randn(2, 12, D)
    with torch.no_grad():
        st = bb.initial_state(2)
        for s in range(0, 12, 3):
            st = bb(x[:, s : s + 3], state=st).state
        assert bool((st.seg[:, 1:] < st.seg[:, :-1]).any())  # episode ids that decrease along the keys
        y = torch.randn(2, 3, D)
        out = bb(y, state=st).hidden
        # the same state with its invalid slots given other ids (none decreasing, or all 99)
        filled = st.seg.masked_fill(~st.valid, -5).cummax(1).values
        for seg in (torch.where(st.valid, st.seg, filled), torch.where(st.valid, st.seg, 99)):
            assert torch.equal(bb(y, state=_with_seg(st, seg)).hidden, out)


@pytest.mark.parametrize("attention", ["performer", "rfa"])
def test_linear_kernels_with_compressive_memory_reset_a_row_to_a_fresh_stream(attention):
    """Resets and episode starts with a compressive memory: the reset row equals a fresh stream,
    the other row is untouched by the reset."""
    bb = _compressive_linear(attention)
    torch.manual_seed(2)
    x = torch.randn(2, 15, D)
    es = torch.zeros(2, 15, dtype=torch.bool)
    es[0, 4] = True
    with torch.no_grad():
        st = bb.initial_state(2)
        for s in range(0, 9, 3):
            st = bb(x[:, s : s + 3], episode_start=es[:, s : s + 3], state=st).state
        a, c = bb.reset_state(st, torch.tensor([False, True])), st
        fresh = bb.initial_state(1)
        for s in range(9, 15, 3):
            oa = bb(x[:, s : s + 3], state=a)
            oc = bb(x[:, s : s + 3], state=c)
            of = bb(x[1:, s : s + 3], state=fresh)
            torch.testing.assert_close(oa.hidden[1], of.hidden[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(oa.hidden[0], oc.hidden[0], atol=1e-5, rtol=0)
            a, c, fresh = oa.state, oc.state, of.state


@pytest.mark.parametrize("fields", [{"kind": "performer"}, {"kind": "rfa"}, {"kind": "rfa", "gate": True}])
def test_linear_kernels_of_a_float64_model_keep_float64_precision(fields):
    """Performer and RFA compute their features, sums and incremental state in the model's dtype,
    at least float32 (bf16 and fp16 accumulate in float32): a float64 model gets float64 results
    and a float64 cache (in float32, chunked pass vs one chunk and step-by-step decoding vs the
    full pass differ by ~1e-7)."""
    def build(chunk: int) -> Backbone:
        torch.manual_seed(0)
        return Backbone({"d_model": D, "n_heads": 2, "n_layers": 1, "dropout": 0.0, "attn_dropout": 0.0,
                         "attention": {**fields, "chunk_size": chunk}}).double().eval()

    bb, one_chunk = build(4), build(64)
    torch.manual_seed(1)
    x = torch.randn(2, 10, D, dtype=torch.float64)
    with torch.no_grad():
        full = bb(x).hidden
        torch.testing.assert_close(one_chunk(x).hidden, full, atol=1e-12, rtol=0)
        st = bb.initial_state(2)
        assert st.layers[0].cache.state.dtype == torch.float64
        steps = []
        for s in range(10):
            o = bb(x[:, s : s + 1], state=st)
            st = o.state
            steps.append(o.hidden)
        assert st.layers[0].cache.state.dtype == torch.float64
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
    # a bf16 model keeps its float32 accumulators
    torch.manual_seed(0)
    bf = Backbone({"d_model": D, "n_heads": 2, "n_layers": 1, "attention": fields}).to(torch.bfloat16)
    assert bf.initial_state(2).layers[0].cache.state.dtype == torch.float32


ROUTING_TOY = ["agent.kind=toy", "device=cpu", "train.steps=10", "train.batch_size=8", "train.log_every=5",
               "train.checkpoint_every=10", "train.lr=3e-3", "train.warmup_steps=2", "eval.at_end=false",
               "train.progress=false", "backbone.dropout=0", "backbone.attn_dropout=0",
               "backbone.attention.kind=routing", "backbone.attention.n_clusters=2",
               "backbone.attention.local_window=4", "backbone.attention.cluster_window=4",
               "backbone.attention.seed=0", "backbone.attention.ema_decay=0.5", "backbone.position.kind=none"]


CENTROIDS = "backbone.depth.blocks.0.attn.centroids"


# ------------------------------------------------- routing centroids under DDP
def test_routing_centroids_under_ddp_follow_the_global_batch_and_agree_on_every_rank(tmp_path: Path) -> None:
    single = tmp_path / "single"
    train(compose(None, ROUTING_TOY), single)
    outs = two_ranks(tmp_path, f"""
        from pathlib import Path
        from rl_tformers.runtime import trainer as T
        from rl_tformers.runtime.run_config import compose
        models = []
        fit = T.Trainer.fit

        def recording_fit(self, *args, **kwargs):
            models.append(self.model)
            return fit(self, *args, **kwargs)

        T.Trainer.fit = recording_fit
        T.train(compose(None, {ROUTING_TOY!r}), Path({str(tmp_path / "ddp")!r}))
        out["centroids"] = dict(models[0].named_buffers())[{CENTROIDS!r}].tolist()
    """)
    c0, c1 = (torch.tensor(o["centroids"]) for o in outs)
    assert torch.equal(c0, c1)  # not rank 1 kept its own last EMA step (DDP broadcasts before forwards only)
    ref = torch.load(single / "checkpoints" / "step_000000010.pt", weights_only=True)["model"][CENTROIDS]
    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "step_000000010.pt", weights_only=True)["model"][CENTROIDS]
    assert torch.equal(ddp, c0)
    torch.testing.assert_close(ddp, ref, rtol=0, atol=1e-4)  # not 0.06 apart: rank 0's half batch
    for a, b in zip(read_metrics(single), read_metrics(tmp_path / "ddp"), strict=True):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)  # not 1e-3 apart


# ------------------------------------------------- routing EMA statistics in float32 under autocast
def _routing_backbone() -> Backbone:
    return Backbone({"d_model": 32, "n_layers": 1, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": True,
                     "attention": {"kind": "routing", "n_clusters": 4, "local_heads": 0, "cluster_window": 4,
                                   "ema_decay": 0.0, "seed": 0}})


def test_routing_ema_step_is_float32_under_bf16_autocast() -> None:
    attn = next(m for m in _routing_backbone().modules() if hasattr(m, "ema_step"))
    g = torch.Generator().manual_seed(0)
    qn = F.normalize(torch.randn(64, 1, 50, 16, generator=g), dim=-1)
    kn = F.normalize(torch.randn(64, 1, 50, 16, generator=g), dim=-1)
    mu = attn.centroids.clone()
    cq = torch.einsum("bhtd,hkd->bhtk", qn, mu).argmax(-1)
    ck = torch.einsum("bhsd,hkd->bhsk", kn, mu).argmax(-1)
    ok = torch.ones(64, 50, dtype=torch.bool)
    attn.ema_step(qn, kn, cq, ck, ok, ok)
    fp32 = attn.centroids.clone()
    assert not torch.equal(fp32, mu)
    attn.centroids.copy_(mu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn.ema_step(qn, kn, cq, ck, ok, ok)
    assert attn.centroids.dtype == torch.float32
    assert torch.equal(attn.centroids, fp32)  # not 1.8e-3 off (bf16 einsums)


# ------------------------------------------------- validation names the option
@pytest.mark.parametrize(("attention", "option"), [
    ({"kind": "rfa", "redraw_every": -1}, "attention.redraw_every"),
    ({"kind": "lsh", "redraw_every": -2}, "attention.redraw_every"),
    ({"kind": "performer", "redraw_every": -1}, "attention.redraw_every"),
    ({"kind": "lsh", "max_buckets": 0}, "attention.max_buckets"),
    ({"kind": "lsh", "max_buckets": 3}, "attention.max_buckets"),
])
def test_bad_redraw_period_and_bucket_cap_are_refused_naming_the_option(attention: dict, option: str) -> None:
    with pytest.raises(Exception, match=option.replace(".", r"\.") + r".*got " + str(next(iter(
            v for k, v in attention.items() if k != "kind")))):
        Backbone({"d_model": 16, "n_layers": 1, "n_heads": 2, "attn_dropout": 0.0, "attention": attention})


def test_lsh_bucket_caps_that_remain_valid_still_run() -> None:
    x, pos = torch.randn(2, 12, 16), torch.arange(12).expand(2, 12)
    for cap in (1, 2, 4):
        bb = Backbone({"d_model": 16, "n_layers": 1, "n_heads": 2, "attn_dropout": 0.0,
                       "attention": {"kind": "lsh", "max_buckets": cap, "bucket_size": 2, "seed": 0}})
        assert torch.isfinite(bb(x, positions=pos).hidden).all()


def test_bigbird_takes_a_large_seed() -> None:
    """attention.seed=2**45, accepted by the config, also runs: seed * 1_000_003 is beyond torch's
    64-bit seed range ("Overflow when unpacking long long" if passed on as it is)."""
    cfg = {"d_model": 16, "n_layers": 1, "n_heads": 2, "causal": False, "attn_dropout": 0.0}
    x, pos = torch.randn(1, 12, 16), torch.arange(12)[None]
    torch.manual_seed(0)
    big = Backbone({**cfg, "attention": {"kind": "bigbird", "block": 2, "seed": 2**45}})
    assert torch.isfinite(big(x, positions=pos).hidden).all()
    # seeds below 2^63 keep their pattern: seed 0 gives what it gave before
    attn = next(m for m in Backbone({**cfg, "attention": {"kind": "bigbird", "block": 2}}).modules()
                if hasattr(m, "_random"))
    from rl_tformers.attention.bigbird import random_blocks

    _, starts, blocks, ok = attn._random(0, 12, 0, torch.device("cpu"))
    ref, ref_ok = random_blocks(starts // 2, 6, 0, 1, 2, 0 * 1_000_003 + 7 * 6, torch.device("cpu"))
    assert torch.equal(blocks, ref) and torch.equal(ok, ref_ok)


def _build(kind: str, attn_dropout: float, causal: bool = True) -> list[str]:
    cfg = BackboneConfig.from_dict(
        {"d_model": 32, "n_heads": 2, "n_layers": 3, "attn_dropout": attn_dropout, "causal": causal,
         "attention": {"kind": kind}}
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Backbone(cfg)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("kind", ["performer", "rfa"])
def test_linear_attention_says_once_that_attention_dropout_is_not_applied(kind):
    # performer/rfa form no probabilities: attn_dropout=0.1 (the DT default) was dropped silently
    msgs = _build(kind, 0.1)
    assert msgs == [
        f"attention kind {kind!r} forms no attention probabilities, so attn_dropout=0.1 is not applied to it "
        "(residual and feed-forward dropout still are); set attn_dropout=0 to say so and silence this warning"
    ]
    assert _build(kind, 0.0) == []


def test_kernels_with_probabilities_do_not_warn_about_attention_dropout():
    assert _build("sdpa", 0.1) == []
    assert _build("linformer", 0.1, causal=False) == []


# -- performer with one 128-wide head (the DT's): the causal key shift exp(-max|w|^2/2) ~ exp(-90)
#    made 99.9% of key features subnormal (20-50x slower, and precision lost to subnormal rounding)
def test_performer_causal_key_shift_is_capped():
    import torch

    from rl_tformers.attention.performer import causal_key_shift

    def omega(sq_norm):  # rows with the given squared norms
        return torch.sqrt(torch.tensor(sq_norm))[:, None] * torch.nn.functional.one_hot(torch.arange(2), 4).float()

    assert causal_key_shift(omega([40.0, 30.0])).item() == 20.0  # B = 20 <= 60: the bound itself
    assert causal_key_shift(omega([180.0, 30.0])).item() == 60.0  # B = 90: capped
    assert causal_key_shift(omega([400.0, 30.0])).item() == 122.0  # B = 200: B - 78


def test_performer_key_features_of_a_128_wide_head_are_normal_floats():
    import torch

    from rl_tformers.backbone import Backbone

    torch.manual_seed(0)
    bb = Backbone(BackboneConfig.from_dict({"d_model": 128, "n_heads": 1, "n_layers": 1, "attn_dropout": 0.0,
                                            "attention": {"kind": "performer"}}))
    attn = bb.depth.blocks[0].attn
    k = torch.randn(2, 1, 60, 128)  # (B, H, S, Dh): keys of a LayerNorm-scaled width
    phi = attn.features(k, is_query=False, valid=None)
    assert phi.shape == (2, 1, 60, attn.m)
    assert bool((phi >= torch.finfo(torch.float32).tiny).all())  # no subnormals, no zeros
    assert bool(torch.isfinite(phi).all())
