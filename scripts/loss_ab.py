"""Training loss of the shipped Hopper DT (``dt/hopper_medium``: the paper's model, dropout 0.1)
in two variants, the same seeds, data stream and updates (sample + update, as ``rl-tformers train``
runs them), in one process. ``--compare``:

- ``draws``: the backbone library's dropout draws (:mod:`rl_tformers.dropout`: four 16-bit lanes
  per 64-bit draw, ``lanes``) against PyTorch's ``F.dropout`` (:func:`rl_tformers.dropout.torch_draws`, ``torch``);
- ``amp``: float32 (``fp32``) against bf16 autocast (``train.amp=bf16``, ``bf16``).

    python scripts/loss_ab.py --compare draws --updates 1000 --seeds 0,1,2 --out dropout_loss_ab.json

For every seed and both variants: the mean loss of each block of ``--every`` updates. The summary
puts the difference between the two (mean over seeds, per block) beside the spread between seeds
(standard deviation of the per-seed block means, averaged over the two variants): a difference
within that spread is noise. Also times both (updates per CPU second of the thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rl_tformers.bench.train import DEFAULT_DATASET, TORCH_DROPOUT_ROW, OursRunner, Settings
from rl_tformers.runtime.host import host_description

#: --compare -> the two variants: name -> (bench train row, its overrides)
COMPARISONS = {
    "draws": {"lanes": ("ours", []), "torch": (TORCH_DROPOUT_ROW, [])},
    "amp": {"fp32": ("ours", []), "bf16": ("ours+bf16", ["train.amp=bf16"])},
}


def curve(row: tuple[str, list[str]], seed: int, dataset: str, updates: int, every: int, work: Path) -> dict:
    """Block means of the loss of one run of ``row`` (a bench train row and its overrides), and its
    updates per CPU second."""
    name, overrides = row
    runner = OursRunner(name, Settings(dataset=dataset, seed=seed), overrides, work / f"{name}-{seed}")
    torch.manual_seed(seed)
    t0 = time.thread_time()
    losses = torch.stack([runner.step("e2e") for _ in range(updates)]).tolist()
    cpu = time.thread_time() - t0
    runner.close()
    blocks = [statistics.fmean(losses[i:i + every]) for i in range(0, updates, every)]
    return {"blocks": blocks, "updates_per_cpu_s": updates / cpu}


def summary(runs: dict[str, dict[int, dict]], seeds: list[int]) -> list[dict]:
    """Per block: each variant's mean over seeds, their difference (first minus second), and the
    seeds' spread."""
    a, b = runs
    out = []
    for k in range(len(runs[a][seeds[0]]["blocks"])):
        per = {v: [runs[v][s]["blocks"][k] for s in seeds] for v in (a, b)}
        spread = statistics.fmean(statistics.stdev(x) for x in per.values()) if len(seeds) > 1 else float("nan")
        mean = {v: statistics.fmean(x) for v, x in per.items()}
        out.append({"block": k, **{f"{v}_mean": m for v, m in mean.items()},
                    "difference": mean[a] - mean[b], "seed_sd": spread})
    return out


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="draws", help="the two variants")
    ap.add_argument("--updates", type=int, default=1000, help="updates per run")
    ap.add_argument("--every", type=int, default=100, help="updates per block of the loss curve")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--dataset", default=DEFAULT_DATASET, help="dataset spec (dt/hopper_medium's by default)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads")
    ap.add_argument("--out", help="write the JSON here")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = COMPARISONS[args.compare]
    runs: dict[str, dict[int, dict]] = {v: {} for v in variants}
    with tempfile.TemporaryDirectory(prefix="rlt-loss-ab-") as work:
        for seed in seeds:
            for v, row in variants.items():
                runs[v][seed] = curve(row, seed, args.dataset, args.updates, args.every, Path(work))
                print(f"seed {seed} {v}: last block {runs[v][seed]['blocks'][-1]:.5f}, "
                      f"{runs[v][seed]['updates_per_cpu_s']:.2f} updates per CPU second", flush=True)
    rows = summary(runs, seeds)
    a, b = variants
    for r in rows:
        print(f"block {r['block']}: {a} {r[a + '_mean']:.5f} {b} {r[b + '_mean']:.5f} "
              f"difference {r['difference']:+.5f} seed sd {r['seed_sd']:.5f}")
    if args.out:
        res = {"command": "python scripts/loss_ab.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
               "settings": vars(args), "machine": host_description(torch.device("cpu")),
               "runs": {d: {str(s): r for s, r in by.items()} for d, by in runs.items()}, "summary": rows}
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
