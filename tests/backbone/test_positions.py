"""Positional kinds: each against its paper's formula computed by brute force, plus the must-shows
(RoPE depends only on i - j, ALiBi's slopes, Shaw's clipping)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.backbone_config import BuildContext
from rl_tformers.position.absolute import sinusoid
from rl_tformers.position.alibi import alibi_slopes
from rl_tformers.position.base import embedding_table
from rl_tformers.position.distance_aware import da_weight
from rl_tformers.registry import POSITION

B, H, T, S, DH = 2, 4, 5, 7, 8
D = H * DH


def _pos_module(kind: str, **fields):
    cfg = BackboneConfig.from_dict({"d_model": D, "n_heads": H, "n_layers": 1, "position": {"kind": kind, **fields}})
    torch.manual_seed(0)
    return cfg.position.build(BuildContext(cfg).at_layer(0))


def _positions():
    pos_k = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 7, 8, 9, 30, 31, 32]])  # (B, S), arbitrary units
    return pos_k[:, -T:], pos_k  # queries are the last T keys


# -- RoPE ------------------------------------------------------------------------------------------
def test_rope_scores_depend_only_on_relative_position():
    rope = _pos_module("rotary")
    q, k = torch.randn(B, H, T, DH), torch.randn(B, H, S, DH)
    pos_q, pos_k = _positions()
    scores = rope.rotate(q, pos_q) @ rope.rotate(k, pos_k).transpose(-1, -2)
    shifted = rope.rotate(q, pos_q + 7) @ rope.rotate(k, pos_k + 7).transpose(-1, -2)
    torch.testing.assert_close(shifted, scores, atol=1e-5, rtol=0)
    # ...and do depend on it: a different relative offset changes the scores
    other = rope.rotate(q, pos_q + 1) @ rope.rotate(k, pos_k).transpose(-1, -2)
    assert (other - scores).abs().max() > 1e-2
    # rotation keeps norms; position 0 is the identity
    torch.testing.assert_close(rope.rotate(q, pos_q).norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(rope.rotate(q, torch.zeros_like(pos_q)), q, atol=0, rtol=0)


def test_rope_matches_the_rotation_matrix_of_the_paper():
    rope = _pos_module("rotary")
    x = torch.randn(1, 1, 1, DH)
    m = 3
    want = torch.empty(DH)
    for k in range(DH // 2):
        th = m * 10000.0 ** (-2 * k / DH)
        c, s = math.cos(th), math.sin(th)
        want[2 * k] = c * x[0, 0, 0, 2 * k] - s * x[0, 0, 0, 2 * k + 1]
        want[2 * k + 1] = s * x[0, 0, 0, 2 * k] + c * x[0, 0, 0, 2 * k + 1]
    torch.testing.assert_close(rope.rotate(x, torch.tensor([[m]]))[0, 0, 0], want, atol=1e-6, rtol=0)


def test_rope_backbone_output_is_invariant_to_a_shift_of_all_positions():
    bb = Backbone({"d_model": D, "n_heads": H, "n_layers": 2, "dropout": 0.0, "attn_dropout": 0.0,
                   "position": {"kind": "rotary"}}).eval()
    x = torch.randn(B, T, D)
    pos = torch.arange(T).expand(B, T)
    torch.testing.assert_close(bb(x, positions=pos + 7).hidden, bb(x, positions=pos).hidden, atol=1e-5, rtol=0)


# -- ALiBi ----------------------------------------------------------------------------------------
def test_alibi_slopes_for_eight_heads_are_powers_of_one_half():
    assert alibi_slopes(8) == [2.0 ** -i for i in range(1, 9)]
    assert alibi_slopes(16) == [2.0 ** (-0.5 * i) for i in range(1, 17)]
    # not a power of two: slopes of 4 heads, then every other slope of 8 heads
    assert alibi_slopes(6) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]


def test_alibi_bias_is_minus_slope_times_distance():
    alibi = _pos_module("alibi")
    pos_q, pos_k = _positions()
    bias = alibi.score_bias(torch.zeros(B, H, T, DH), pos_q, pos_k)  # (B, H, T, S)
    slopes = alibi_slopes(H)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                for j in range(S):
                    assert bias[b, h, i, j].item() == pytest.approx(-slopes[h] * abs(pos_q[b, i] - pos_k[b, j]).item())


# -- Shaw ------------------------------------------------------------------------------------------
def test_shaw_matches_brute_force_and_clips_offsets_beyond_k():
    k = 2
    shaw = _pos_module("shaw", clip=k)
    assert shaw.key_table.shape == (2 * k + 1, DH) and shaw.value_table.shape == (2 * k + 1, DH)
    q = torch.randn(B, H, T, DH)
    pos_q, pos_k = _positions()
    bias = shaw.score_bias(q, pos_q, pos_k)
    probs = torch.softmax(torch.randn(B, H, T, S), -1)
    val = shaw.value_term(probs, pos_q, pos_k)
    want_b = torch.empty(B, H, T, S)
    want_v = torch.zeros(B, H, T, DH)
    for b in range(B):
        for i in range(T):
            for j in range(S):
                off = max(-k, min(k, int(pos_k[b, j] - pos_q[b, i])))  # clip(j - i, k)
                want_b[b, :, i, j] = q[b, :, i] @ shaw.key_table[off + k] / math.sqrt(DH)
                want_v[b, :, i] += probs[b, :, i, j, None] * shaw.value_table[off + k]
    torch.testing.assert_close(bias, want_b, atol=1e-6, rtol=0)
    torch.testing.assert_close(val, want_v, atol=1e-6, rtol=0)
    # offsets beyond k share one vector: keys at j - i = -3 and -20 get the same bias
    far = shaw.score_bias(q[:, :, :1], torch.tensor([[20]]).expand(B, 1), torch.tensor([[17, 0]]).expand(B, 2))
    assert torch.equal(far[..., 0], far[..., 1])


def test_shaw_value_term_makes_the_dense_kernel_take_its_reference_path():
    shaw = _pos_module("shaw")
    assert shaw.needs_probs and shaw.value_bias
    assert not _pos_module("shaw", values=False).needs_probs


# -- Transformer-XL relative -----------------------------------------------------------------------
def test_xl_relative_scores_are_the_four_terms_of_the_paper():
    xl = _pos_module("xl_relative")
    with torch.no_grad():
        xl.u.normal_()
        xl.v.normal_()
    q, k = torch.randn(B, H, T, DH), torch.randn(B, H, S, DH)
    pos_q, pos_k = _positions()
    got = (xl.content_query(q) @ k.transpose(-1, -2)) / math.sqrt(DH) + xl.score_bias(q, pos_q, pos_k)
    want = torch.empty(B, H, T, S)
    for b in range(B):
        for i in range(T):
            for j in range(S):
                r = sinusoid(pos_q[b, i] - pos_k[b, j], D)  # (D,) r_{i-j}
                wr = xl.r_proj(r).view(H, DH)  # W_kR r_{i-j}, split by head
                a = (q[b, :, i] * k[b, :, j]).sum(-1)
                bb = (q[b, :, i] * wr).sum(-1)
                c = (xl.u * k[b, :, j]).sum(-1)
                d = (xl.v * wr).sum(-1)
                want[b, :, i, j] = (a + bb + c + d) / math.sqrt(DH)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_xl_relative_has_separate_position_projection_and_per_layer_biases():
    xl = _pos_module("xl_relative")
    names = {n for n, _ in xl.named_parameters()}
    assert names == {"r_proj.weight", "u", "v"}
    assert xl.r_proj.bias is None and xl.u.shape == (H, DH)


# -- DA-Transformer --------------------------------------------------------------------------------
def test_da_weight_function_properties():
    alpha = torch.tensor([-1.0, -0.1, 0.1, 1.0])
    beta = torch.tensor([0.0, 1.0, -1.0, 2.0])
    r = torch.arange(0, 50, dtype=torch.float32).view(1, 1, 1, 50)
    f = da_weight(r, alpha, beta)[0, :, 0]  # (H, 50)
    torch.testing.assert_close(f[:, 0], torch.ones(H), atol=1e-6, rtol=0)  # f(0) = 1
    want = (1 + torch.exp(beta))[:, None] / (1 + torch.exp(beta[:, None] - alpha[:, None] * r[0, 0]))
    torch.testing.assert_close(f, want, atol=1e-6, rtol=1e-6)
    d = f.diff(dim=-1)
    assert (d[:2] <= 0).all() and (d[2:] >= 0).all()  # monotonic, direction = sign of alpha
    assert (d[1] < 0).all() and (d[2] > 0).all()  # strictly where not saturated
    assert f[3].max().item() == pytest.approx(1 + math.exp(2.0), rel=1e-6)  # upper bound 1 + e^beta
    assert f[0, -1] < 1e-6  # -> 0 for alpha < 0


def test_distance_aware_transform_is_relu_scores_times_f():
    da = _pos_module("distance_aware")
    assert da.alpha.shape == (H,) and da.beta.shape == (H,) and da.needs_probs
    pos_q, pos_k = _positions()
    s = torch.randn(B, H, T, S)
    got = da.transform_scores(s, pos_q, pos_k)
    dist = (pos_q[:, None, :, None] - pos_k[:, None, None, :]).abs().float()
    f = (1 + torch.exp(da.beta))[None, :, None, None] / (1 + torch.exp(da.beta[None, :, None, None] - da.alpha[None, :, None, None] * dist))
    torch.testing.assert_close(got, torch.relu(s) * f, atol=1e-6, rtol=1e-6)


# -- shared: hooks accept extra leading dims (block-sparse kernels pass gathered blocks) -------------
@pytest.mark.parametrize("kind", POSITION.kinds())
def test_score_hooks_accept_extra_leading_dims(kind):
    mod = _pos_module(kind)
    nb = 3
    q = torch.randn(B, H, nb, T, DH)
    pq = torch.randint(0, 40, (B, nb, T))
    pk = torch.randint(0, 40, (B, nb, S))
    s = torch.randn(B, H, nb, T, S)
    p = torch.softmax(torch.randn(B, H, nb, T, S), -1)
    for blk in range(nb):
        sl = (slice(None), slice(None), blk)
        if mod.additive_bias:
            torch.testing.assert_close(mod.score_bias(q, pq, pk)[sl], mod.score_bias(q[sl], pq[:, blk], pk[:, blk]), atol=1e-6, rtol=0)
        torch.testing.assert_close(mod.content_query(q)[sl], mod.content_query(q[sl]), atol=0, rtol=0)
        torch.testing.assert_close(mod.rotate(q, pq)[sl], mod.rotate(q[sl], pq[:, blk]), atol=1e-6, rtol=0)
        torch.testing.assert_close(mod.transform_scores(s, pq, pk)[sl], mod.transform_scores(s[sl], pq[:, blk], pk[:, blk]), atol=1e-6, rtol=0)
        vt = mod.value_term(p, pq, pk)
        if vt is not None:
            torch.testing.assert_close(vt[sl], mod.value_term(p[sl], pq[:, blk], pk[:, blk]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", POSITION.kinds())
def test_every_position_kind_is_documented(kind):
    e = POSITION.get(kind)
    assert e.description and e.paper
    assert e.config_cls.__doc__ or kind in ("none", "alibi")


class _Peak(TorchDispatchMode):
    """Largest output (elements) of any op run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.peak = max(self.peak, t.numel())
        return out


