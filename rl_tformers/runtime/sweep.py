"""``rl-tformers sweep``: a grid of training runs (config values x seeds), run in parallel local
processes or as tasks of a Ray cluster, collected into one results table and one plot.

    rl-tformers sweep -c dt/hopper_medium --grid backbone.attention.kind=sdpa,performer \\
        --seeds 0,1,2 --jobs 3 --out runs/sweep-attn train.steps=20000

Each grid point x seed is one ordinary ``rl-tformers train`` process with its own run directory
``OUT/<point>/seed<k>`` (checkpoints, TensorBoard, metrics.jsonl, as for any run), so every run
can be inspected, evaluated or resumed on its own. ``<point>`` names each grid key by its
shortest dotted suffix that no other grid key shares (``kind=sdpa``;
``attention.kind=sdpa__position.kind=none`` for two keys ending in ``kind``; see
:func:`expand`). Running the same command again skips the runs that are complete and resumes
those that stopped (crash, Ctrl-C, time limit): a sweep is restartable at no extra cost. Rerun rules (checked for every run before any starts):

- every grid point is checked before any run starts, and a sweep with bad points is refused
  with one error naming each of them and why: its config must compose (keys, values, the
  backbone's combination of kinds) and its agent must build, as ``rl-tformers train`` checks
  before it trains (:func:`~rl_tformers.runtime.trainer.check_agent`, on the CPU: dataset
  loaded and validated, agent options and the agent's own refusals, e.g. ``agent.mode=causal``
  with ``backbone.causal=false``); the agent is built for the points with a run to start (a
  run to resume is rebuilt from its own checkpoint by ``--resume``, which checks it), and only
  with the local launcher (Ray runs may see files this machine does not);
- a run directory that already holds a run must hold *this* run: its stored config (newest
  checkpoint, else ``config.yaml``) must equal the requested one, except ``run_dir``,
  ``device`` and ``train.progress``; otherwise the sweep is refused, naming the run and the
  differing keys (e.g. ``train.steps: 300 -> 320``: use another ``--out``);
- a run that stopped before its first checkpoint (``run_state`` ``uncheckpointed``) has
  nothing to resume: its logs are removed (:func:`clear_uncheckpointed`) and it is trained again
  from the start; the earlier failure stays in its log (``OUT/logs``) and is printed;
- complete means trained to ``train.steps`` *and*, with ``eval.at_end=true``, a final
  evaluation logged at that step; a run whose final evaluation failed is reported
  ``incomplete`` (evaluate it with ``rl-tformers eval``, or delete it to train it again);
- a run directory that another process is training (its lock, :mod:`.runlock`) is refused;
- two grid values that map to the same run directory (``[0.9,0.95]`` and ``[0.9, 0.95]``), or
  that give the same config (``train.lr=1e-3,0.001``), are refused;
- a ``KEY=VALUE`` override of a key the sweep sets for each run (``seed``, ``run_dir``, a grid
  key with another value, or a key inside or above a grid key) is refused: the run's own value
  would replace it silently;
- one sweep at a time per ``--out``: a second sweep on the same folder (while the first runs) is
  refused (``OUT/.sweep.lock``, an ``flock`` the system releases when the sweep exits).

SIGINT, SIGTERM and SIGHUP stop the sweep: each running ``train`` (in its own session) gets the
signal (SIGHUP as SIGTERM), saves a checkpoint and stops; no new run starts; the results are
written and the sweep exits with 128 + the signal number. A second signal is forwarded too, so a
second Ctrl-C aborts the runs as it aborts ``rl-tformers train`` (each loses the updates since its
last checkpoint; a repeated SIGTERM does not abort, see the trainer's ``GracefulInterrupt``). The results are read back from each
run's ``metrics.jsonl``:

- ``OUT/results.csv`` / ``results.json`` / ``results.md``: one row per run (grid values, seed,
  status, steps, wall time (``seconds``: of the run's ``train`` processes, summed over its first
  part and every resume, from ``OUT/logs/<run>.parts.jsonl``), last logged training and
  evaluation scalars) and a summary per grid
  point (mean, standard deviation and count over seeds of ``--metric``, over the runs that
  completed: status ``ok`` or ``skipped``; a failed, stopped, incomplete or not-run run's last
  values are in its row but not in the summary or plot: ``seeds`` reads e.g. ``1/2``);
- ``OUT/results.png``: ``--metric`` per grid point, mean with one standard deviation over seeds.
- ``OUT/curves.json`` / ``curves.png``: with periodic evaluations, ``--metric`` against updates
  per grid point, mean ± std over seeds (:mod:`rl_tformers.runtime.curves`).

Why not a scheduler of our own: locally a ``concurrent.futures.ThreadPoolExecutor`` of
``--jobs`` workers, each waiting on one training subprocess (process isolation, a crash fails
one run only, each process gets ``--threads`` intra-op threads); on a cluster ``--launcher ray``
turns every run into a Ray task (``num_cpus=--threads``, ``num_gpus=--gpus-per-run``) and Ray
does the placement, queueing and retries (``ray.init`` joins the cluster whose head is
``--ray-address HOST:PORT``, else ``RAY_ADDRESS``, else starts a local one). Each task runs its
``train`` in the sweep's working folder with the sweep's ``RL_TFORMERS_*`` and
``MINARI_DATASETS_PATH`` variables (:func:`run_ray`), so the run directories, configs,
datasets and the Python interpreter must be at the same paths on every node (the usual
NFS/Lustre home of a cluster).
"""

from __future__ import annotations

import csv
import errno
import fcntl
import gc
import importlib
import itertools
import json
import logging
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import typer
from omegaconf import OmegaConf

from rl_tformers.registry import RegistryError
from rl_tformers.runtime import checkpoint as ckpt
from rl_tformers.runtime.curves import plot_curve_panels, point_curves, run_curve, write_curves
from rl_tformers.runtime.errors import ConfigError
from rl_tformers.runtime.progress import PlainProgress
from rl_tformers.runtime.run_config import (
    compose,
    config_name_hint,
    config_value_differences,
    flatten,
    to_container,
)
from rl_tformers.runtime.runlock import directory_problem, lock_holder
from rl_tformers.runtime.seeding import MAX_SEED
from rl_tformers.runtime.tracking import METRICS_FILE, event_files
from rl_tformers.runtime.trainer import CONFIG_FILE, check_agent, config_warnings, holds_run

#: Metrics tried, in order, when ``--metric`` is not given.
DEFAULT_METRICS = ("eval/normalized_score", "eval/return_mean", "eval/return", "train/loss")
LAUNCHERS = ("local", "ray")


class SweepError(ValueError):
    """A sweep cannot be set up (bad grid, unknown launcher, Ray not installed...)."""


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep.

    Attributes:
        name: ``<point>/seed<k>``, also its run directory relative to the sweep folder.
        point: grid values of this run, ``{dotted key: value string}`` (seed excluded).
        seed: the run's ``seed``.
        overrides: every ``KEY=VALUE`` of the run (common ones, the grid values, the seed).
        run_dir: the run directory.
    """

    name: str
    point: dict[str, str]
    seed: int
    overrides: tuple[str, ...]
    run_dir: Path

    @property
    def point_label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.point.items()) or "(base)"


@dataclass
class RunOutcome:
    """What happened to one run: ``status`` is ``ok``, ``skipped`` (already complete),
    ``failed`` (exit code != 0; see ``log``), ``stopped`` (by a signal to the sweep; resumable),
    ``incomplete`` (trained, but its final evaluation is missing; see ``log``) or ``not run``."""

    status: str
    returncode: int | None = None
    seconds: float = 0.0
    log: str = ""


@dataclass
class SweepResult:
    """Rows per run, summary per grid point, and the files written."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: list[dict[str, Any]] = field(default_factory=list)
    metric: str | None = None
    files: list[str] = field(default_factory=list)
    interrupted: int | None = None  #: the signal that stopped the sweep, if any


# -- grid ------------------------------------------------------------------------------------------

def split_values(text: str, keep_empty: bool = False) -> list[str]:
    """``"a,b,[1,2],{k: v},'x,y'"`` -> ``["a", "b", "[1,2]", "{k: v}", "'x,y'"]``: commas inside
    brackets, braces or YAML quotes do not split (so list-, dict- and string-valued YAML options
    holding commas can be swept). A quote opens a quoted string where YAML's would: at the start
    of a value or item (after ``,``, ``[``, ``{`` or ``:``, spaces skipped), so ``it's`` is a
    plain value; inside single quotes ``''`` is a quote, inside double quotes ``\\`` escapes.
    Empty items (``a,,b``, a trailing comma) are dropped unless ``keep_empty``.

    Raises:
        SweepError: an unclosed quote, or a bracket or brace that is not closed or closes
            nothing (``[1,2``, ``1]``): the value would otherwise be split at the wrong place.
    """
    out, stack, cur = [], [], []
    quote, escaped, closed, prev = "", False, "", ","  # prev: last character outside quotes, not a space
    pairs = {"]": "[", "}": "{", ")": "("}
    for ch in text:
        if quote:
            if escaped:
                escaped = False
            elif quote == '"' and ch == "\\":
                escaped = True
            elif ch == quote:
                quote, closed, prev = "", ch, ch
            cur.append(ch)
            continue
        if ch == "'" and closed == "'":  # '' inside single quotes: a quote, the string goes on
            quote, closed = ch, ""
            cur.append(ch)
            continue
        closed = ""
        if ch in "'\"" and prev in ",[{:" and (prev != ":" or cur[-1:] == [" "]):
            quote = ch
        elif ch in "[{(":
            stack.append(ch)
        elif ch in "]})":
            if not stack or stack[-1] != pairs[ch]:
                raise SweepError(f"{ch!r} closes no bracket in {text!r}; quote a value whose brackets are text "
                                 f"(e.g. 'a]')")
            stack.pop()
        if ch == "," and not stack:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        if not ch.isspace():
            prev = ch
    if quote:
        raise SweepError(f"unclosed {quote} quote in {text!r}: a quoted value ends with its opening quote")
    if stack:
        raise SweepError(f"unclosed {stack[-1]!r} in {text!r}; quote a value whose brackets are text (e.g. 'a[1')")
    out.append("".join(cur).strip())
    return out if keep_empty else [v for v in out if v]


