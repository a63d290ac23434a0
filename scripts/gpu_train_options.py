"""Short trainings of the shipped DT config on one device with the GPU options, one process.

Variants (each ``train.steps`` updates of ``dt/hopper_medium`` on the given dataset, no
evaluation, a log window every ``--log-every`` updates):

1. fp32, batches drawn on the host (``train.data_on_device=false``: the baseline);
2. fp32, ``train.data_on_device=true`` (the dataset held on the device);
3. 2 + ``train.amp=bf16``;
4. 3 + ``train.compile=true``;
5. 3 + ``train.cuda_graphs=true`` (``torch.compile(mode="reduce-overhead")``).

Variants 4 and 5 need Triton (``--no-compile`` leaves them out). For each: updates/s (the
trainer's own ``perf/steps_per_s``, median of the windows after the first, so compilation and
warm-up are not counted), the window losses, and the wall seconds of the whole run. The losses of
1 and 2 come from the same batches (``data_on_device`` changes where they are gathered, not
what they hold): their largest difference is reported. The JSON is rewritten after every variant;
a variant that would start after ``--budget-s`` seconds is skipped (listed in ``skipped``).

Usage: python scripts/gpu_train_options.py --dataset FILE --out OUT.json [--device cuda]
       [--steps 300] [--log-every 50] [--budget-s 100] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rl_tformers.runtime.host import host_description
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train

ON_DEVICE = ["train.data_on_device=true"]
BF16 = [*ON_DEVICE, "train.amp=bf16"]
VARIANTS = [
    ("fp32, host batches", []),
    ("fp32, data on device", ON_DEVICE),
    ("bf16, data on device", BF16),
    ("bf16, data on device, compile", [*BF16, "train.compile=true"]),
    ("bf16, data on device, CUDA graphs", [*BF16, "train.cuda_graphs=true"]),
]


def run_variant(args: argparse.Namespace, overrides: list[str], run_dir: Path) -> dict:
    cfg = compose("dt/hopper_medium", [
        f"dataset.path={args.dataset}", f"device={args.device}", f"train.steps={args.steps}",
        f"train.log_every={args.log_every}", "train.checkpoint_every=0", "eval.every=0", "eval.at_end=false",
        "train.progress=false", *overrides])
    t0 = time.perf_counter()
    train(cfg, run_dir)
    wall = time.perf_counter() - t0
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    windows = [w for w in windows if "perf/steps_per_s" in w]
    rates = [w["perf/steps_per_s"] for w in windows[1:]] or [w["perf/steps_per_s"] for w in windows]
    return {"overrides": overrides, "updates_per_s": statistics.median(rates), "window_updates_per_s": rates,
            "losses": [w["train/loss"] for w in windows], "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--budget-s", type=float, default=100.0)
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args(argv)
    result: dict = {"machine": host_description(args.device), "settings": vars(args), "variants": {}, "skipped": []}
    start = time.perf_counter()
    failed = False
    with tempfile.TemporaryDirectory(prefix="rlt-gpu-options-") as tmp:
        for i, (name, overrides) in enumerate(VARIANTS):
            if args.no_compile and any("compile" in o or "cuda_graphs" in o for o in overrides):
                result["skipped"].append(f"{name}: --no-compile")
                continue
            if args.device == "cpu" and any("cuda_graphs" in o for o in overrides):
                result["skipped"].append(f"{name}: CUDA only")
                continue
            if time.perf_counter() - start > args.budget_s:
                result["skipped"].append(f"{name}: past --budget-s {args.budget_s:g}")
                continue
            try:
                row = run_variant(args, overrides, Path(tmp) / f"v{i}")
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                row = {"overrides": overrides, "error": f"{type(exc).__name__}: {exc}"}
                failed = True
            result["variants"][name] = row
            base = result["variants"].get("fp32, host batches", {}).get("updates_per_s")
            if base and "updates_per_s" in row:
                row["vs_fp32_host"] = row["updates_per_s"] / base
            print(f"{name}: " + (row["error"] if "error" in row else
                                 f"{row['updates_per_s']:.1f} updates/s ({row.get('vs_fp32_host', 1):.2f}x), "
                                 f"{row['wall_s']:.0f} s"), flush=True)
            host, dev = result["variants"].get("fp32, host batches"), result["variants"].get("fp32, data on device")
            if host and dev and "losses" in host and "losses" in dev:
                result["loss_max_abs_diff_host_vs_device_data"] = max(
                    abs(a - b) for a, b in zip(host["losses"], dev["losses"]))
            result["machine"]["loadavg_end"] = host_description().get("loadavg_1_5_15")
            Path(args.out).write_text(json.dumps(result, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