# ------------------------------------------- Transformer-XL relative term, distance table size
def _xl_module(d=32, h=4):
    cfg = BackboneConfig.from_dict({"d_model": d, "n_heads": h, "n_layers": 1, "position": {"kind": "xl_relative"}})
    torch.manual_seed(0)
    mod = cfg.position.build(BuildContext(cfg).at_layer(0)).double()
    with torch.no_grad():
        mod.u.normal_()
        mod.v.normal_()
    return mod


def _brute_bias(mod, q, pos_q, pos_k):
    """(q_i + v)^T W_kR r_{i-j} / sqrt(Dh), terms (b) + (d) of Dai et al. 2019, sec. 3.3, pair by pair."""
    b, h, t, dh = q.shape
    s = pos_k.shape[-1]
    want = torch.empty(b, h, t, s, dtype=q.dtype)
    for bi in range(b):
        for i in range(t):
            for j in range(s):
                r = sinusoid(pos_q[bi, i] - pos_k[bi, j], mod.d_model, 10000.0, torch.float64)
                wr = mod.r_proj(r).view(h, dh)  # W_kR r_{i-j}, per head
                want[bi, :, i, j] = ((q[bi, :, i] + mod.v) * wr).sum(-1) / math.sqrt(dh)
    return want


def _far_apart(case: str, far: int, b: int, t: int):
    if case == "unfilled_memory":  # 8 unfilled memory slots (position 0) + the segment at step `far`
        seg = torch.arange(far, far + t).expand(b, t)
        return seg, torch.cat([torch.zeros(b, 8, dtype=torch.long), seg], 1)
    # memory of the old episode just before step `far`, then a new episode starting at 0 mid-window
    pos_k = torch.cat([torch.arange(far - 10, far).expand(b, 10), torch.arange(0, 2).expand(b, 2)], 1)
    pos_q = torch.cat([torch.arange(far, far + 2).expand(b, 2), torch.arange(0, 2).expand(b, 2)], 1)
    return pos_q, pos_k


