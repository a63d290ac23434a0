"""Defects found by the eighth auditor (memory, adaptive-depth and block kinds against the survey
and the papers): Transformer-XL's relative term built a table over the whole span of distances
(unfilled memory at position 0, or an episode start inside the window, made it as long as the
episode), the dilated-convolution compressor did not start as mean pooling unless the rate was
a power of two (the default rate 3 gave 3/4 of the mean), and ACT kept its halting bookkeeping
in the model's dtype (a bfloat16 model's halting weights no longer summed to 1).

Every test is tiny (a few tokens, a 16- or 32-wide model) and runs in well under a second.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_tformers import Backbone, BackboneConfig
from rl_tformers.backbone_config import BuildContext
from rl_tformers.memory.compressive import Compressor
from rl_tformers.position.absolute import sinusoid
from rl_tformers.types import AttnContext


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


# ------------------------------------------- 1: Transformer-XL relative term, distance table size
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


# ------------------------------------------------------- 2: dilated-convolution compressor at init
@pytest.mark.parametrize("rate", [1, 2, 3, 4, 5, 6, 8])
def test_dilated_conv_compressor_starts_as_mean_pooling_for_every_rate(rate):
    """Rae et al. 2019, sec. 3.1 (f_c = dilated convolution) and the module's own contract
    ("initialised to averaging", like ``conv``). Every kernel-2 layer started at taps (1/2, 1/2),
    so the readout was sum(members) / 2^L with 2^L = the receptive field: the mean only when
    c = 2^L. With the default rate 3 each compressed slot was 3/4 of the mean, with rate 1 half
    the activation. Taps c^(-1/L) make the L-layer stack read exactly the mean of the c members."""
    torch.manual_seed(0)
    d = 8
    x = torch.randn(2, 3, rate, d)  # (B, G, c, D)
    comp = Compressor("dilated_conv", d, rate, False)
    out = comp(x, torch.ones(2, 3, rate, dtype=torch.bool))
    torch.testing.assert_close(out, x.mean(2), atol=1e-6, rtol=0)  # float32 taps: rounding only


def test_dilated_conv_compressor_with_excluded_members_matches_conv():
    """Excluded members are zeroed before both learned compressors: at init both give
    sum(included) / c (the same value; the pooling kinds divide by the number included)."""
    torch.manual_seed(1)
    d, rate = 8, 3
    x = torch.randn(1, 2, rate, d)
    inc = torch.tensor([[[True, True, True], [False, True, True]]])
    conv = Compressor("conv", d, rate, False)(x, inc)
    dil = Compressor("dilated_conv", d, rate, False)(x, inc)
    torch.testing.assert_close(dil, conv, atol=1e-6, rtol=0)
    torch.testing.assert_close(dil[0, 1], x[0, 1, 1:].sum(0) / rate, atol=1e-6, rtol=0)


# ---------------------------------------------------------- 3: ACT bookkeeping in reduced precision
def test_act_halting_weights_sum_to_one_in_a_bfloat16_model():
    """Graves 2016, sec. 2 (eq. 5-7): the halting weights p_1..p_{N-1}, R sum to exactly 1 and
    N = min{n : sum p >= 1 - eps}. A bfloat16 model accumulated the halting sum in bfloat16:
    with p = sigmoid(-5) = 0.0067 (148 steps) the increments fell below bfloat16's spacing near
    1, so it halted at step 142 with weights summing to 0.96 (and N counted in bfloat16 stops at
    256). The bookkeeping must run in float32 (the float32 model's N and a sum of 1)."""
    d = 16
    cfg = {"d_model": d, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
           "depth": {"kind": "universal", "max_steps": 400, "epsilon": 0.01}}
    torch.manual_seed(0)
    bb = Backbone(cfg).eval()
    with torch.no_grad():
        bb.depth.halt.weight.zero_()
        bb.depth.halt.bias.fill_(-5.0)  # exactly representable: the same logit in both dtypes
    x = torch.randn(1, 3, d)
    pos = torch.arange(3)[None]
    p = torch.sigmoid(torch.tensor(-5.0))
    n_ref, total = 0, torch.tensor(0.0)
    while True:  # plain-loop ACT (Graves): the first n with sum_{n' <= n} p >= 1 - eps
        n_ref += 1
        if total + p >= 0.99:
            break
        total = total + p
    with torch.no_grad():
        r32 = bb.depth.run(x, AttnContext(pos_q=pos, pos_k=pos))
        r16 = bb.to(torch.bfloat16).depth.run(x.bfloat16(), AttnContext(pos_q=pos, pos_k=pos))
    assert n_ref == 148
    assert r32.n_updates.tolist() == [[148.0] * 3]
    assert r16.n_updates.float().tolist() == [[148.0] * 3]
    torch.testing.assert_close(r16.weights.float().sum(-1), torch.ones(1, 3), atol=1e-5, rtol=0)  # float32 sum of 148
    torch.testing.assert_close(r16.remainders.float(), 1 - total.expand(1, 3), atol=1e-5, rtol=0)
    assert r16.hidden.dtype == torch.bfloat16


def test_act_halting_with_many_steps_counts_beyond_bfloat16_integers():
    """N above 256 (bfloat16 represents integers exactly only up to 256)."""
    d = 16
    cfg = {"d_model": d, "n_layers": 1, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0,
           "depth": {"kind": "universal", "max_steps": 300, "epsilon": 0.01, "coordinate": False}}
    torch.manual_seed(0)
    bb = Backbone(cfg).eval()
    with torch.no_grad():
        bb.depth.halt.weight.zero_()
        bb.depth.halt.bias.fill_(-9.0)  # p = 1.2e-4: every position runs to max_steps
    pos = torch.arange(2)[None]
    with torch.no_grad():
        res = bb.to(torch.bfloat16).depth.run(torch.randn(1, 2, d).bfloat16(), AttnContext(pos_q=pos, pos_k=pos))
    assert res.steps == 300 and res.n_updates.float().tolist() == [[300.0, 300.0]]
    torch.testing.assert_close(res.weights.float().sum(-1), torch.ones(1, 2), atol=1e-5, rtol=0)
