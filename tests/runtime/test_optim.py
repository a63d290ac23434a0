"""AdamW parameter groups and learning-rate schedules."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from rl_tformers.runtime.optim import (
    LRSchedule,
    build_optimizer,
    build_scheduler,
    default_param_groups,
    restore_scheduler,
    scheduler_state,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.scale = nn.Parameter(torch.ones(4))
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.tied = self.lin  # shared module: its parameters are listed once


def test_decay_groups() -> None:
    net = Net()
    groups = {g["name"]: g for g in default_param_groups(net, 0.1)}
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(groups["decay"]["params"]) == {id(net.lin.weight)}
    assert ids(groups["no_decay"]["params"]) == ids([net.emb.weight, net.lin.bias, net.norm.weight, net.norm.bias, net.scale])
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    opt = build_optimizer(default_param_groups(net, 0.1), lr=1e-3, weight_decay=0.1)
    assert [g["name"] for g in opt.param_groups] == ["decay", "no_decay"]


def test_custom_groups_and_errors() -> None:
    net = Net()
    opt = build_optimizer([{"params": [net.lin.weight], "lr_scale": 0.5}, {"params": [net.scale]}], lr=1e-2,
                          weight_decay=0.3)
    assert [g["lr"] for g in opt.param_groups] == [5e-3, 1e-2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.3]
    with pytest.raises(ValueError, match="more than one group"):
        build_optimizer([{"params": [net.scale]}, {"params": [net.scale]}], lr=1, weight_decay=0)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([{"params": list(net.frozen.parameters())}], lr=1, weight_decay=0)


def test_schedules() -> None:
    assert [LRSchedule("constant", 10, 4)(s) for s in (0, 9)] == [1.0, 1.0]
    w = LRSchedule("linear_warmup", 10, 4)
    assert [w(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    c = LRSchedule("warmup_cosine", 14, 4, min_lr_ratio=0.1)
    assert c(3) == 1.0 and c(4) == 1.0
    assert math.isclose(c(9), 0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert c(14) == pytest.approx(0.1) and c(100) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="train.schedule"):
        LRSchedule("step", 10)


def test_scheduler_restore_matches_uninterrupted() -> None:
    def make():
        p = nn.Parameter(torch.zeros(1))
        opt = torch.optim.AdamW([p], lr=0.1)
        return opt, build_scheduler(opt, LRSchedule("warmup_cosine", 20, 5, 0.0))

    opt, sched = make()
    for _ in range(7):
        opt.step()
        sched.step()
    state, lr = scheduler_state(sched), opt.param_groups[0]["lr"]
    opt2, sched2 = make()
    restore_scheduler(sched2, state)
    assert opt2.param_groups[0]["lr"] == lr
    opt.step(), sched.step(), opt2.step(), sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
