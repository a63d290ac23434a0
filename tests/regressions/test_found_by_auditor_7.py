"""Defects found by the seventh auditor (attention and position kinds against the survey and the
papers): Performer's orthogonal random features were not isotropic (raw QR factor), gated RFA
let a padded key's gate decay the state, the sliding window's test pattern failed with fewer
keys than queries (cross-attention), blockwise attention sent whole query blocks to an empty
block when S was short and not a multiple of n_blocks.

Every test is tiny (a few tokens, a 16-wide model) and runs in well under a second.
"""

from __future__ import annotations

import torch

from rl_tformers.attention._linear import orthogonal_gaussian
from rl_tformers.backbone_config import BackboneConfig, BuildContext
from rl_tformers.types import AttnContext

D, H = 16, 2


def _module(kind: str, causal: bool, **fields):
    cfg = {
        "d_model": D, "n_layers": 1, "n_heads": H, "d_ff": 32, "dropout": 0.0, "attn_dropout": 0.0,
        "attention": {"kind": kind, **fields}, "position": {"kind": "none"}, "causal": causal,
    }
    bcfg = BackboneConfig.from_dict(cfg)
    ctx = BuildContext(bcfg).at_layer(0)
    torch.manual_seed(0)
    return bcfg.attention.build(ctx, bcfg.position.build(ctx)).eval()


# ------------------------------------------------- 1: Performer's orthogonal features (FAVOR+)
def test_orthogonal_random_features_are_isotropic_and_unbiased():
    """Choromanski et al. 2021, sec. 2.4: every row must be marginally N(0, I). The raw Q of
    torch.linalg.qr (Householder) always gave the first row of a block a non-positive first
    coordinate (fraction 1.0), so E[exp(w . x)] missed exp(|x|^2 / 2) by ~5% at |x| = 0.6."""
    dim, blocks = 4, 4000
    w = orthogonal_gaussian(dim * blocks, dim, torch.Generator().manual_seed(0))  # (rows, dim)
    first = w[0::dim, 0]  # first coordinate of the first row of every block
    frac_neg = (first < 0).float().mean().item()
    assert 0.45 < frac_neg < 0.55, frac_neg  # was 1.0
    assert w.mean(0).abs().max().item() < 0.05  # was ~0.1 per coordinate
    # still exactly orthogonal inside a block
    blk = w[:dim] / w[:dim].norm(dim=1, keepdim=True)
    torch.testing.assert_close(blk @ blk.T, torch.eye(dim), atol=1e-5, rtol=0)
    # the positive-feature identity E[exp(w . x)] = exp(|x|^2 / 2), both signs of x
    for s in (0.6, -0.6):
        x = torch.tensor([s, 0.0, 0.0, 0.0])
        est = torch.exp(w @ x).mean().item()
        assert abs(est / torch.exp((x * x).sum() / 2).item() - 1) < 0.01, (s, est)


# ------------------------------------------------------------ 2: gated RFA and key padding
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
    torch.testing.assert_close(b[valid], a[valid], atol=1e-6, rtol=0)  # was off by ~0.2
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


# ---------------------------------------------- 3: sliding window as cross-attention (S < T)
def test_sliding_window_reference_with_fewer_keys_than_queries():
    """``sliding_window`` declares cross_attention; its pattern() (the reference's mask) sliced the
    global-token table by a negative prefix length when S < T and raised a shape error."""
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


# --------------------------------------- 4: blockwise permutations over blocks that exist
def test_blockwise_short_sequence_never_maps_a_query_block_to_an_empty_block():
    """BlockBERT: head h attends block pi_h(i) = (i + k) mod n. With S = 6 and n_blocks = 4 the
    blocks of ceil(6 / 4) = 2 keys are only 3; block 2 (shift 1) mapped to block 3, which holds no
    key, so its queries got no key at all (zero outputs on that head)."""
    mod = _module("blockwise", False, n_blocks=4, heads_per_shift=(1, 1))
    for t in (6, 9):
        pos = torch.arange(t)[None]
        ctx = AttnContext(pos_q=pos, pos_k=pos, causal=False)
        pat = mod.pattern(ctx)  # (1, H, T, S)
        assert bool(pat.any(-1).all()), (t, (~pat.any(-1)).sum(-1))  # was 2 / 3 empty rows on head 1
        x = torch.randn(1, t, D, generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            torch.testing.assert_close(mod(x, x, ctx).out, mod.reference_forward(x, x, ctx).out, atol=1e-5, rtol=0)
    # S a multiple of n: exactly the paper's pattern, block i -> block (i + 1) mod 4
    pos = torch.arange(8)[None]
    pat = mod.pattern(AttnContext(pos_q=pos, pos_k=pos, causal=False))[0, 1]
    blk = torch.arange(8) // 2
    assert torch.equal(pat, blk[None, :] == (blk[:, None] + 1) % 4)
