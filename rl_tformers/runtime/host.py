"""What this machine is: the CPU's identity (vendor, family, model, the flags that decide which
kernels run fast), and the one host description every benchmark JSON records.

:func:`cpu_identity` reads ``/proc/cpuinfo`` (Linux; x86 lines ``vendor_id``, ``cpu family``,
``model``, ``model name``, ``flags``; ARM lines ``CPU implementer``, ``CPU architecture``,
``CPU part``, ``Features``) and falls back to :mod:`platform` elsewhere. It keys the cache of the
``cpu_matmul: auto`` measurement (:mod:`rl_tformers.runtime.cpu_matmul`) and names the CPU in
:func:`host_description`, which every ``rl-tformers bench`` result records under ``machine``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

#: Environment variable that relocates rl-tformers' cache folder (:func:`cache_dir`).
CACHE_DIR_ENV = "RL_TFORMERS_CACHE_DIR"
#: Environment variable that keeps the C library's own allocator settings (:func:`retain_freed_memory`): ``system``.
MALLOC_ENV = "RL_TFORMERS_MALLOC"
#: glibc ``mallopt`` parameters (``malloc.h``) and the values :func:`retain_freed_memory` sets (bytes)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 32 * 2**20
HEAP_TRIM_THRESHOLD = 256 * 2**20
#: glibc's own environment variables for the same settings; a user who set one keeps glibc's behaviour
_GLIBC_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def parse_cpuinfo(text: str) -> dict[str, Any]:
    """The identity of the first processor described by ``/proc/cpuinfo``'s ``text``.

    Returns:
        ``{"vendor", "family", "model", "model_name"}`` (strings, ``""`` when a line is missing)
        and ``{"avx512_bf16", "amx"}`` (bools: the ``avx512_bf16`` flag; any ``amx_*`` flag).
        x86 lines first; an ARM file's ``CPU implementer`` / ``CPU architecture`` / ``CPU part``
        / ``Features`` fill what x86 lines leave empty.
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:  # the end of the first processor's block
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {
        "vendor": fields.get("vendor_id") or fields.get("CPU implementer", ""),
        "family": fields.get("cpu family") or fields.get("CPU architecture", ""),
        "model": fields.get("model") or fields.get("CPU part", ""),
        "model_name": fields.get("model name", ""),
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": any(f.startswith("amx") for f in flags),
    }


