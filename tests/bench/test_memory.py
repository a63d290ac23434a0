"""Peak-memory helper of the benchmarks (CPU path) and its quiet profiler."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from rl_tformers.bench.memory import cpu_peak_bytes


def test_cpu_peak_bytes_counts_the_live_maximum():
    def fn():
        a = torch.empty(1000, 1000)  # 4,000,000 bytes
        b = torch.empty(500, 1000)  # +2,000,000 while a lives
        del a, b
        torch.empty(250, 1000)  # smaller than the peak

    peak = cpu_peak_bytes(fn)
    assert peak is None or peak == 6_000_000


def test_profiler_start_and_stop_lines_do_not_reach_stderr_but_the_code_s_own_output_does():
    code = textwrap.dedent("""
        import sys, torch
        from rl_tformers.bench.memory import cpu_peak_bytes
        cpu_peak_bytes(lambda: print("inside", file=sys.stderr, flush=True))
        print("after", file=sys.stderr)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "USDT" not in r.stderr and "profiler_start" not in r.stderr
    assert "inside" in r.stderr and "after" in r.stderr
