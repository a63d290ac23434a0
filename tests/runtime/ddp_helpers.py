"""Helpers of the tests that start real processes: the CLI in a subprocess, and small scripts run
as 2 ranks of one gloo process group (no torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path


def subprocess_env() -> dict[str, str]:
    """This environment with 1 torch thread, unbuffered output and no inherited DDP variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def train_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``rl-tformers train ARGS`` in a subprocess (output captured as text)."""
    return subprocess.run([sys.executable, "-m", "rl_tformers.cli", "train", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``RUN_DIR/metrics.jsonl``, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_ranks(tmp_path: Path, body: str, timeout: float = 180) -> list[dict]:
    """Run ``body`` in 2 processes of one gloo group (``rank``, ``out`` (a dict written as JSON)
    defined; 1 torch thread) and return each rank's ``out``."""
    script = tmp_path / "ranks.py"
    script.write_text("import json, sys\nimport torch\nimport torch.distributed as dist\n"
                      "torch.set_num_threads(1)\ndist.init_process_group('gloo')\nrank = dist.get_rank()\nout = {}\n"
                      + textwrap.dedent(body)
                      + "\ndist.barrier()\ndist.destroy_process_group()\n"
                      "with open(sys.argv[1] + f'/{rank}.json', 'w') as f:\n    f.write(json.dumps(out))\n"
                      # a process that built a DDP must not meet gloo's threads in the interpreter's
                      # shutdown (SIGABRT): ranks end as the console script ends them
                      "from rl_tformers.runtime.distributed import exit_rank\nexit_rank(0)\n")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**subprocess_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                   "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
