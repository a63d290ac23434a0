"""Milliseconds per acting forward pass of a small DT (64 dims, 2 layers, 1 head, K = 20,
Hopper's 11 observations and 3 actions, untrained) at N = 1, 10 and 50 rows, with glibc's
allocator defaults and with the heap the ``rl-tformers`` command retains
(:func:`rl_tformers.runtime.host.retain_freed_memory`), in alternating processes (the setting
is process-wide), each under ``torch.inference_mode`` at 1 thread.

    python scripts/dt_forward_malloc.py --rounds 3 --library mkl --out dt_forward_malloc.json

Prints one line per process and writes the JSON (rounds, settings, host) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig

from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.runtime.cpu_matmul import apply_cpu_matmul
from rl_tformers.runtime.host import host_description, retain_freed_memory

ROWS = (1, 10, 50)


def child(library: str, reps: int) -> dict[str, float]:
    """This process's milliseconds per forward at each N (the median of 5 blocks of ``reps`` calls)."""
    retain_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    bb = BackboneConfig(d_model=64, n_layers=2, n_heads=1, dropout=0.0, attn_dropout=0.0, activation="relu")
    model = DecisionTransformer(DTConfig(obs_dim=11, act_dim=3, discrete=False, context_len=20, max_ep_len=1000,
                                         backbone=bb)).eval()
    apply_cpu_matmul(model, library)
    out = {}
    with torch.inference_mode():
        for n in ROWS:
            x = (torch.randn(n, 20, 11), torch.rand(n, 20, 3) * 2 - 1, torch.rand(n, 20),
                 torch.arange(20).expand(n, 20).clone(), torch.ones(n, 20, dtype=torch.bool))
            for _ in range(10):
                model(*x)
            blocks = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps):
                    model(*x)
                blocks.append((time.perf_counter() - t0) / reps * 1e3)
            out[str(n)] = statistics.median(blocks)
    return out


def build_parser() -> argparse.ArgumentParser:
    """The script's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="pairs of processes (glibc, retained)")
    ap.add_argument("--library", choices=("mkl", "onednn"), default="mkl", help="cpu_matmul of the model")
    ap.add_argument("--reps", type=int, default=40, help="calls per timed block")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap


def main() -> None:
    a = build_parser().parse_args()
    if a.child:
        print(json.dumps(child(a.library, a.reps)))
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RL_TFORMERS_MALLOC"))}
    rounds = []
    for r in range(1, a.rounds + 1):
        for setting, var in (("glibc", "system"), ("retained", "")):
            res = subprocess.run([sys.executable, __file__, "--child", "--library", a.library, "--reps", str(a.reps)],
                                 env={**env, "RL_TFORMERS_MALLOC": var}, capture_output=True, text=True, check=True)
            ms = json.loads(res.stdout.strip().splitlines()[-1])
            rounds.append({"round": r, "malloc": setting, "ms_per_forward": ms})
            print(f"round {r} {setting}: " + ", ".join(f"N={n} {v:.3f} ms" for n, v in ms.items()), flush=True)
    result = {"library": a.library, "rows": list(ROWS), "rounds": rounds, "machine": host_description(),
              "command": "python scripts/dt_forward_malloc.py " + " ".join(sys.argv[1:])}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
