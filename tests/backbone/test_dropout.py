"""The backbone library's dropout (rl_tformers/dropout.py): four 16-bit lanes per 64-bit draw on
the CPU, the drop probability rounded to 2^-16, inverted scaling, seeded reproducibility."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_tformers.dropout import Dropout, dropout, keep_mask, quantised_p, torch_draws


def test_quantised_p_rounds_to_a_multiple_of_2_to_the_minus_16():
    assert quantised_p(0.1) == 6554 / 65536
    assert quantised_p(0.5) == 0.5
    assert abs(quantised_p(0.1) - 0.1) <= 2 ** -17


def test_keep_mask_reads_four_16_bit_lanes_of_each_64_bit_draw():
    torch.manual_seed(5)
    mask = keep_mask((3, 7), 0.25)  # 21 elements: 6 draws, the last one's lanes partly unused
    torch.manual_seed(5)
    words = torch.empty(6, dtype=torch.int64).random_(-(1 << 63), None)
    lanes = words.view(torch.int16)[:21].view(3, 7)
    assert torch.equal(mask, lanes >= 16384 - 32768)  # m = 0.25 * 65536 = 16384 dropped values
    assert mask.dtype == torch.bool


def test_each_lane_drops_with_probability_p_independently_of_its_neighbours():
    torch.manual_seed(0)
    n = 1 << 22
    drop = ~keep_mask((n,), 0.1)
    p = quantised_p(0.1)
    sd = (p * (1 - p) / (n // 4)) ** 0.5  # of one lane's rate
    for lane in range(4):  # the 16-bit lanes of one draw
        assert abs(drop[lane::4].double().mean().item() - p) < 5 * sd
    both = (drop[0::4] & drop[1::4]).double().mean().item()  # neighbours of one draw
    assert abs(both - p * p) < 5 * (p * p * (1 - p * p) / (n // 4)) ** 0.5
    across = (drop[3:-4:4] & drop[4::4]).double().mean().item()  # last lane of a draw, first of the next
    assert abs(across - p * p) < 5 * (p * p * (1 - p * p) / (n // 4)) ** 0.5


def test_kept_elements_are_scaled_by_one_over_one_minus_p_and_the_rest_are_zero():
    x = torch.randn(64, 60, 128)
    torch.manual_seed(1)
    y = dropout(x, 0.1)
    torch.manual_seed(1)
    keep = keep_mask(x.shape, 0.1)
    assert torch.equal(y, x * keep * (65536 / (65536 - 6554)))
    assert torch.equal(y == 0, ~keep | (x == 0))


def test_the_gradient_is_the_same_mask_and_scale():
    x = torch.randn(8, 5, 16, requires_grad=True)
    g = torch.randn(8, 5, 16)
    torch.manual_seed(2)
    dropout(x, 0.3).backward(g)
    torch.manual_seed(2)
    keep = keep_mask(x.shape, 0.3)
    assert torch.equal(x.grad, g * keep * (1 / (1 - quantised_p(0.3))))


def test_the_same_seed_gives_the_same_draws_and_bf16_stays_bf16():
    x = torch.randn(4, 9, 32)
    torch.manual_seed(7)
    a = dropout(x, 0.2)
    torch.manual_seed(7)
    assert torch.equal(a, dropout(x, 0.2))
    assert dropout(x.bfloat16(), 0.2).dtype == torch.bfloat16


def test_outside_training_and_at_p_zero_the_input_comes_back_unchanged():
    x = torch.randn(3, 4)
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0) is x
    module = Dropout(0.5).eval()
    assert module(x) is x
    assert "p=0.5" in repr(module)


def test_a_p_that_rounds_to_0_or_1_uses_torch_dropout():
    x = torch.randn(1000)
    for p in (1e-6, 1.0):
        torch.manual_seed(4)
        ours = dropout(x, p)
        torch.manual_seed(4)
        assert torch.equal(ours, F.dropout(x, p))
    with pytest.raises(ValueError, match="rounds to 0/65536"):
        keep_mask((4,), 1e-6)


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_a_probability_outside_0_1_is_refused(p):
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout(torch.ones(2), p)
    with pytest.raises(ValueError, match="between 0 and 1"):
        Dropout(p)


def test_inside_torch_draws_every_call_is_torch_dropout():
    x = torch.randn(6, 50)
    torch.manual_seed(9)
    with torch_draws():
        inside = dropout(x, 0.1)
    torch.manual_seed(9)
    assert torch.equal(inside, F.dropout(x, 0.1))
    torch.manual_seed(9)
    assert not torch.equal(dropout(x, 0.1), inside)  # the lanes again after the block
