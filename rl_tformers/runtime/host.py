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


def host_description(device: torch.device | str | None = None) -> dict[str, Any]:
    """The host a benchmark ran on, as its JSON records it under ``machine``.

    Returns:
        ``cpu`` (the model name), ``cpu_vendor``, ``cpu_family``, ``cpu_model``,
        ``avx512_bf16``, ``amx`` (:func:`cpu_identity`), ``threads`` (torch intra-op threads),
        ``cpu_count``, ``torch`` and ``python`` versions, ``date`` (UTC, ISO 8601 to the second),
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


__all__ = ["CACHE_DIR_ENV", "cache_dir", "cpu_identity", "cpu_vendor", "host_caption", "host_description",
           "parse_cpuinfo"]