def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``["backbone.attention.kind=sdpa,performer", "train.lr=1e-4,3e-4"]`` -> ``{key: [values]}``.

    Raises:
        SweepError: an item without ``=`` or values, an empty value (``a,,b``), a key given
            twice, a key inside another grid key (``backbone.position`` and
            ``backbone.position.kind``: one would replace the other's values in every run), a
            value given twice for one key, ``seed`` (use --seeds), or an unclosed
            quote or unbalanced bracket (:func:`split_values`; the message names the key).
    """
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        try:
            split_values(values)
        except SweepError as exc:
            raise SweepError(f"--grid {key}: {exc}") from None
        if not sep or not key or not split_values(values):
            raise SweepError(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. backbone.attention.kind=sdpa,performer)")
        if key == "seed":
            raise SweepError("sweep seeds with --seeds 0,1,2, not --grid seed=...")
        if key in grid:
            raise SweepError(f"--grid: {key} is given twice")
        nested = next((g for g in grid if key.startswith(g + ".") or g.startswith(key + ".")), None)
        if nested is not None:
            inner, outer = (key, nested) if key.startswith(nested + ".") else (nested, key)
            raise SweepError(f"--grid {nested}=... and --grid {key}=... set the same option ({inner} is inside "
                             f"{outer}): in every run one would replace the other's value; sweep one of them")
        if "" in split_values(values, keep_empty=True):
            raise SweepError(f"--grid {item!r}: an empty value (two commas in a row or a trailing comma); "
                             f"for an empty string write '' (YAML)")
        vals = split_values(values)
        dup = next((v for i, v in enumerate(vals) if v in vals[:i]), None)
        if dup is not None:
            raise SweepError(f"--grid {key}: value {dup!r} is given twice")
        grid[key] = vals
    return grid


#: Most runs one ``--seeds`` may ask for (a typo such as ``0-1000000`` would otherwise compose a
#: million configs before saying anything).
MAX_SEEDS = 1000


def parse_seeds(text: str) -> list[int]:
    """``"0,1,2"``, ``"0-4"`` (inclusive range) or a mix (``"0-2,7"``) -> list of ints.

    Raises:
        SweepError: an empty item (``0,,1``, a trailing comma), not integers, a reversed
            range (``1-0``), a seed outside ``[0, 2**64 - 1]`` (what ``torch.manual_seed``
            takes, :data:`~rl_tformers.runtime.seeding.MAX_SEED`), more than
            :data:`MAX_SEEDS` seeds, or a repeated seed.
    """

    seeds: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise SweepError(f"--seeds {text!r}: an empty item (two commas in a row, or one at an end); "
                             f"write seeds like 0,1,2 or 0-4")
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo > hi:
                raise SweepError(f"--seeds {text!r}: the range {part} is reversed (its first seed is larger than "
                                 f"its last); write {hi}-{lo}")
            if hi - lo + 1 > MAX_SEEDS:
                raise SweepError(f"--seeds {text!r}: the range {part} has {hi - lo + 1} seeds; at most {MAX_SEEDS}")
            seeds += range(lo, hi + 1)
        elif re.fullmatch(r"[+-]?\d+", part):
            seeds.append(int(part))
        else:
            raise SweepError(f"--seeds {text!r}: {part!r} is not an integer or a range; expected integers like "
                             f"0,1,2 or 0-4")
    for seed in seeds:
        if not 0 <= seed <= MAX_SEED:
            raise SweepError(f"--seeds {text!r}: seed {seed} is out of range; seeds are integers in "
                             f"[0, 2**64 - 1] (what torch.manual_seed takes)")
    if len(seeds) > MAX_SEEDS:
        raise SweepError(f"--seeds {text!r}: {len(seeds)} seeds; at most {MAX_SEEDS}")
    if len(set(seeds)) != len(seeds):
        dup = next(x for x in seeds if seeds.count(x) > 1)
        raise SweepError(f"--seeds {text!r}: seed {dup} is given twice; give each seed once")
    return seeds


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "_", text).strip("_") or "x"


def expand(grid: dict[str, list[str]], seeds: Sequence[int], out_dir: str | os.PathLike,
           overrides: Sequence[str] = ()) -> list[SweepRun]:
    """Every grid point (cartesian product, in the order given) x every seed, as :class:`SweepRun`.

    A point's folder names each grid key by its shortest dotted suffix that no other grid key
    shares (:func:`short_keys`), with one key or many: ``kind=sdpa`` for
    ``--grid backbone.attention.kind=...`` alone, ``attention.kind=sdpa__position.kind=none``
    with ``backbone.position.kind`` too.

    Raises:
        SweepError: two grid points map to the same run directory (the same value twice, or
            values that differ only in characters the folder name drops, e.g. ``[0.9,0.95]``
            and ``[0.9, 0.95]``): they would train into one directory at the same time; or a
            point's names are longer than the file system takes (:func:`check_name_lengths`).
    """
    out = Path(out_dir)
    keys = list(grid)
    short = short_keys(keys)
    runs = []
    folders: dict[str, dict[str, str]] = {}
    limit = name_max(out)
    for values in itertools.product(*(grid[k] for k in keys)):
        point = dict(zip(keys, values))
        folder = _slug("__".join(f"{short[k]}={v}" for k, v in point.items())) if point else "base"
        if folder in folders:
            a = ", ".join(f"{k}={v}" for k, v in folders[folder].items())
            b = ", ".join(f"{k}={v}" for k, v in point.items())
            raise SweepError(f"--grid: the points ({a}) and ({b}) map to the same run directory {folder!r} "
                             f"(a duplicate value, or values differing only in punctuation or spaces); "
                             f"give each value once")
        folders[folder] = point
        check_name_lengths(folder, point, seeds, limit)
        for seed in seeds:
            name = f"{folder}/seed{seed}"
            ov = (*overrides, *(f"{k}={v}" for k, v in point.items()), f"seed={seed}")
            runs.append(SweepRun(name=name, point=point, seed=int(seed), overrides=ov, run_dir=out / name))
    return runs


def name_max(folder: str | os.PathLike) -> int:
    """The longest file name (bytes) the file system of ``folder`` (or of its nearest existing
    folder above) takes: ``NAME_MAX``, 255 on the usual Linux file systems (255 when unknown)."""
    for p in (Path(folder), *Path(folder).parents):
        try:
            if p.is_dir():
                return int(os.pathconf(p, "PC_NAME_MAX"))
        except (OSError, ValueError):
            break
    return 255


def check_name_lengths(folder: str, point: Mapping[str, str], seeds: Sequence[int], limit: int = 255) -> None:
    """Refuse a grid point whose files would have names longer than ``limit`` bytes: the run
    folder ``OUT/<folder>`` and, longer, its log ledger ``OUT/logs/<folder>_seed<k>.parts.jsonl``.
    (A long list or dict value, or many grid keys, make long folder names; checking them here
    turns an ``OSError: File name too long`` while checking or running them into this error.)

    Raises:
        SweepError: naming the grid point, the name's length and the limit.
    """
    if not seeds:
        return
    seed = max(seeds, key=lambda k: len(str(k)))
    longest = f"{_slug(f'{folder}/seed{seed}')}.parts.jsonl"
    n = len(os.fsencode(longest))
    if n > limit:
        label = ", ".join(f"{k}={v}" for k, v in point.items())
        shown = longest if len(longest) <= 80 else longest[:60] + "..." + longest[-17:]
        raise SweepError(f"--grid: the point ({label}) names its runs' files after its values, and its log "
                         f"logs/{shown} would be {n} bytes long, more than the {limit} bytes a file name may have "
                         f"here; give shorter values (or sweep fewer keys at once)")


def short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each grid key's shortest dotted suffix that no other key of ``keys`` ends with (at a
    dot), else the whole key: ``["backbone.attention.kind", "backbone.position.kind",
    "train.lr"]`` -> ``attention.kind``, ``position.kind``, ``lr``. One rule for one key or many;
    the suffixes tell the keys apart, so run folders are unambiguous."""
    out = {}
    for key in keys:
        parts = key.split(".")
        others = [k.split(".") for k in keys if k != key]
        n = next((n for n in range(1, len(parts) + 1) if all(o[-n:] != parts[-n:] for o in others)), len(parts))
        out[key] = ".".join(parts[-n:])
    return out


#: Config keys the sweep sets for every run itself (``seed`` from --seeds, ``run_dir`` its folder).
SWEEP_SET_KEYS = ("seed", "run_dir")


def check_overrides(grid: dict[str, list[str]], overrides: Sequence[str]) -> None:
    """Refuse a common ``KEY=VALUE`` override that each run's own value would replace silently.

    Raises:
        SweepError: an override that is not ``KEY=VALUE``, an override of ``seed`` (use
            --seeds) or ``run_dir`` (the sweep puts each run in ``OUT/<point>/seed<k>``), of a
            grid key with a value other than its grid
            values (``train.lr=0.1`` with ``--grid train.lr=1e-3,3e-3``; the same single value
            changes nothing and is let through), or of a key inside or above a grid key
            (``backbone.position={kind: alibi}`` with ``--grid backbone.position.kind=...``):
            the message names both.
    """
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if "=" not in item or not key:  # as `rl-tformers train` words it (an IndexError traceback before)
            raise SweepError(f"override {item!r} is not KEY=VALUE (e.g. train.steps=1000){config_name_hint(item)}")
        if key == "seed":
            raise SweepError(f"override {item!r}: the sweep sets each run's seed from --seeds "
                             f"(e.g. --seeds 5); drop {key}=")
        if key == "run_dir":
            raise SweepError(f"override {item!r}: the sweep puts each run in OUT/<point>/seed<k> "
                             f"(choose OUT with --out); drop {key}=")
        value = item.split("=", 1)[1].strip()
        for g, values in grid.items():
            if (key == g and any(v != value for v in values)) or key.startswith(g + ".") or g.startswith(key + "."):
                raise SweepError(f"override {item!r} and --grid {g}=... set the same option: each run's grid "
                                 f"value would replace it; give it once (in --grid, or as an override)")


def check_distinct_configs(runs: Sequence[SweepRun], requested: dict[str, dict[str, Any]]) -> None:
    """Refuse two runs that would train the same config (values spelled differently that mean
    the same, e.g. ``train.lr=1e-3,0.001`` or ``n_layers=1,01``): the same run twice, summarised as
    two grid points.

    Raises:
        SweepError: naming the two grid points.
    """

    seen: dict[str, SweepRun] = {}
    for run in runs:
        flat = {k: v for k, v in flatten(requested[run.name]).items() if k not in RERUN_IGNORED_KEYS}
        key = json.dumps(sorted(flat.items()), default=repr)
        other = seen.setdefault(key, run)
        if other is not run:
            raise SweepError(f"--grid: the points ({other.point_label}) and ({run.point_label}) give the same "
                             f"config (the values mean the same once parsed); give each value once")


SWEEP_LOCK = ".sweep.lock"


class _SweepLock:
    """One sweep at a time per folder: an exclusive ``flock`` on ``OUT/.sweep.lock`` (released by
    the system however the sweep exits). A folder this lock created that holds nothing but the
    lock file when it is released (the sweep was refused) is removed again."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.fd: int | None = None
        self.created: list[Path] = []

    def __enter__(self) -> _SweepLock:

        self.created = [d for d in (self.out, *self.out.parents) if not d.exists()]
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / SWEEP_LOCK
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SweepError(f"--out {self.out}: cannot create it or its lock file ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            self._remove_created()
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                try:
                    pid = int(path.read_text().strip() or "x")
                    who = f"pid {pid}"
                except (OSError, ValueError):
                    who = "another process"
                raise SweepError(f"--out {self.out}: another sweep ({who}) is running in this folder; wait for it "
                                 f"to finish (or stop it: Ctrl-C saves every run), then run the same command again "
                                 f"to finish it, or use another --out") from None
            raise SweepError(f"--out {self.out}: cannot lock {path} ({exc.strerror or exc}; a file system "
                             f"without flock?)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def _remove_created(self) -> None:
        if self.created and self.out.is_dir() and [p.name for p in self.out.iterdir()] in ([], [SWEEP_LOCK]):
            (self.out / SWEEP_LOCK).unlink(missing_ok=True)
            for d in self.created:  # innermost first; stop at one that gained other entries
                try:
                    d.rmdir()
                except OSError:
                    break

    def __exit__(self, *exc: Any) -> None:
        try:
            self._remove_created()
        finally:
            if self.fd is not None:
                os.close(self.fd)  # releases the lock
                self.fd = None


# -- running ---------------------------------------------------------------------------------------

#: Config keys that may differ between a stored run and the rerun of its sweep.
RERUN_IGNORED_KEYS = ("run_dir", "device", "train.progress")


def metrics_records(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` in order (none if it is missing); a line cut off
    by a crash is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def _final_eval_logged(run_dir: Path, step: int) -> bool:
    """True if ``metrics.jsonl`` has an ``eval/...`` scalar logged at ``step``."""
    return any(rec.get("step") == step and any(str(k).startswith("eval/") for k in rec)
               for rec in metrics_records(run_dir))


def stored_config(run_dir: Path) -> dict[str, Any] | None:
    """The config a run in ``run_dir`` was trained with: its newest checkpoint's (what ``--resume``
    continues), else its ``config.yaml``; None if it has neither (or they cannot be read)."""


    for _, path in ckpt.list_checkpoints(run_dir)[:1]:
        try:
            return OmegaConf.to_container(OmegaConf.create(ckpt.load_checkpoint(path)["config"]))  # type: ignore[return-value]
        except Exception:  # noqa: BLE001 - a damaged newest checkpoint: fall back to config.yaml
            break
    try:
        return OmegaConf.to_container(OmegaConf.load(Path(run_dir) / "config.yaml"))  # type: ignore[return-value]
    except (OSError, ValueError):
        return None


def config_differences(stored: dict[str, Any], requested: dict[str, Any]) -> list[str]:
    """``["train.steps: 300 (stored) -> 320 (requested)", ...]`` over every key but
    :data:`RERUN_IGNORED_KEYS`; a key that one side lacks (an option added after the stored run
    started) compares at the value composing that side gives it (``config_value_differences``)."""
    return [f"{key}: {a} (stored) -> {b} (requested)"
            for key, a, b in config_value_differences(stored, requested) if key not in RERUN_IGNORED_KEYS]


def run_state(run_dir: Path) -> str:
    """``new`` (nothing there), ``complete`` (trained to ``train.steps`` and, with
    ``eval.at_end``, evaluated at that step), ``unevaluated`` (trained to the end, final
    evaluation missing: it failed), ``partial`` (has a checkpoint, not finished) or
    ``uncheckpointed`` (the logs of a run that stopped before its first checkpoint: nothing to
    resume, it starts again, see :func:`clear_uncheckpointed`)."""


    if not holds_run(run_dir):
        return "new"
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        return "uncheckpointed"
    try:
        state = ckpt.load_checkpoint(found[0][1])
        cfg = OmegaConf.create(state["config"])
        steps, step = int(cfg.train.steps), int(state["step"])
        at_end = bool(OmegaConf.select(cfg, "eval.at_end", default=True))
    except Exception:  # noqa: BLE001 - a damaged newest checkpoint: let --resume sort it out
        return "partial"
    if step < steps:
        return "partial"
    return "unevaluated" if at_end and not _final_eval_logged(run_dir, step) else "complete"


def clear_uncheckpointed(run_dir: Path) -> list[Path]:
    """Remove what a run that stopped before its first checkpoint logged (``config.yaml``,
    ``metrics.jsonl``, TensorBoard event files), so that ``rl-tformers train --run-dir`` starts
    it again: the trainer refuses a directory holding a run's logs, and there is no checkpoint
    to ``--resume``. Anything else in ``run_dir`` (e.g. ``checkpoints/*.corrupt``) is kept; the
    earlier failure stays in the sweep's log of the run (``OUT/logs``, appended to).

    Returns:
        The files removed.
    """

    removed = []
    for path in [run_dir / METRICS_FILE, run_dir / CONFIG_FILE, *event_files(run_dir)]:
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed


def _compose_errors() -> tuple[type[BaseException], ...]:
    """What composing a run's config raises for a bad config (``ConfigError`` is a ``ValueError``)."""

    return (ValueError, RegistryError, FileNotFoundError)


def _compose(run: SweepRun, config: str | None, device: str | None = None) -> Any:
    """The composed config (read-only DictConfig) of ``run`` as ``train_command(run, config, "new",
    device)`` trains it (``run_dir`` not set); raises what :func:`~rl_tformers.runtime.run_config.compose` raises."""

    extra = [f"device={device}"] if device else []
    return compose(config, [*run.overrides, *extra, "train.progress=false"])


def compose_points(runs: Sequence[SweepRun], config: str | None, device: str | None = None
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, str], dict[str, Any]]:
    """Compose every run's config, going on past a grid point that does not compose.

    Returns:
        ``(requested, bad, composed)``: the plain config of every run whose grid point composes
        (resolved, with its ``run_dir``; by run name); ``{point label: why}`` for each grid point that
        does not (composed once: the seed does not change whether a config composes); the
        composed DictConfig of each good point's first run (by point label), for
        :func:`check_points`.
    """

    requested: dict[str, dict[str, Any]] = {}
    bad: dict[str, str] = {}
    composed: dict[str, Any] = {}
    for run in runs:
        if run.point_label in bad:
            continue
        try:
            cfg = _compose(run, config, device)
        except _compose_errors() as exc:
            bad[run.point_label] = str(exc)
            continue
        composed.setdefault(run.point_label, cfg)
        requested[run.name] = {**to_container(cfg), "run_dir": str(run.run_dir)}
    return requested, bad, composed


def _package_dirs() -> tuple[str, ...]:
    """The folders of this package's code (``rl_tformers``, its agents and envs), for telling its
    warnings from third-party ones."""

    dirs = []
    for name in ("rl_tformers", "rl_tformers.agents", "rl_tformers.envs"):
        try:
            dirs += [str(Path(d).resolve()) + os.sep for d in importlib.import_module(name).__path__]
        except ImportError:
            continue
    return tuple(dirs)


def check_points(points: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Build each grid point's agent and prepare its first batches, as ``rl-tformers train`` does
    before it trains anything (:func:`~rl_tformers.runtime.trainer.check_agent`, on the CPU),
    collecting every refusal instead of stopping at the first.

    Args:
        points: ``{point label: composed config}`` (:func:`compose_points`).

    Returns:
        ``(bad, warned)``: ``{point label: why}`` for each point whose agent is refused (an
        agent option, a combination the agent cannot train, a missing or malformed dataset...;
        an unexpected exception as ``TypeName: message``), and ``{warning: [point labels]}``
        for the warnings this package's code gave while building (e.g. PPO turning dropout
        off): the runs' own logs are not on the sweep's console.
    """


    bad: dict[str, str] = {}
    warned: dict[str, list[str]] = {}
    ours = _package_dirs()
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("rl_tformers")
    for label, cfg in points.items():
        messages.clear()
        handlers, propagate = logger.handlers[:], logger.propagate
        logger.handlers, logger.propagate = [_Keep(logging.WARNING)], False
        try:
            with warnings.catch_warnings(record=True) as caught:
                check_agent(cfg)
        except Exception as exc:  # noqa: BLE001 - every refusal is reported with its point
            bad[label] = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            continue
        finally:
            logger.handlers, logger.propagate = handlers, propagate
            gc.collect()  # the agent and its dataset, before the next point loads its own
        for w in caught:
            if str(Path(w.filename).resolve()).startswith(ours) and not issubclass(w.category, DeprecationWarning):
                messages.append(str(w.message))
        for message in dict.fromkeys(m.removeprefix("warning: ").strip() for m in messages):
            warned.setdefault(message, []).append(label)
    return bad, warned


def points_error(bad: Mapping[str, str], runs: Sequence[SweepRun]) -> SweepError:
    """One error naming every grid point of ``runs`` that cannot run (``bad``: ``{point label:
    why}``), in grid order: its runs (``n_layrs=1/seed0``, or ``n_layrs=1/seed*`` for several
    seeds), its grid values and why."""
    points: dict[str, list[SweepRun]] = {}
    for run in runs:
        points.setdefault(run.point_label, []).append(run)
    lines = []
    for label, rs in points.items():
        if label not in bad:
            continue
        name = rs[0].name if len(rs) == 1 else rs[0].name.rsplit("/", 1)[0] + "/seed*"
        values = f" ({label})" if rs[0].point else ""
        lines.append(f"{name}{values}: {bad[label]}".replace("\n", "\n    "))
    n = len(points)
    return SweepError(
        f"{len(lines)} of {n} grid point{'s' if n != 1 else ''} cannot run; nothing was started:\n  "
        + "\n  ".join(lines) + "\nfix or drop those values, then run the same command again")


def train_command(run: SweepRun, config: str | None, state: str, device: str | None = None,
                  plugins: Sequence[str] = ()) -> list[str]:
    """The ``rl-tformers train`` command line of ``run`` (``--resume`` when it has a checkpoint,
    ``state == "partial"``; the sweep resumes only runs whose stored config is the requested one,
    see :func:`sweep`; any other state starts the run in its directory). ``plugins``: the
    requested config's modules, named with ``--plugin`` to a resume (a resumed run imports only
    the plugins named on its command line)."""
    base = [sys.executable, "-m", "rl_tformers.cli", "train"]
    if state == "partial":
        return [*base, "--resume", str(run.run_dir), *[a for m in plugins for a in ("--plugin", str(m))],
                *([f"device={device}"] if device else []), "train.progress=false"]
    cmd = [*base, "--run-dir", str(run.run_dir)]
    if config:
        cmd += ["--config", config]
    if device:
        cmd += ["--device", device]
    return [*cmd, *run.overrides, "train.progress=false"]


class _Children:
    """The training processes this sweep process runs now, and the stop request of a signal.

    A signal handler (main thread) sets :attr:`stopped` and signals every live child under
    :attr:`lock`; a worker thread starts a child only under the same lock and only if no stop
    was requested, so no child starts after the signal and none is missed.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: set[subprocess.Popen] = set()
        self.stopped: int | None = None

    def stop(self, signum: int) -> None:
        with self.lock:
            self.stopped = signum
            for proc in self.procs:  # the trainer saves on SIGINT/SIGTERM (SIGHUP would kill it)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)


_CHILDREN = _Children()
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def parts_path(log_path: str | os.PathLike) -> Path:
    """The ledger of a run's parts next to its log: ``logs/<run>.log`` -> ``logs/<run>.parts.jsonl``."""
    return Path(log_path).with_suffix(".parts.jsonl")


def part_seconds(log_path: str | os.PathLike) -> list[float]:
    """Wall time (seconds) of each ``rl-tformers train`` process a sweep ran for the run logging
    to ``log_path`` (its first part and every resume, in order; :func:`_run_subprocess` appends
    one line per part). Empty when there is no ledger; unreadable lines are skipped."""
    try:
        lines = parts_path(log_path).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            value = float(json.loads(line)["seconds"])
        except (ValueError, KeyError, TypeError):
            continue
        if math.isfinite(value) and value >= 0:
            out.append(value)
    return out


def _run_subprocess(cmd: list[str], env_updates: dict[str, str], log_path: str,
                    cwd: str | None = None) -> tuple[int | None, float, str]:
    """Run ``cmd`` with its output in ``log_path``; returns (exit code, seconds, last lines of the log).

    ``cwd``: the working folder of the child (and of a relative ``log_path``): the sweep's own,
    so that the relative paths of its command (``--out``, ``--config``, overrides) mean what
    they meant to the sweep when a Ray worker, started in another folder, runs it.
    The child runs in its own session (a terminal's Ctrl-C reaches the sweep only, which
    forwards it: see :func:`run_local`). Exit code None: not started, the sweep was stopped.
    A started process's wall time and exit code are appended to the run's ledger
    (:func:`parts_path`; also from a Ray worker, which writes the log on the shared file system),
    so the results report the run's time over all its parts (:func:`part_seconds`).
    """
    if cwd is not None:
        log_path = str(Path(cwd) / log_path)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "a") as fh:  # a resumed run's log follows its first part
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        with _CHILDREN.lock:
            if _CHILDREN.stopped is not None:
                return None, 0.0, ""
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env_updates},
                                    start_new_session=True, cwd=cwd)
            _CHILDREN.procs.add(proc)
        try:
            rc = proc.wait()
        finally:
            with _CHILDREN.lock:
                _CHILDREN.procs.discard(proc)
    seconds = time.perf_counter() - t0
    with open(parts_path(log_path), "a") as fh:
        fh.write(json.dumps({"seconds": seconds, "returncode": rc}) + "\n")
    tail = "".join(Path(log_path).read_text(errors="replace").splitlines(keepends=True)[-15:])
    return rc, seconds, tail


def default_threads(jobs: int, environ: Mapping[str, str] | None = None) -> int:
    """Intra-op threads per run for ``--threads 0``: the user's ``OMP_NUM_THREADS`` when it is a
    positive integer (the user's choice is kept, not replaced by cores / jobs), else CPU cores / ``jobs``
    (at least 1)."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def thread_env(threads: int) -> dict[str, str]:
    """Environment giving a training process ``threads`` intra-op threads (OpenMP/MKL/PyTorch)."""
    n = str(max(1, int(threads)))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "PYTHONUNBUFFERED": "1"}


#: environment variables of the sweep that a Ray task's ``train`` gets too (a Ray worker has the
#: environment of the node's Ray, not the sweep's): rl-tformers' own and Minari's dataset root
FORWARDED_ENV_PREFIXES = ("RL_TFORMERS_", "MINARI_DATASETS_PATH")


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) named by :data:`FORWARDED_ENV_PREFIXES`."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


def _last_error_line(tail: str) -> str:
    """The last line of a run's log that names an error (else its last non-empty line)."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:") or re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln)]
    return (errors or lines or [""])[-1]


def _outcome(rc: int | None, seconds: float, tail: str, stopped: int | None) -> RunOutcome:
    if rc is None:
        return RunOutcome("not run")
    if rc == 0:
        return RunOutcome("ok", rc, seconds, tail)
    if stopped is not None and rc in (128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM):
        return RunOutcome("stopped", rc, seconds, tail)
    return RunOutcome("failed", rc, seconds, tail)


def _echo_outcome(echo: Callable[[str], None], name: str, o: RunOutcome) -> None:
    line = f"{o.status:7s} {name} ({o.seconds:.0f} s)"
    if o.status in ("failed", "incomplete") and o.log:
        line += f": {_last_error_line(o.log)}"
    echo(line)


def run_local(commands: Sequence[tuple[SweepRun, list[str]]], jobs: int, threads: int, log_dir: Path,
              echo: Callable[[str], None] = print, *, clock: Callable[[], float] = time.monotonic,
              poll_s: float = 0.5) -> dict[str, RunOutcome]:
    """Run the commands ``jobs`` at a time in local subprocesses (a thread pool waits on them).

    One line per run as it ends (``ok      kind=sdpa/seed0 (41 s)``), in the order the runs end,
    and, while runs are going, a progress line at least every
    :data:`~rl_tformers.runtime.progress.PLAIN_INTERVAL_S` seconds (``sweep: 1/4 runs (25%),
    ..., running: kind=performer/seed0 at step 300``: each running run's last logged step,
    from its ``metrics.jsonl``), checked every ``poll_s`` seconds of ``clock``.

    While it runs (when called from the main thread), SIGINT, SIGTERM and SIGHUP are forwarded
    to every running child (SIGHUP as SIGTERM: each saves a checkpoint and stops; a second
    Ctrl-C, forwarded too, aborts them as it aborts ``rl-tformers train``), no
    further run starts, and this returns after the children exit; runs stopped so have status
    ``stopped``, runs never started ``not run``. :func:`stop_signal` tells which signal it was.
    """
    outcomes: dict[str, RunOutcome] = {}
    _CHILDREN.stopped = None
    running: dict[str, Path] = {}  # run name -> run directory, while its process may run
    lock = threading.Lock()

    def one(item: tuple[SweepRun, list[str]]) -> tuple[str, RunOutcome]:
        run, cmd = item
        with lock:
            running[run.name] = run.run_dir
        try:
            rc, seconds, tail = _run_subprocess(cmd, thread_env(threads), str(log_dir / f"{_slug(run.name)}.log"))
        finally:
            with lock:
                running.pop(run.name, None)
        return run.name, _outcome(rc, seconds, tail, _CHILDREN.stopped)

    # the run lines mark every run's end (each at least 5% of a sweep of up to 20 runs): by time only
    bar = PlainProgress(len(commands), desc="sweep", unit="run", fraction=0.0, clock=clock, echo=echo)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            previous[s] = signal.signal(s, lambda signum, frame: _CHILDREN.stop(signum))
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            order = {pool.submit(one, item): k for k, item in enumerate(commands)}
            pending = set(order)
            while pending:
                done, pending = wait(pending, timeout=poll_s, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=order.__getitem__):
                    name, outcome = future.result()
                    outcomes[name] = outcome
                    _echo_outcome(echo, name, outcome)
                    bar.n += 1  # counted; the line above says it
                if pending:
                    with lock:
                        now_running = dict(running)
                    bar.set_postfix_str(_running_text(now_running))
                    bar.poll()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return outcomes


def _running_text(running: Mapping[str, Path]) -> str:
    """``running: a/seed0 at step 300, b/seed0 (starting)``: each run's last step in its
    ``metrics.jsonl``."""
    if not running:
        return ""
    parts = []
    for name, run_dir in running.items():
        step = _last_logged_step(run_dir)
        parts.append(f"{name} at step {step}" if step is not None else f"{name} (starting)")
    return "running: " + ", ".join(parts)


def _last_logged_step(run_dir: Path, tail_bytes: int = 4096) -> int | None:
    """The ``step`` of the last complete record of ``run_dir/metrics.jsonl`` (its last
    ``tail_bytes`` are read), or None when there is none yet."""
    try:
        with open(Path(run_dir) / METRICS_FILE, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue  # a record being written, or the cut first line
        if isinstance(step, int) and not isinstance(step, bool):
            return step
    return None


def stop_signal() -> int | None:
    """The signal that stopped the last :func:`run_local`, or None."""
    return _CHILDREN.stopped


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`SweepError` saying how to install it."""
    try:
        import ray
    except ImportError:
        raise SweepError(
            "--launcher ray needs Ray: pip install 'ray[default]' (and start or join a cluster: "
            "`ray start --head` on one node, `ray start --address HEAD:6379` on the others, then run the "
            "sweep with --ray-address HEAD:6379 or on the head node); --launcher local runs here without it"
        ) from None
    return ray


def run_ray(commands: Sequence[tuple[SweepRun, list[str]]], threads: int, gpus_per_run: float, log_dir: Path,
            echo: Callable[[str], None] = print, *, clock: Callable[[], float] = time.monotonic,
            poll_s: float = 0.5, address: str | None = None) -> dict[str, RunOutcome]:
    """Run every command as a Ray task (``num_cpus=threads``, ``num_gpus=gpus_per_run``); Ray
    schedules them on the cluster. ``ray.init`` joins the cluster at ``address`` (``HOST:PORT``
    of its head), else at ``RAY_ADDRESS``, else starts a local Ray.

    Each task runs its ``train`` in this process's working folder with the variables of
    :func:`forwarded_env` and :func:`thread_env` (a worker's own environment is its node's), so
    the run directories, the config and dataset paths must be the same paths on every node (a
    shared file system), and so must this Python (``sys.executable``).

    One line per run as it ends, in the order the runs end (``ray.wait``), and a progress line
    (``sweep: 1/4 runs (25%), ...``) at least every
    :data:`~rl_tformers.runtime.progress.PLAIN_INTERVAL_S` seconds of ``clock`` until the last ends."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or None)
    task = ray.remote(num_cpus=max(1, threads), num_gpus=gpus_per_run)(_run_subprocess)
    env, cwd = {**forwarded_env(), **thread_env(threads)}, os.getcwd()
    refs = {run.name: task.remote(cmd, env, str(log_dir / f"{_slug(run.name)}.log"), cwd) for run, cmd in commands}
    names = {ref: name for name, ref in refs.items()}  # (ObjectRefs hash by their id)
    bar = PlainProgress(len(refs), desc="sweep", unit="run", fraction=0.0, clock=clock, echo=echo)
    outcomes: dict[str, RunOutcome] = {}
    pending = list(refs.values())
    while pending:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
        for ref in ready:
            rc, seconds, tail = ray.get(ref)
            name = names[ref]
            outcomes[name] = _outcome(rc, seconds, tail, None)
            _echo_outcome(echo, name, outcomes[name])
            bar.n += 1  # counted; the line above says it
        if pending:
            bar.poll()
    return {name: outcomes[name] for name in refs}  # in the order of the runs


# -- results ---------------------------------------------------------------------------------------

def last_scalars(run_dir: Path) -> dict[str, float]:
    """The last logged value of every scalar in ``run_dir/metrics.jsonl`` (plus ``step``).

    ``metrics.jsonl`` writes a NaN or infinite scalar as ``null``; such a latest value is NaN
    here (a run whose loss or evaluation diverged at the end), not the last finite value logged
    before it, which would pass an earlier evaluation off as the final one.
    """
    out: dict[str, float] = {}
    for rec in metrics_records(run_dir):
        for k, v in rec.items():
            if k == "time" or isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                out[k] = float(v)
            elif v is None:  # a non-finite value (tracking writes NaN and +-inf as null)
                out[k] = math.nan
    return out


def _strict_json(value: Any) -> Any:
    """``value`` with every non-finite float as None (``null``: strict JSON, as ``metrics.jsonl``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def collect(runs: Sequence[SweepRun], outcomes: dict[str, RunOutcome],
            log_dir: Path | None = None) -> list[dict[str, Any]]:
    """One row per run: name, grid values, seed, status, exit code, seconds, then its last scalars.

    ``seconds``: the wall time of the run's ``rl-tformers train`` processes summed over every
    part a sweep ran into ``log_dir`` (the first part and each resume: :func:`part_seconds`), so
    a resumed or skipped run shows its whole time, not its last part's (or 0); without a ledger
    there (``log_dir`` None, or a run no sweep has started), the outcome's own seconds.
    """
    rows = []
    for run in runs:
        o = outcomes.get(run.name, RunOutcome("not run"))
        scalars = last_scalars(run.run_dir)
        parts = part_seconds(log_dir / f"{_slug(run.name)}.log") if log_dir is not None else []
        seconds = math.fsum(parts) if parts else o.seconds
        row: dict[str, Any] = {"run": run.name, **run.point, "seed": run.seed, "status": o.status,
                               "returncode": o.returncode, "seconds": round(seconds, 2),
                               "step": int(scalars.pop("step")) if "step" in scalars else None}
        row.update({k: scalars[k] for k in sorted(scalars)})
        rows.append(row)
    return rows


#: The columns the sweep writes for each run itself (not logged by the runs; ``seconds`` is a
#: number of every run and may be summarised).
RUN_COLUMNS = ("run", "seed", "status", "returncode", "step")


def check_metric(metric: str | None, grid: Mapping[str, Sequence[str]] = ()) -> None:
    """Refuse a ``--metric`` that is empty, or names a column the sweep writes itself (``step``,
    ``seed``, ``status``, ...) or a grid key, not a scalar the runs log: its summary would be
    empty, with a warning blaming the runs (``step: its final value is NaN or infinite in every
    completed run``), after the whole sweep ran.

    Raises:
        SweepError: naming ``--metric`` and the value.
    """
    if metric is None:
        return
    hint = "give a scalar the runs log, e.g. eval/return_mean or train/loss (default: the evaluation score, else "
    if not metric.strip():
        raise SweepError(f"--metric {metric!r} is empty; {hint}train/loss), or leave --metric out")
    if metric in RUN_COLUMNS or metric in grid:
        what = "a grid key" if metric in grid else "a column the sweep writes for each run"
        raise SweepError(f"--metric {metric}: that is {what}, not a scalar the runs log; {hint}train/loss)")


def pick_metric(rows: Sequence[dict[str, Any]], metric: str | None) -> str | None:
    """``metric`` if given, else the first of :data:`DEFAULT_METRICS` that some run logged."""
    if metric:
        return metric
    return next((m for m in DEFAULT_METRICS if any(m in r for r in rows)), None)


#: Run statuses whose metrics are those of a finished run (the summary and plot use only these).
COMPLETED = ("ok", "skipped")


def summarize(runs: Sequence[SweepRun], rows: Sequence[dict[str, Any]], metric: str | None) -> list[dict[str, Any]]:
    """Per grid point: mean, standard deviation (n - 1) and count ``n`` over seeds of ``metric``,
    of ``of`` runs.

    Only runs that completed (status in :data:`COMPLETED`) with a finite ``metric`` count: a
    failed, stopped, incomplete or not-run run's last logged value is one of an unfinished run
    (an intermediate evaluation, not the final one), so it stays in its row and out of the summary.
    """
    by_run = {r["run"]: r for r in rows}
    points: dict[str, list[SweepRun]] = {}
    for run in runs:
        points.setdefault(run.point_label, []).append(run)
    out = []
    for label, rs in points.items():
        vals = [by_run[r.name][metric] for r in rs if metric and by_run[r.name].get("status") in COMPLETED
                and isinstance(by_run[r.name].get(metric), float) and math.isfinite(by_run[r.name][metric])]
        out.append({"point": label, **rs[0].point, "metric": metric, "n": len(vals), "of": len(rs),
                    "mean": statistics.fmean(vals) if vals else None,
                    "std": statistics.stdev(vals) if len(vals) > 1 else None})  # one seed: no spread
    return out


def _fmt(v: Any) -> str:
    """A Markdown table cell: ``-`` for None, 4 significant digits for floats, ``|`` escaped."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def markdown(rows: Sequence[dict[str, Any]], summary: Sequence[dict[str, Any]], metric: str | None) -> str:
    """Summary table (per grid point) then the per-run table, as Markdown."""
    lines = [f"## Summary: {metric or '(no metric logged)'} over seeds", "",
             "| grid point | mean | std | seeds |", "|---|---|---|---|"]
    lines += [f"| {_fmt(s['point'])} | {_fmt(s['mean'])} | {_fmt(s['std'])} | {s['n']}/{s['of']} |" for s in summary]
    cols = ["run", "seed", "status", "step", "seconds"]
    extra = [c for c in dict.fromkeys(("train/loss", metric)) if c and c not in cols]
    lines += ["", "## Runs", "", "| " + " | ".join(cols + extra) + " |", "|" + "---|" * len(cols + extra)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols + extra) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(summary: Sequence[dict[str, Any]], metric: str, path: Path, title: str = "") -> None:
    """Bar chart of ``metric`` per grid point: mean over seeds, error bar one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [s for s in summary if s["mean"] is not None]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(pts) + 2), 4))
    ax.bar(range(len(pts)), [s["mean"] for s in pts], yerr=[s["std"] or 0.0 for s in pts], capsize=4,
           color="tab:blue", alpha=0.8)
    ax.set_xticks(range(len(pts)))
    ax.set_xticklabels([s["point"] for s in pts], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    most = max((int(s.get("n") or 0) for s in pts), default=0)
    ax.set_title(title or f"{metric}\n{'mean ± std over seeds' if most > 1 else 'one seed per point'}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def write_results(out_dir: Path, runs: Sequence[SweepRun], outcomes: dict[str, RunOutcome],
                  metric: str | None = None, warn: Callable[[str], None] = _stderr) -> SweepResult:
    """Collect every run and write ``results.{csv,json,md,png}`` into ``out_dir``.

    ``warn`` (default: stderr) gets a line when ``metric`` was given but no run logged it, when
    no run logged an evaluation metric so the summary falls back to ``train/loss``, when only
    runs that did not complete logged ``metric`` (the summary counts completed runs only), and
    when some completed runs logged it and others did not (naming those). A
    ``results.png`` of an earlier call is removed when there is nothing to plot.
    """
    rows = collect(runs, outcomes, out_dir / "logs")
    requested = metric
    metric = pick_metric(rows, metric)
    logged = sorted({k for r in rows for k in r if "/" in k})
    if requested and not any(requested in r for r in rows):
        warn(f"warning: --metric {requested}: no run logged it (logged: {', '.join(logged) or 'nothing'}); "
             f"no summary values and no plot")
    elif not requested and metric == "train/loss":
        warn("warning: no run logged an evaluation metric (eval.at_end=false, eval.every=0, or the evaluations "
             "failed); the summary and plot use train/loss")
    summary = summarize(runs, rows, metric)
    if metric and any(metric in r for r in rows) and all(s["mean"] is None for s in summary):
        if any(r.get("status") in COMPLETED and metric in r for r in rows):
            warn(f"warning: {metric}: its final value is NaN or infinite in every completed run that logged it "
                 f"(diverged?); no summary values and no plot")
        else:
            warn(f"warning: {metric}: only runs that did not complete logged it; the summary and plot count "
                 f"completed runs only")
    unlogged = [r["run"] for r in rows if r.get("status") in COMPLETED and metric not in r]
    if metric and unlogged and any(metric in r for r in rows):
        # e.g. eval/normalized_score over datasets with and without reference returns: a point's
        # `seeds` column (1/2, 0/2) would otherwise suggest runs that failed
        shown = ", ".join(unlogged[:5]) + (f" and {len(unlogged) - 5} more" if len(unlogged) > 5 else "")
        warn(f"warning: {metric}: {len(unlogged)} completed run{'s' if len(unlogged) > 1 else ''} did not log it "
             f"({shown}); their grid points count only the runs that did (the seeds column)")
    res = SweepResult(rows=rows, summary=summary, metric=metric)
    out_dir.mkdir(parents=True, exist_ok=True)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(out_dir / "results.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    failed = {name: asdict(o) for name, o in outcomes.items() if o.status == "failed"}
    (out_dir / "results.json").write_text(json.dumps(
        _strict_json({"metric": metric, "summary": summary, "runs": rows, "failed": failed}), indent=2,
        allow_nan=False))
    (out_dir / "results.md").write_text(markdown(rows, summary, metric))
    res.files = [str(out_dir / f"results.{ext}") for ext in ("csv", "json", "md")]
    png = out_dir / "results.png"
    if metric and any(s["mean"] is not None for s in summary):
        plot(summary, metric, png)
        res.files.append(str(png))
    else:
        png.unlink(missing_ok=True)  # a plot of an earlier metric would look like this one's
    done = {r["run"] for r in rows if r.get("status") in COMPLETED}
    res.files += _write_learning_curves(out_dir, runs, metric, done)
    return res


def _write_learning_curves(out_dir: Path, runs: Sequence[SweepRun], metric: str | None,
                           done: set[str] | None = None) -> list[str]:
    """``curves.json`` and ``curves.png``: ``metric`` against updates per grid point, mean ± std
    over its seeds (:mod:`rl_tformers.runtime.curves`), when some run logged it at two steps or
    more (periodic evaluations); otherwise earlier ones are removed. A grid point with completed
    runs (``done``: their names) counts those only, as the summary does, so a stopped seed does
    not cut its curve short; a point without one shows its runs so far."""
    groups: dict[str, list] = {}
    for run in runs:
        groups.setdefault(run.point_label, []).append(
            (run.name, run_curve(metrics_records(run.run_dir), metric) if metric else []))
    groups = {label: [c for name, c in pairs if done is None or name in done or not any(n in done for n, _ in pairs)]
              for label, pairs in groups.items()}
    points = point_curves(groups)
    files = [out_dir / "curves.json", out_dir / "curves.png"]
    if not metric or not any(len(c["steps"]) >= 2 for c in points.values()):
        for f in files:
            f.unlink(missing_ok=True)
        return []
    write_curves(points, metric, files[0])
    plot_curve_panels({out_dir.name: points}, metric, files[1])
    return [str(f) for f in files]


def check_launcher(launcher: str, gpus_per_run: float = 0.0, ray_address: str | None = None) -> None:
    """Refuse launcher options that cannot be used, or that the launcher would ignore.

    Raises:
        SweepError: an unknown ``launcher``; ``gpus_per_run`` not finite and >= 0; above 0, or
            a ``ray_address``, with the local launcher.
    """
    if launcher not in LAUNCHERS:
        raise SweepError(f"--launcher {launcher!r}; use one of {', '.join(LAUNCHERS)}")
    if not (math.isfinite(gpus_per_run) and gpus_per_run >= 0):
        raise SweepError(f"--gpus-per-run {gpus_per_run}: give a finite number >= 0 (GPUs per Ray task)")
    if launcher == "local" and gpus_per_run > 0:  # it would be ignored
        raise SweepError(f"--gpus-per-run {gpus_per_run:g} is for --launcher ray (Ray's num_gpus per run); "
                         f"local runs take their device from --device (e.g. --device cuda, shared by the --jobs "
                         f"runs); drop --gpus-per-run, or add --launcher ray")
    if launcher == "local" and ray_address:
        raise SweepError(f"--ray-address {ray_address} is for --launcher ray; add --launcher ray, or drop --ray-address")
    if ray_address:
        check_ray_address(ray_address)


#: seconds ``--ray-address`` gets to accept a TCP connection before the sweep gives up on it
RAY_CONNECT_TIMEOUT_S = 10.0


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """``--ray-address``: ``HOST:PORT`` (or ``ray://HOST:PORT``, Ray's client) with a port in
    1..65535 that accepts a TCP connection within ``timeout_s`` seconds, or Ray's words ``auto``
    and ``local``; checked before Ray is started (``ray.init`` on an address where nothing
    listens keeps retrying for minutes).

    Raises:
        SweepError: any other value, or an address where nothing answers, naming ``--ray-address``.
    """
    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise SweepError(f"--ray-address {address!r}: give the cluster head as HOST:PORT (e.g. 10.0.0.1:6379, the "
                         f"port from 1 to 65535), ray://HOST:PORT, or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise SweepError(f"--ray-address {address}: nothing answers there within {timeout_s:g} s ({exc}); start the "
                         f"cluster's head (ray start --head --port {port}) or give its address") from None


def sweep(config: str | None, grid: dict[str, list[str]], seeds: Sequence[int], out_dir: str | os.PathLike,
          overrides: Sequence[str] = (), *, jobs: int = 1, threads: int = 1, launcher: str = "local",
          gpus_per_run: float = 0.0, device: str | None = None, metric: str | None = None,
          echo: Callable[[str], None] = print, ray_address: str | None = None) -> SweepResult:
    """Run (or finish) a sweep and write its results; see the module docstring.

    Args:
        config: the base config (path or packaged name), shared by every run.
        grid: ``{dotted key: [values]}`` (:func:`parse_grid`).
        seeds: seeds of every grid point.
        out_dir: sweep folder (run directories, logs/, results.*).
        overrides: ``KEY=VALUE`` applied to every run (before the grid values).
        jobs: local runs at the same time (``launcher="local"``).
        threads: intra-op threads of each run (and Ray ``num_cpus``).
        launcher: ``local`` or ``ray``.
        gpus_per_run: Ray ``num_gpus`` of each run (fractions share a GPU).
        device: ``--device`` of every run.
        ray_address: ``HOST:PORT`` of a running Ray cluster's head (``launcher="ray"``; default
            ``RAY_ADDRESS``, else a local Ray is started).
        metric: the summary/plot metric (default: first of :data:`DEFAULT_METRICS` logged).

    Raises:
        SweepError: (before any run starts) launcher options (:func:`check_launcher`), a
            ``metric`` that is no logged scalar (:func:`check_metric`), ``out_dir`` (or a folder above
            it) is a file or a name too long, Ray missing with ``launcher="ray"``, duplicate run directories (:func:`expand`), an override the sweep
            would replace (:func:`check_overrides`), grid points whose config does not compose
            (:func:`compose_points`) or, with the local launcher, whose agent does not build
            (:func:`check_points`): one error naming every such point and why, two grid points
            with the same config (:func:`check_distinct_configs`), another sweep
            running in ``out_dir``, a run directory holding a run with another config (the
            message names each such run and the differing keys), or one being trained by
            another process.
    """

    check_launcher(launcher, gpus_per_run, ray_address)
    check_metric(metric, grid)
    out = Path(out_dir)
    try:
        problem = directory_problem(out, "--out")
    except OSError as exc:  # e.g. a name longer than the file system takes
        raise SweepError(f"--out {out}: {exc.strerror or exc}") from None
    if problem is not None:
        raise SweepError(problem)
    if launcher == "ray":
        import_ray()
    runs = expand(grid, seeds, out, overrides)
    check_overrides(grid, overrides)
    requested, bad, composed = compose_points(runs, config, device)  # every point, before anything starts
    check_distinct_configs([run for run in runs if run.name in requested], requested)
    with _SweepLock(out):  # from the state checks to the results: no other sweep in between
        return _sweep_locked(config, runs, requested, seeds, out, jobs=jobs, threads=threads, launcher=launcher,
                             gpus_per_run=gpus_per_run, device=device, metric=metric, echo=echo,
                             bad=bad, composed=composed, ray_address=ray_address)


def _echo_config_warnings(runs: Sequence[SweepRun], requested: dict[str, dict[str, Any]],
                          echo: Callable[[str], None], agent_warnings: Mapping[str, list[str]] | None = None) -> None:
    """Print each run config's warnings (:func:`~rl_tformers.runtime.trainer.config_warnings`) and
    the warnings of building the agents (``agent_warnings``, :func:`check_points`) once, with the
    grid points they apply to: the runs' own logs are not on the sweep's console."""

    points: dict[str, list[str]] = {}
    for run in runs:
        for message in config_warnings(requested[run.name]):
            labels = points.setdefault(message, [])
            if run.point_label not in labels:
                labels.append(run.point_label)
    for message, labels in (agent_warnings or {}).items():
        points.setdefault(message, []).extend(x for x in labels if x not in points.get(message, []))
    n_points = len({run.point_label for run in runs})
    for message, labels in points.items():
        where = "every run" if len(labels) == n_points else ", ".join(labels)
        echo(f"warning: {message} ({where})")


@dataclass
class _SweepPlan:
    """What a sweep does with each of its runs (:func:`_plan_runs`).

    Attributes:
        outcomes: the outcomes known without running (complete runs skipped, unevaluated ones).
        said: those outcomes in run order, to print.
        todo: ``(run, train command)`` of every run to start or resume.
        fresh: the runs that start anew; ``restart``: those of them that stopped before their
            first checkpoint (their directory is cleared first).
        problems: why run directories cannot hold their requested runs (one line each).
    """

    outcomes: dict[str, RunOutcome] = field(default_factory=dict)
    said: list[tuple[str, RunOutcome]] = field(default_factory=list)
    todo: list[tuple[SweepRun, list[str]]] = field(default_factory=list)
    fresh: list[SweepRun] = field(default_factory=list)
    restart: list[SweepRun] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _plan_runs(config: str | None, runs: Sequence[SweepRun], requested: dict[str, dict[str, Any]], out: Path,
               device: str | None) -> _SweepPlan:
    """Sort the runs whose grid point composes by the state of their run directory
    (:func:`run_state`): complete, unevaluated, to start or resume, or a problem (being trained
    by another process, or holding a run with another config). Starts and changes nothing."""
    plan = _SweepPlan()
    for run in runs:
        if run.name not in requested:  # its grid point does not compose: refused below
            continue
        state = run_state(run.run_dir)
        pid = lock_holder(run.run_dir)
        if pid is not None:
            plan.problems.append(f"{run.run_dir} is being trained by {f'pid {pid}' if pid else 'another process'}")
            continue
        if state != "new":
            stored = stored_config(run.run_dir)
            diffs = (config_differences(stored, requested[run.name]) if stored is not None
                     else ["(no readable config.yaml or checkpoint)"])
            if diffs:
                article = "an" if state[0] in "aeiou" else "a"
                plan.problems.append(f"{run.run_dir} holds {article} {state} run with another config:\n    "
                                     + "\n    ".join(diffs))
                continue
        if state == "complete":
            plan.outcomes[run.name] = RunOutcome("skipped", 0)
            plan.said.append((run.name, plan.outcomes[run.name]))
        elif state == "unevaluated":
            plan.outcomes[run.name] = RunOutcome(
                "incomplete", None, 0.0,
                f"error: {run.run_dir} trained to the end but has no final evaluation (it failed: see "
                f"{out / 'logs' / (_slug(run.name) + '.log')}); evaluate it with `rl-tformers eval {run.run_dir}` "
                f"or log it in the run with `rl-tformers train --resume {run.run_dir}`, or delete the directory to "
                f"train it again")
            plan.said.append((run.name, plan.outcomes[run.name]))
        else:
            if state in ("new", "uncheckpointed"):
                plan.fresh.append(run)
            if state == "uncheckpointed":
                plan.restart.append(run)
            plan.todo.append((run, train_command(run, config, state, device,
                                                 plugins=requested[run.name].get("plugins") or ())))
    return plan


def _refuse_problems(plan: _SweepPlan, runs: Sequence[SweepRun], composed: Mapping[str, Any] | None,
                     bad: dict[str, str], launcher: str, out: Path) -> dict[str, list[str]]:
    """Refuse the sweep if a run directory cannot hold its run, or a grid point does not compose
    (``bad``) or (local launcher) its agent does not build (:func:`check_points`, added to
    ``bad``); returns the warnings of building the agents, by message.

    Raises:
        SweepError: naming every such run directory and grid point.
    """
    if plan.problems:
        text = ("cannot rerun the sweep in " + str(out) + ": its run directories must hold the requested runs\n  "
                + "\n  ".join(plan.problems) + "\nuse another --out, rerun with the values those runs were started "
                "with, or delete those run directories")
        if bad:
            text += "\n" + str(points_error(bad, runs))
        raise SweepError(text)
    agent_warnings: dict[str, list[str]] = {}
    if launcher == "local" and composed:
        # points with a run to start: a run to resume is rebuilt from its own checkpoint by
        # `train --resume` (a resumed ODT or fine-tuning run does not read agent.init_from /
        # init_checkpoint, which may since have been moved or deleted), so it is not built here
        to_check = {run.point_label: composed[run.point_label] for run in plan.fresh if run.point_label in composed}
        refused, agent_warnings = check_points(to_check)
        bad.update(refused)
    if bad:
        raise points_error(bad, runs)
    return agent_warnings


def _announce_and_clear(plan: _SweepPlan, out: Path, echo: Callable[[str], None]) -> None:
    """Print the outcomes known without running; clear the directories of the runs that stopped
    before their first checkpoint and the time records of every run that starts anew."""
    for name, outcome in plan.said:
        if outcome.status == "skipped":
            echo(f"skipped {name} (complete)")
        else:
            _echo_outcome(echo, name, outcome)
    for run in plan.restart:  # stopped before its first checkpoint: nothing to resume, it starts again
        log_path = out / "logs" / f"{_slug(run.name)}.log"
        try:
            cause = _last_error_line(log_path.read_text(errors="replace"))
        except OSError:
            cause = ""
        echo(f"restart {run.name}: it stopped before its first checkpoint"
             + (f" ({cause})" if cause else "") + "; training it again from the start")
        clear_uncheckpointed(run.run_dir)
    for run in plan.fresh:  # a run that starts anew (e.g. its directory was deleted to train it again): so does its time
        parts_path(out / "logs" / f"{_slug(run.name)}.log").unlink(missing_ok=True)


def _sweep_locked(config: str | None, runs: Sequence[SweepRun], requested: dict[str, dict[str, Any]],
                  seeds: Sequence[int], out: Path, *, jobs: int, threads: int, launcher: str, gpus_per_run: float,
                  device: str | None, metric: str | None, echo: Callable[[str], None],
                  bad: Mapping[str, str] | None = None, composed: Mapping[str, Any] | None = None,
                  ray_address: str | None = None) -> SweepResult:
    """The part of :func:`sweep` that runs under the sweep folder's lock.

    ``bad``: the grid points whose config does not compose (:func:`compose_points`), refused
    together with the points whose agent is refused (:func:`check_points`, for the points with
    a run to start: a run to resume is rebuilt from its checkpoint by ``--resume``; local launcher only: Ray runs may see files this machine does
    not), after the run-directory checks and before anything is started or changed.
    """

    bad = dict(bad or {})
    plan = _plan_runs(config, runs, requested, out, device)
    todo, outcomes = plan.todo, plan.outcomes
    agent_warnings = _refuse_problems(plan, runs, composed, bad, launcher, out)
    _announce_and_clear(plan, out, echo)
    echo(f"sweep: {len(runs)} runs ({len(todo)} to run) over {len(runs) // max(1, len(seeds))} grid points x "
         f"{len(seeds)} seed{'' if len(seeds) == 1 else 's'} -> {out}")
    _echo_config_warnings(runs, requested, echo, agent_warnings)
    log_dir = out / "logs"
    stopped = None
    if todo:
        if launcher == "local":
            outcomes.update(run_local(todo, jobs, threads, log_dir, echo))
            stopped = stop_signal()
        else:
            outcomes.update(run_ray(todo, threads, gpus_per_run, log_dir, echo, address=ray_address))
    if stopped is not None:
        echo(f"sweep stopped by {signal.Signals(stopped).name}: the stopped runs saved a checkpoint; "
             f"run the same command again to continue")
    res = write_results(out, runs, outcomes, metric, warn=echo)
    res.interrupted = stopped
    return res


SWEEP_HELP = """Run a grid of training runs (config values x seeds) in parallel and collect one results table and plot.

Every grid point x seed is an ordinary `rl-tformers train` run in OUT/<point>/seed<k> (<point>: each grid key by its shortest dotted suffix no other grid key shares, e.g. attention.kind=sdpa__position.kind=none). Every grid point is checked before any run starts, and all bad points are named in one error: its config must compose and (local launcher) its agent must build as `rl-tformers train` checks it (dataset, agent options, backbone); two grid values giving the same config, and an override that a run's own seed, folder or grid value would replace, are refused; so is a second sweep in the same OUT while one runs. Running the same command again skips complete runs (trained to train.steps and, with eval.at_end, evaluated), resumes unfinished ones and starts again those that stopped before their first checkpoint; a run directory holding a run with another config (e.g. other train.steps) is refused, naming the differing keys. SIGINT/SIGTERM/SIGHUP stop every run with a checkpoint. Results: OUT/results.csv, results.json, results.md (per run, and mean/std over the seeds whose run completed per grid point) and results.png; with periodic evaluations (eval.every) also curves.json and curves.png (the metric against updates, mean ± std over seeds).

Examples:

  rl-tformers sweep -c dt/hopper_medium --grid backbone.attention.kind=sdpa,performer --seeds 0,1,2 --jobs 3 --out runs/sweep-attn train.steps=20000

  rl-tformers sweep -c toy --grid backbone.n_layers=1,2 --grid train.lr=1e-3,3e-3 --seeds 0-1 --out runs/sweep-toy

On a Ray cluster (run directories, configs, datasets and this Python at the same paths on every node): add --launcher ray --ray-address HEAD:6379 to run on the cluster whose head is HEAD (without --ray-address: $RAY_ADDRESS, else a local Ray on this machine); --gpus-per-run 1 gives each run a GPU.

  rl-tformers sweep -c toy --grid train.lr=1e-3,3e-3 --seeds 0-1 --launcher ray --ray-address HEAD:6379 --threads 1 --out runs/sweep-ray
"""


def register(app) -> None:
    """Add ``sweep`` to the ``rl-tformers`` app."""

    def sweep_command(
        overrides: list[str] = typer.Argument(None, metavar="[KEY=VALUE]...", help="Overrides applied to every run."),
        config: str = typer.Option(None, "--config", "-c", help="Base config: a path or a packaged name."),
        grid: list[str] = typer.Option(None, "--grid", "-g", metavar="KEY=V1,V2",
                                       help="A swept option and its values (repeat for a cartesian product)."),
        seeds: str = typer.Option("0", "--seeds", help="Seeds of every grid point: 0,1,2 or 0-4."),
        out: str = typer.Option(None, "--out", "-o", help="Sweep folder (default runs/sweep-<time>)."),
        jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Local runs at the same time."),
        threads: int = typer.Option(0, "--threads", min=0,
                                    help="Intra-op threads per run (0: $OMP_NUM_THREADS when set, else CPU "
                                         "cores / jobs, at least 1)."),
        launcher: str = typer.Option("local", "--launcher", help="local (subprocesses here) or ray (a Ray cluster)."),
        gpus_per_run: float = typer.Option(0.0, "--gpus-per-run", min=0.0, help="Ray only: GPUs per run."),
        ray_address: str = typer.Option(None, "--ray-address", metavar="HOST:PORT",
                                        help="Ray only: the head of a running cluster (default: $RAY_ADDRESS, "
                                             "else a local Ray)."),
        device: str = typer.Option(None, "--device", help="Device of every run (auto | cpu | cuda...)."),
        metric: str = typer.Option(None, "--metric", help="Summary/plot metric (default: eval score, else train/loss)."),
    ) -> None:

        try:
            if out is not None and not out.strip():  # a Path would read '' as '.', the current folder
                raise SweepError(f"--out {out!r} is empty; give the sweep folder (or leave --out out for "
                                 f"runs/sweep-<time>)")
            g = parse_grid(grid or [])
            s = parse_seeds(seeds)
            folder = Path(out) if out is not None else Path("runs") / f"sweep-{datetime.now():%Y%m%d-%H%M%S}"
            n_threads = threads or default_threads(jobs)
            res = sweep(config, g, s, folder, list(overrides or []), jobs=jobs, threads=n_threads, launcher=launcher,
                        gpus_per_run=gpus_per_run, device=device, metric=metric,
                        echo=lambda m: typer.echo(m, err=True), ray_address=ray_address)
        except SweepError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(markdown(res.rows, res.summary, res.metric))
        typer.echo("wrote " + ", ".join(res.files), err=True)
        if res.interrupted is not None:
            raise typer.Exit(128 + int(res.interrupted))
        if any(r["status"] in ("failed", "incomplete") for r in res.rows):
            raise typer.Exit(1)

    app.command("sweep", help=SWEEP_HELP, no_args_is_help=True)(sweep_command)
