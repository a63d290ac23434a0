"""The host description: the CPU's identity read from /proc/cpuinfo, the cache folder, and the
``machine`` record every benchmark JSON carries."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
import torch

from rl_tformers.runtime import host

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 99
"""
SAPPHIRE_RAPIDS = """vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd sve bf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd40
"""


def test_cpuinfo_gives_vendor_family_model_name_and_the_bf16_and_amx_flags() -> None:
    assert host.parse_cpuinfo(ZEN4) == {"vendor": "AuthenticAMD", "family": "25", "model": "17",
                                        "model_name": "AMD EPYC 9R14 96-Core Processor", "avx512_bf16": True,
                                        "amx": False}
    assert host.parse_cpuinfo(SAPPHIRE_RAPIDS) == {"vendor": "GenuineIntel", "family": "6", "model": "143",
                                                   "model_name": "Intel(R) Xeon(R) Platinum 8488C",
                                                   "avx512_bf16": True, "amx": True}
    assert host.parse_cpuinfo(GRAVITON) == {"vendor": "0x41", "family": "8", "model": "0xd40", "model_name": "",
                                            "avx512_bf16": False, "amx": False}
    assert host.parse_cpuinfo("") == {"vendor": "", "family": "", "model": "", "model_name": "",
                                      "avx512_bf16": False, "amx": False}


def test_cpu_identity_of_this_machine_is_its_cpuinfo_and_architecture() -> None:
    ident = host.cpu_identity()
    if Path("/proc/cpuinfo").is_file():
        assert {k: v for k, v in ident.items() if k != "machine"} == host.parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    assert ident["machine"] == __import__("platform").machine()
    assert host.cpu_vendor() == ident["vendor"]


def test_cache_dir_is_relocated_by_its_variable_else_xdg_else_home(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("RL_TFORMERS_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert host.cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("RL_TFORMERS_CACHE_DIR", "  ")
    assert host.cache_dir() == tmp_path / "xdg" / "rl-tformers"
    monkeypatch.delenv("RL_TFORMERS_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert host.cache_dir() == tmp_path / "home" / ".cache" / "rl-tformers"


def test_host_description_names_the_cpu_threads_torch_and_date(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host, "cpu_identity", lambda: {**host.parse_cpuinfo(ZEN4), "machine": "x86_64"})
    monkeypatch.setattr(host.time, "gmtime", lambda *a: time.struct_time((2026, 12, 7, 5, 6, 7, 0, 341, 0)))
    d = host.host_description()
    loadavg = d.pop("loadavg_1_5_15", None)
    assert d.pop("malloc") == host.malloc_settings()
    assert d == {"cpu": "AMD EPYC 9R14 96-Core Processor", "cpu_vendor": "AuthenticAMD", "cpu_family": "25",
                 "cpu_model": "17", "avx512_bf16": True, "amx": False, "threads": torch.get_num_threads(),
                 "cpu_count": __import__("os").cpu_count(), "torch": torch.__version__,
                 "python": sys.version.split()[0], "date": "2026-12-07T05:06:07Z"}
    assert loadavg is None or (len(loadavg) == 3 and all(v >= 0 for v in loadavg))
    assert "gpu" not in host.host_description("cpu")


def test_every_benchmark_records_the_one_host_description() -> None:
    from rl_tformers.bench import attention, decoding, train

    assert train.machine_info is host.host_description  # bench train, profile, eval, act, data, minari
    keys = {"cpu", "cpu_vendor", "cpu_family", "cpu_model", "avx512_bf16", "amx", "threads", "torch", "date"}
    records = [decoding.run(kinds=["performer"], steps=(2, 5), repeats=1)["machine"],
               attention.run(["sdpa"], attention.Settings(lengths=(8,), d_model=8, n_heads=1, repeats=1)).as_dict()["machine"]]
    for machine in records:
        assert set(machine) >= keys and machine["cpu_model"] == host.cpu_identity()["model"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", machine["date"])


def test_host_caption_names_family_model_and_the_fast_path_flags() -> None:
    intel = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_family": "6", "cpu_model": "167", "avx512_bf16": True,
             "amx": True}
    assert host.host_caption(intel) == "Intel(R) Xeon(R) Processor (family 6 model 167; avx512_bf16, amx)"
    amd = {"cpu": "AMD EPYC", "cpu_family": "25", "cpu_model": "17", "avx512_bf16": True, "amx": False}
    assert host.host_caption(amd) == "AMD EPYC (family 25 model 17; avx512_bf16, no amx)"
    assert host.host_caption({"cpu": "Intel(R) Xeon(R) Processor"}) == "Intel(R) Xeon(R) Processor"  # an older JSON
    assert host.host_caption({}) == "CPU"


def test_host_caption_of_this_host_carries_its_description() -> None:
    m = host.host_description()
    caption = host.host_caption(m)
    assert caption.startswith(str(m["cpu"]))
    if m["cpu_family"] or m["cpu_model"]:
        assert f"family {m['cpu_family']} model {m['cpu_model']}" in caption


FAULTS_OF_A_REUSED_BLOCK = """
import resource, sys
import numpy as np
from rl_tformers.runtime import host
print(host.retain_freed_memory())
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(4 * 2**20 // 8) for _ in range(4)]  # 4 x 4 MiB alive together, every page touched
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(min(faults() for _ in range(5)))
"""


def _faults_of_a_reused_block(env: dict[str, str]) -> tuple[str, int]:
    import os
    import subprocess

    out = subprocess.run([sys.executable, "-c", FAULTS_OF_A_REUSED_BLOCK], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "RL_TFORMERS_MALLOC"))}
                         | env).stdout.split("\n")
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
def test_retained_freed_memory_serves_a_block_again_without_page_faults() -> None:
    """Four 4 MiB blocks (4,096 pages) alive together, freed and allocated again: with glibc's
    defaults the heap's top is trimmed past twice the largest block freed and the C library maps
    fresh pages for about half of them every time; after retain_freed_memory() the heap serves them again."""
    said, faults = _faults_of_a_reused_block({})
    assert said == "{'mmap_threshold': 33554432, 'trim_threshold': 268435456}"
    assert faults < 100
    said, faults = _faults_of_a_reused_block({"RL_TFORMERS_MALLOC": "system"})
    assert said == "None" and faults >= 1000  # 2,020 with glibc 2.36
    said, faults = _faults_of_a_reused_block({"MALLOC_TRIM_THRESHOLD_": "131072"})  # the user's own setting is kept
    assert said == "None"


def test_the_command_line_retains_freed_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_tformers import cli

    called = []
    monkeypatch.setattr(cli, "retain_freed_memory", lambda: called.append(1))
    monkeypatch.setattr(cli, "app", lambda: None)
    cli.main()
    assert called == [1]
