"""Helpers for the runtime tests: tiny toy configs, TensorBoard event reading, weight comparison."""

from __future__ import annotations

from pathlib import Path

import torch

from rl_tformers.runtime.run_config import compose


def toy_cfg(*overrides: str):
    """A toy run small enough for a few hundred updates per second on one CPU core."""
    base = [
        "agent.kind=toy",
        "device=cpu",
        "train.progress=false",
        "train.steps=40",
        "train.batch_size=8",
        "train.log_every=5",
        "train.checkpoint_every=10",
        "train.keep_last=10",
        "train.lr=3e-3",
        "train.warmup_steps=5",
        "eval.at_end=false",
    ]
    return compose(None, [*base, *overrides])


def read_events(run_dir: Path) -> list:
    """Every Event proto of the run, files in TensorBoard's order (by name), records in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from rl_tformers.runtime.tracking import event_files

    out = []
    for path in event_files(run_dir):
        out.extend(EventFileLoader(str(path)).Load())
    return out


def scalar_steps(run_dir: Path) -> list[tuple[str, int]]:
    """(tag, step) of every scalar summary value, in file order."""
    out = []
    for ev in read_events(run_dir):
        for v in ev.summary.value:
            if v.metadata.plugin_data.plugin_name == "scalars" or v.HasField("simple_value"):
                out.append((v.tag, ev.step))
    return out


def model_state(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{step:09d}.pt", weights_only=True)["model"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