@functools.lru_cache(maxsize=1)
def cpu_identity() -> dict[str, Any]:
    """This CPU's identity (:func:`parse_cpuinfo` of ``/proc/cpuinfo``; where that file cannot
    be read, the vendor from ``platform.processor()`` and the rest empty or False), plus
    ``machine`` (``platform.machine()``: ``x86_64``, ``aarch64``...). Read once per process."""
    try:
        ident = parse_cpuinfo(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        ident = {"vendor": platform.processor(), "family": "", "model": "", "model_name": "",
                 "avx512_bf16": False, "amx": False}
    return {**ident, "machine": platform.machine()}


def cpu_vendor() -> str:
    """The CPU vendor string (``GenuineIntel``, ``AuthenticAMD``...; ``""`` when unknown)."""
    return str(cpu_identity()["vendor"])


def cache_dir() -> Path:
    """rl-tformers' cache folder: ``$RL_TFORMERS_CACHE_DIR`` when set, else
    ``$XDG_CACHE_HOME/rl-tformers``, else ``~/.cache/rl-tformers`` (not created here)."""
    own = os.environ.get(CACHE_DIR_ENV, "").strip()
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "rl-tformers"


@functools.lru_cache(maxsize=1)
def retain_freed_memory() -> dict[str, int] | None:
    """Make glibc's ``malloc`` keep freed blocks of up to 32 MiB in the process's heap.

    By default glibc serves every allocation of 128 KiB or more with its own ``mmap`` and unmaps
    it when freed (its dynamic threshold rises only to the largest block freed so far, and the
    heap's top is trimmed back to the OS past twice that), so a tensor of a few MiB allocated and
    freed on every call, as the activations of an acting forward pass are, costs fresh pages and
    their page faults every time. Measured on a 2-core AMD EPYC (family 26 model 2), 1 thread: the
    forward pass of a 64-dim, 2-layer DT (K = 20) over 50 rows took 11.5-12.4 ms with glibc's
    defaults and 8.1-8.4 ms with these settings (``scripts/dt_forward_malloc.py``, MKL's products;
    ``docs/performance.md``, Evaluation). Settings: ``M_MMAP_THRESHOLD`` 32 MiB (allocations
    below it come from the heap) and ``M_TRIM_THRESHOLD`` 256 MiB (up to that much free memory
    at the heap's top stays mapped), so a process's resident memory stays near its peak.

    Process-wide, so only the ``rl-tformers`` command calls it (a library user's process keeps
    its own settings unless it calls this). Nothing is changed where the C library is not glibc,
    where ``$RL_TFORMERS_MALLOC`` is ``system``, or where the user set glibc's own variables
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``GLIBC_TUNABLES``).

    Returns:
        ``{"mmap_threshold", "trim_threshold"}`` (bytes) as set, or None where nothing changed.
        Called once per process (later calls return the first call's answer).
    """
    if os.environ.get(MALLOC_ENV, "").strip().lower() == "system" or any(os.environ.get(v) for v in _GLIBC_MALLOC_ENV):
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return None
    return {"mmap_threshold": HEAP_MMAP_THRESHOLD, "trim_threshold": HEAP_TRIM_THRESHOLD} if ok else None


def malloc_settings() -> dict[str, int] | None:
    """What :func:`retain_freed_memory` set in this process (None before it ran, or where it
    changed nothing)."""
    return retain_freed_memory() if retain_freed_memory.cache_info().currsize else None


def host_description(device: torch.device | str | None = None) -> dict[str, Any]:
    """The host a benchmark ran on, as its JSON records it under ``machine``.

    Returns:
        ``cpu`` (the model name), ``cpu_vendor``, ``cpu_family``, ``cpu_model``,
        ``avx512_bf16``, ``amx`` (:func:`cpu_identity`), ``threads`` (torch intra-op threads),
        ``cpu_count``, ``torch`` and ``python`` versions, ``date`` (UTC, ISO 8601 to the second),
        ``malloc`` (the settings :func:`retain_freed_memory` made in this process, or None),
        ``loadavg_1_5_15`` (where the system has one) and, for a CUDA ``device``, ``gpu``.
    """
    ident = cpu_identity()
    info: dict[str, Any] = {
        "cpu": ident["model_name"] or ident["vendor"] or platform.processor(),
        "cpu_vendor": ident["vendor"], "cpu_family": ident["family"], "cpu_model": ident["model"],
        "avx512_bf16": ident["avx512_bf16"], "amx": ident["amx"],
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "malloc": malloc_settings(),
    }
    with contextlib.suppress(OSError, AttributeError):
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    if device is not None and torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def host_caption(machine: dict[str, Any]) -> str:
    """The CPU of a :func:`host_description` record as a table caption names it: the model name,
    then family, model and the flags that decide the fast paths, e.g. ``Intel(R) Xeon(R)
    Processor (family 6 model 167; avx512_bf16, amx)``. Flags the record lacks read as absent
    (``no amx``); a record without family and model (an older JSON) gives the name alone."""
    name = machine.get("cpu") or "CPU"
    family, model = machine.get("cpu_family"), machine.get("cpu_model")
    if not family and not model:
        return str(name)
    flags = ", ".join(f if machine.get(f) else f"no {f}" for f in ("avx512_bf16", "amx"))
    return f"{name} (family {family} model {model}; {flags})"


__all__ = ["CACHE_DIR_ENV", "MALLOC_ENV", "cache_dir", "cpu_identity", "cpu_vendor", "host_caption",
           "host_description", "malloc_settings", "parse_cpuinfo", "retain_freed_memory"]
