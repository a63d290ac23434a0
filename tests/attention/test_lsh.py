"""Reformer LSH attention over several hash rounds against a brute-force union written from the
paper (Kitaev et al. 2020, sec. 2 and appendix A).

Round r hashes every key to a bucket h_r(x) = argmax([x R_r; -x R_r]); within an episode, the
keys of one bucket are sorted by position and cut into chunks of m; query i may attend the keys
of its bucket in its own chunk and the previous one (P_i^(r)), under the causal, padding and
episode masks. The rounds combine into ONE softmax over the union P_i = U_r P_i^(r) (a key
found by several rounds counts once), and a query attends itself only when P_i holds no other
key. The reference below builds P_i per query with Python sets and takes that softmax directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_tformers.backbone_config import BackboneConfig, BuildContext
from rl_tformers.types import AttnContext

D, H, M = 16, 2, 2  # width, heads, chunk length m


def lsh_module(causal: bool, n_hashes: int, n_buckets: int = 4):
    cfg = BackboneConfig.from_dict(
        {"d_model": D, "n_layers": 1, "n_heads": H, "dropout": 0.0, "attn_dropout": 0.0, "causal": causal,
         "attention": {"kind": "lsh", "bucket_size": M, "n_hashes": n_hashes, "n_buckets": n_buckets, "seed": 3}}
    )
    ctx = BuildContext(cfg).at_layer(0)
    torch.manual_seed(0)
    return cfg.attention.build(ctx, cfg.position.build(ctx)).double().eval()


def inputs(causal: bool, s: int = 18, t: int = 14):
    """x_kv (2, S, D) float64 with the queries the last T; row 0: right padding and a new episode
    at key 9; row 1: left padding."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, s, D, generator=g, dtype=torch.float64)
    pos = torch.arange(s).expand(2, s)
    valid = torch.ones(2, s, dtype=torch.bool)
    valid[0, -2:] = False
    valid[1, :3] = False
    seg = torch.zeros(2, s, dtype=torch.long)
    seg[0, 9:] = 1
    ctx = AttnContext(pos_q=pos[:, s - t:], pos_k=pos, key_valid=valid, seg_q=seg[:, s - t:], seg_k=seg,
                      causal=causal)
    return x[:, s - t:], x, ctx


def union_reference(mod, x_kv: torch.Tensor, ctx: AttnContext, t: int) -> torch.Tensor:
    """softmax over P_i = U_r P_i^(r) (self only when alone) for the last t keys as queries, per
    row and head, from the definitions in the module docstring; (B, T, D) after o_proj."""
    qk = mod.split_heads(mod.q_proj(x_kv))  # (B, H, S, Dh): shared QK, position kind none
    keys = F.normalize(qk, dim=-1)  # k_j = q_j / |q_j|
    v = mod.split_heads(mod.v_proj(x_kv))
    b, h, s, _ = qk.shape
    nb, r_count = mod.cfg.n_buckets, mod.cfg.n_hashes
    rot = mod.rotations[:, :, : nb // 2].float()  # (R, Dh, nb / 2)
    y = torch.zeros(b, h, t, qk.shape[-1], dtype=qk.dtype)
    for bi in range(b):
        valid, seg = ctx.key_valid[bi].tolist(), ctx.seg_k[bi].tolist()
        for hi in range(h):
            proj = keys[bi, hi].float() @ rot  # (R, S, nb / 2)
            bucket = torch.cat([proj, -proj], -1).argmax(-1).tolist()  # (R, S)
            chunk = [{} for _ in range(r_count)]
            for r in range(r_count):
                groups: dict[tuple[int, int], list[int]] = {}
                for j in range(s):
                    if valid[j]:
                        groups.setdefault((seg[j], bucket[r][j]), []).append(j)  # in position order
                for members in groups.values():
                    for rank, j in enumerate(members):
                        chunk[r][j] = rank // M
            for qi in range(t):
                i = s - t + qi
                if not valid[i]:
                    continue  # a padded query: output unspecified
                union = set()
                for r in range(r_count):
                    union |= {j for j in range(s) if valid[j] and seg[j] == seg[i] and bucket[r][j] == bucket[r][i]
                              and 0 <= chunk[r][i] - chunk[r][j] <= 1 and (not ctx.causal or j <= i)}
                if union - {i}:
                    union.discard(i)
                idx = torch.tensor(sorted(union))
                p = torch.softmax((qk[bi, hi, i] @ keys[bi, hi, idx].T) * mod.scale, -1)
                y[bi, hi, qi] = p @ v[bi, hi, idx]
    return mod.o_proj(mod.merge_heads(y))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_hashes", [2, 4])
def test_rounds_combine_into_one_softmax_over_the_union_of_their_buckets(causal, n_hashes):
    mod = lsh_module(causal, n_hashes)
    x_q, x_kv, ctx = inputs(causal)
    t = x_q.shape[1]
    with torch.no_grad():
        got = mod(x_q, x_kv, ctx).out
        want = union_reference(mod, x_kv, ctx, t)
    vq = ctx.key_valid[:, -t:]
    torch.testing.assert_close(got[vq], want[vq], atol=1e-12, rtol=0)


def test_identical_rounds_equal_one_round():
    """Rounds with the same rotations find the same sets: their union is one round's set, each key
    counted once (no duplicate weight), so the output equals a single round's exactly."""
    one = lsh_module(True, 1)
    three = lsh_module(True, 3)
    with torch.no_grad():
        three.rotations.copy_(one.rotations.expand_as(three.rotations))
        three.load_state_dict({k: v for k, v in one.state_dict().items() if k != "rotations"}, strict=False)
    x_q, x_kv, ctx = inputs(True)
    with torch.no_grad():
        a, b = one(x_q, x_kv, ctx).out, three(x_q, x_kv, ctx).out
    vq = ctx.key_valid[:, -x_q.shape[1]:]
    torch.testing.assert_close(b[vq], a[vq], atol=1e-12, rtol=0)


def test_a_query_attends_itself_only_when_no_round_gives_it_another_key():
    """Causal, one bucket per round: the first valid token of each row has only itself (its
    output is its own value); every later one has earlier keys and never attends itself."""
    mod = lsh_module(True, 2, n_buckets=1)
    _, x_kv, ctx = inputs(True)
    s = x_kv.shape[1]
    with torch.no_grad():
        got = mod(x_kv, x_kv, AttnContext(pos_q=ctx.pos_k, pos_k=ctx.pos_k, key_valid=ctx.key_valid, causal=True)).out
        own = mod.o_proj(mod.v_proj(x_kv))  # softmax over the one key itself
    torch.testing.assert_close(got[0, 0], own[0, 0], atol=1e-12, rtol=0)
    torch.testing.assert_close(got[1, 3], own[1, 3], atol=1e-12, rtol=0)
    assert (got[0, 1:s - 2] - own[0, 1:s - 2]).abs().amax(-1).min() > 1e-3  # later tokens: not their own value
