"""Training step time of the image observation encoders under memory formats and autocast.

For each image kind (``nature_cnn``, ``impala_cnn``) one forward and backward pass over N uint8
``(4, 84, 84)`` frames (a DT batch of B windows of K steps folds to N = B K frames), timed in
four settings, all in one process so that the ratios compare like with like:

- ``fp32``: float32, contiguous (NCHW) tensors (the baseline of every ratio);
- ``fp32+channels_last``: ``agent.encoder.channels_last=true``;
- ``bf16``: ``torch.autocast(device, bfloat16)`` (``train.amp=bf16``);
- ``bf16+channels_last``: both.

Reports the median of ``repeats`` timed passes after ``warmup`` untimed ones, in ms, and each
setting's time over the ``fp32`` one of the same kind (the settings take turns pass by pass)::

    python scripts/bench_encoders.py --frames 256 --repeats 10 [--device cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from rl_tformers.agents.common.encoders import EncoderConfig

SETTINGS = (("fp32", False, False), ("fp32+channels_last", True, False), ("bf16", False, True),
            ("bf16+channels_last", True, True))


def _pass(enc: torch.nn.Module, x: torch.Tensor, bf16: bool, device: str) -> float:
    """ms of one forward + backward pass of ``enc`` over ``x``."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
        y = enc(x)  # (frames, F)
    y.float().square().mean().backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    enc.zero_grad(set_to_none=True)
    return 1000.0 * (time.perf_counter() - t)


def run(frames: int = 256, repeats: int = 10, warmup: int = 2, device: str = "cpu") -> list[dict[str, Any]]:
    """One row per (kind, setting): ``kind``, ``setting``, ``ms`` (median) and ``ratio`` (to the
    kind's fp32). The settings take turns pass by pass, so a change of machine load spreads over
    all of them instead of biasing one."""
    rows = []
    x = torch.randint(0, 256, (frames, 4, 84, 84), dtype=torch.uint8, device=device)
    for kind in ("nature_cnn", "impala_cnn"):
        encs = []
        for _, last, _ in SETTINGS:
            torch.manual_seed(0)
            encs.append(EncoderConfig.from_dict({"kind": kind, "channels_last": last}).build((4, 84, 84)).to(device))
        times: list[list[float]] = [[] for _ in SETTINGS]
        for i in range(warmup + repeats):
            for j, (enc, (_, _, bf16)) in enumerate(zip(encs, SETTINGS)):
                ms = _pass(enc, x, bf16, device)
                if i >= warmup:
                    times[j].append(ms)
        base = statistics.median(times[0])
        for (name, _, _), ts in zip(SETTINGS, times):
            rows.append({"kind": kind, "setting": name, "ms": statistics.median(ts),
                         "ratio": statistics.median(ts) / base})
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=256, help="N frames per pass (B x K of a DT batch)")
    p.add_argument("--repeats", type=int, default=10, help="timed passes (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed passes first")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = p.parse_args(argv)
    rows = run(a.frames, a.repeats, a.warmup, a.device)
    if a.json:
        print(json.dumps({"frames": a.frames, "threads": torch.get_num_threads(), "rows": rows}))
        return
    print(f"forward + backward over {a.frames} uint8 (4, 84, 84) frames on {a.device}, "
          f"{torch.get_num_threads()} threads (median of {a.repeats})")
    for r in rows:
        print(f"  {r['kind']:<11} {r['setting']:<19} {r['ms']:9.1f} ms  x{r['ratio']:.2f}")
