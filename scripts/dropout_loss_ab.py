"""Training loss of the shipped Hopper DT (``dt/hopper_medium``: the paper's model, dropout 0.1)
with the backbone library's dropout draws (:mod:`rl_tformers.dropout`: four 16-bit lanes per 64-bit
draw) and with PyTorch's ``F.dropout`` (:func:`rl_tformers.dropout.torch_draws`), the same seeds,
data stream and updates (sample + update, as ``rl-tformers train`` runs them), in one process.

    python scripts/dropout_loss_ab.py --updates 1000 --seeds 0,1,2 --out dropout_loss_ab.json

For every seed and both draws: the mean loss of each block of ``--every`` updates. The summary
puts the difference between the two draws (mean over seeds, per block) beside the spread between
seeds (standard deviation of the per-seed block means, either draws): a difference within that
spread is noise. Also times both (updates/s of the whole run, CPU time of the thread).
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

DRAWS = {"lanes": "ours", "torch": TORCH_DROPOUT_ROW}


def curve(draws: str, seed: int, dataset: str, updates: int, every: int, work: Path) -> dict:
    """Block means of the loss of one run, and its thread CPU time per update."""
    runner = OursRunner(DRAWS[draws], Settings(dataset=dataset, seed=seed), [], work / f"{draws}-{seed}")
    torch.manual_seed(seed)
    t0 = time.thread_time()
    losses = torch.stack([runner.step("e2e") for _ in range(updates)]).tolist()
    cpu = time.thread_time() - t0
    runner.close()
    blocks = [statistics.fmean(losses[i:i + every]) for i in range(0, updates, every)]
    return {"blocks": blocks, "updates_per_cpu_s": updates / cpu}


def summary(runs: dict[str, dict[int, dict]], seeds: list[int]) -> list[dict]:
    """Per block: each draw's mean over seeds, their difference, and the seeds' spread."""
    out = []
    for b in range(len(runs["lanes"][seeds[0]]["blocks"])):
        per = {d: [runs[d][s]["blocks"][b] for s in seeds] for d in DRAWS}
        spread = statistics.fmean(statistics.stdev(v) for v in per.values()) if len(seeds) > 1 else float("nan")
        mean = {d: statistics.fmean(v) for d, v in per.items()}
        out.append({"block": b, **{f"{d}_mean": m for d, m in mean.items()},
                    "difference": mean["lanes"] - mean["torch"], "seed_sd": spread})
    return out


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    runs: dict[str, dict[int, dict]] = {d: {} for d in DRAWS}
    with tempfile.TemporaryDirectory(prefix="rlt-dropout-ab-") as work:
        for seed in seeds:
            for d in DRAWS:
                runs[d][seed] = curve(d, seed, args.dataset, args.updates, args.every, Path(work))
                print(f"seed {seed} {d}: last block {runs[d][seed]['blocks'][-1]:.5f}, "
                      f"{runs[d][seed]['updates_per_cpu_s']:.2f} updates per CPU second", flush=True)
    rows = summary(runs, seeds)
    for r in rows:
        print(f"block {r['block']}: lanes {r['lanes_mean']:.5f} torch {r['torch_mean']:.5f} "
              f"difference {r['difference']:+.5f} seed sd {r['seed_sd']:.5f}")
    if args.out:
        res = {"command": "python scripts/dropout_loss_ab.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
               "settings": vars(args), "machine": host_description(torch.device("cpu")),
               "runs": {d: {str(s): r for s, r in by.items()} for d, by in runs.items()}, "summary": rows}
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