@pytest.mark.parametrize("case", ["unfilled_memory", "episode_start_in_window"])
def test_xl_relative_bias_cost_does_not_depend_on_how_far_apart_positions_are(case):
    """Dai et al. 2019, sec. 3.3: R_{i-j} is needed only for the distances that occur. The bias
    projected a sinusoid for every integer in [min(i-j), max(i-j)] and built a (B, H, T, R)
    table: an empty XL memory (slots at position 0) read by a query at environment step 100,000
    (GTrXL's burn-in from mid-episode), or a window crossing an episode start (old steps ~1e5,
    new ones from 0), made R ~ 1e5 for 4 queries and 12 keys (6.4 and 12.8 million elements
    instead of under 2,000). The values must stay those of the paper; only the table changes."""
    mod = _xl_module()
    b, h, t, dh = 2, 4, 4, 8
    q = torch.randn(b, h, t, dh, dtype=torch.float64)
    peaks = []
    for far in (1_000, 100_000):
        pos_q, pos_k = _far_apart(case, far, b, t)
        with torch.no_grad(), _Peak() as peak:
            got = mod.score_bias(q, pos_q, pos_k)
        peaks.append(peak.peak)
        with torch.no_grad():
            torch.testing.assert_close(got, _brute_bias(mod, q, pos_q, pos_k), atol=1e-10, rtol=0)
    assert peaks[0] == peaks[1], peaks  # independent of the positions' magnitude
    assert peaks[1] <= 2_000, peaks  # a table over the ~30 distances that occur, not ~1e5


def test_xl_relative_bias_contiguous_positions_unchanged():
    """The usual case (contiguous positions, R = T + S - 1) keeps its exact values."""
    mod = _xl_module()
    q = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    pos_k = torch.arange(20, 29).expand(2, 9)
    pos_q = pos_k[:, -3:]
    with torch.no_grad():
        torch.testing.assert_close(mod.score_bias(q, pos_q, pos_k), _brute_bias(mod, q, pos_q, pos_k), atol=1e-10, rtol=0)


def test_an_embedding_table_beyond_int64_rows_is_refused_naming_the_option() -> None:
    """10**20 rows do not fit torch's int64 sizes: a ValueError naming the option, not torch's TypeError."""
    rows = 10**20
    with pytest.raises(ValueError) as exc:
        embedding_table(rows, 16, "agent.max_ep_len")
    assert str(exc.value) == (f"the ({rows}, 16) float32 table sized by agent.max_ep_len ({rows * 64:,} bytes) cannot "
                              f"be allocated; lower agent.max_ep_len to the largest position/step the data really has")
