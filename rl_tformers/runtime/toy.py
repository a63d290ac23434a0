"""``agent.kind=toy``: a seconds-long sequence-regression task that exercises the whole trainer.

Task: inputs ``x`` (B, T, in_dim) are i.i.d. standard normal; the target at token t is
``y_t = tanh(mean_{j <= t}(x_j) @ W)`` (B, T, out_dim) plus Gaussian noise, with a fixed random
``W`` (in_dim, out_dim) derived from the seed. Only a causal model can fit it: the target depends
on every past token. Model: linear embedding -> :class:`rl_tformers.Backbone` (with dropout, so
exact resume needs the RNG state) -> linear head. Loss: mean squared error.

It implements every part of the :class:`rl_tformers.runtime.agent_registry.Trainable` protocol:
a step-indexed dataset (batch ``s`` drawn from ``np.random.default_rng([seed, s])``), an
``evaluate`` on a fixed held-out set (with an optional matplotlib figure), and
``extra_state`` holding the input normalisation statistics. Used by the tests and by
``make demo`` until the Decision Transformer lands (``rl-tformers train --config toy``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rl_tformers.backbone import Backbone
from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.runtime.agent_registry import register_agent
from rl_tformers.runtime.run_config import to_container
from rl_tformers.runtime.seeding import derive_seed

TOY_DEFAULTS = {
    "agent": {
        "in_dim": 3,  # input features per token
        "out_dim": 2,  # regression targets per token
        "seq_len": 8,  # T, tokens per sequence
        "noise": 0.01,  # std of the target noise
        "eval_size": 64,  # held-out sequences for evaluate()
        "eval_figure": False,  # also log a predictions-vs-targets figure
    },
    "backbone": {"d_model": 16, "n_layers": 1, "n_heads": 2, "dropout": 0.1, "attn_dropout": 0.1,
                 "position": {"kind": "learned"}, "max_position": 64},
    "train": {"batch_size": 16},
}


def make_task(seed: int, in_dim: int, out_dim: int) -> np.ndarray:
    """The fixed projection W (in_dim, out_dim), float32, scaled so targets have unit-order variance."""
    rng = np.random.default_rng(derive_seed(seed, "toy-task"))
    return (rng.standard_normal((in_dim, out_dim)) * np.sqrt(3.0 / in_dim)).astype(np.float32)


def sample(rng: np.random.Generator, w: np.ndarray, batch: int, seq_len: int, noise: float) -> dict[str, Tensor]:
    """One batch: ``{"x": (B, T, in_dim), "y": (B, T, out_dim)}`` float32 CPU tensors."""
    x = rng.standard_normal((batch, seq_len, w.shape[0])).astype(np.float32)  # (B, T, in)
    running_mean = np.cumsum(x, axis=1) / np.arange(1, seq_len + 1, dtype=np.float32)[None, :, None]  # (B, T, in)
    y = np.tanh(running_mean @ w) + noise * rng.standard_normal((batch, seq_len, w.shape[1])).astype(np.float32)
    return {"x": torch.from_numpy(x), "y": torch.from_numpy(y.astype(np.float32))}


class ToyBatches(torch.utils.data.Dataset):
    """Step-indexed dataset: ``ds[s]`` is the batch for update ``s``, from ``default_rng([seed, s])``."""

    def __init__(self, seed: int, w: np.ndarray, batch: int, seq_len: int, noise: float, length: int) -> None:
        self.seed, self.w, self.batch, self.seq_len, self.noise, self.length = seed, w, batch, seq_len, noise, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, step: int) -> dict[str, Tensor]:
        rng = np.random.default_rng([self.seed, int(step)])
        return sample(rng, self.w, self.batch, self.seq_len, self.noise)


class ToyModel(nn.Module):
    """``(B, T, in_dim)`` -> ``(B, T, out_dim)``: normalise, embed, causal backbone, head."""

    def __init__(self, in_dim: int, out_dim: int, backbone: BackboneConfig) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, backbone.d_model)
        self.backbone = Backbone(backbone)
        self.head = nn.Linear(backbone.d_model, out_dim)
        self.register_buffer("x_mean", torch.zeros(in_dim), persistent=False)
        self.register_buffer("x_std", torch.ones(in_dim), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed((x - self.x_mean) / self.x_std)  # (B, T, D)
        return self.head(self.backbone(h).hidden)  # (B, T, out_dim)


class ToyAgent:
    """The toy :class:`~rl_tformers.runtime.agent_registry.Trainable` (see the module docstring)."""

    def __init__(self, cfg: Any, device: torch.device) -> None:
        a = cfg.agent
        self.seed = int(cfg.seed)
        self.batch_size = int(cfg.train.batch_size)
        self.steps = int(cfg.train.steps)
        self.seq_len, self.noise = int(a.seq_len), float(a.noise)
        self.eval_figure = bool(a.eval_figure)
        self.w = make_task(self.seed, int(a.in_dim), int(a.out_dim))
        self.model = ToyModel(int(a.in_dim), int(a.out_dim), BackboneConfig.from_dict(to_container(cfg.backbone))).to(device)
        # Input statistics from a "dataset" of 1024 sequences (what a real agent stores for observations).
        stats = sample(np.random.default_rng(derive_seed(self.seed, "toy-stats")), self.w, 1024, self.seq_len, 0.0)["x"]
        self.load_extra_state({"x_mean": stats.mean((0, 1)), "x_std": stats.std((0, 1))})
        self.eval_set = sample(np.random.default_rng(derive_seed(self.seed, "toy-eval")), self.w, int(a.eval_size),
                               self.seq_len, self.noise)

    def batches(self, start_step: int) -> ToyBatches:
        return ToyBatches(self.seed, self.w, self.batch_size, self.seq_len, self.noise, self.steps)

    def loss(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        pred = self.model(batch["x"])  # (B, T, out)
        err = pred.float() - batch["y"]
        mse = err.pow(2).mean()
        return mse, {"mae": err.abs().mean().detach()}

    def evaluate(self, step: int) -> dict[str, Any]:
        dev = next(self.model.parameters()).device
        x, y = self.eval_set["x"].to(dev), self.eval_set["y"].to(dev)
        pred = self.model(x).float()
        out: dict[str, Any] = {"mse": float((pred - y).pow(2).mean()), "return": -float((pred - y).pow(2).mean())}
        if self.eval_figure:
            from matplotlib.figure import Figure  # no pyplot: no global backend state

            fig = Figure(figsize=(3, 3))
            ax = fig.subplots()
            ax.scatter(y[..., 0].flatten().cpu(), pred[..., 0].flatten().cpu(), s=2)
            ax.set_xlabel("target")
            ax.set_ylabel("prediction")
            ax.set_title(f"step {step}")
            out["predictions"] = fig
        return out

    def extra_state(self) -> dict[str, Tensor]:
        return {"x_mean": self.model.x_mean.cpu().clone(), "x_std": self.model.x_std.cpu().clone()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.model.x_mean.copy_(torch.as_tensor(state["x_mean"]))
        self.model.x_std.copy_(torch.as_tensor(state["x_std"]))


@register_agent("toy", description="tiny causal sequence regression (tests, demo fallback)", defaults=TOY_DEFAULTS)
def build_toy(cfg: Any, run_dir: Path, device: torch.device) -> ToyAgent:
    """Builder of ``agent.kind=toy``."""
    return ToyAgent(cfg, device)
