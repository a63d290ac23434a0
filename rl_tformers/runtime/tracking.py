"""Run logging: TensorBoard event files and ``metrics.jsonl`` in the run directory.

Every scalar goes to both: TensorBoard (``tensorboard --logdir runs``) and one JSON object per
logging event in ``RUN_DIR/metrics.jsonl``::

    {"step": 100, "time": 1732912345.12, "train/loss": 0.41, "train/lr": 0.0001, ...}

``step`` is the number of optimiser updates completed. The resolved config is logged once as
TensorBoard text (``config``) and as hparams (flattened dotted keys), and written to
``RUN_DIR/config.yaml`` by the trainer.

Resume without going backwards: a run that crashed after its last checkpoint at step ``s`` has
events and jsonl lines for steps ``> s``. When the run resumes from ``s``,
:func:`truncate_run_logs` rewrites every event file and ``metrics.jsonl`` keeping only records
with ``step <= s`` (each file replaced atomically), so the files never contain a step twice or
a step that goes backwards. (TensorBoard's own ``purge_step`` only hides such events in the
UI and leaves them in the files, where other readers still see them.) A record truncated by
the crash is dropped too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.tensorboard.summary import hparams

from rl_tformers.runtime.checkpoint import atomic_write

METRICS_FILE = "metrics.jsonl"
EVENTS_GLOB = "events.out.tfevents.*"

log = logging.getLogger(__name__)


def event_files(run_dir: str | os.PathLike) -> list[Path]:
    """TensorBoard event files directly in ``run_dir``, in TensorBoard's reading order (by name)."""
    return sorted(Path(run_dir).glob(EVENTS_GLOB))


def read_event_records(path: str | os.PathLike) -> list[bytes]:
    """Serialized ``Event`` records of one file; a record cut off by a crash ends the list."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    records = []
    try:
        for rec in RawEventFileLoader(str(path)).Load():
            records.append(rec)
    except Exception as exc:  # noqa: BLE001 - a damaged tail is expected after a crash
        log.warning("%s: stopped reading at a damaged record (%s)", path, exc)
    return records


def truncate_event_file(path: str | os.PathLike, max_step: int) -> int:
    """Rewrite ``path`` keeping only events with ``step <= max_step``; returns how many were dropped."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    records = read_event_records(path)
    kept = [r for r in records if event_pb2.Event.FromString(r).step <= max_step]
    size = Path(path).stat().st_size
    written = sum(len(r) + 16 for r in kept)  # 8-byte length + 4-byte crc + data + 4-byte crc
    if len(kept) == len(records) and written == size:
        return 0

    def write(f: Any) -> None:
        w = RecordWriter(f)
        for r in kept:
            w.write(r)

    atomic_write(path, write)
    return len(records) - len(kept)


def truncate_jsonl(path: str | os.PathLike, max_step: int) -> int:
    """Rewrite a metrics.jsonl keeping lines with ``step <= max_step`` (and dropping broken lines)."""
    path = Path(path)
    if not path.exists():
        return 0
    text = path.read_text()
    lines = text.splitlines()
    kept = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and int(rec.get("step", 0)) <= max_step:
            kept.append(line)
    if len(kept) == len(lines) and (not text or text.endswith("\n")):
        return 0
    atomic_write(path, lambda f: f.write("".join(line + "\n" for line in kept).encode()))
    return len(lines) - len(kept)


def truncate_run_logs(run_dir: str | os.PathLike, max_step: int) -> int:
    """Drop every logged record after ``max_step`` from the run's event files and metrics.jsonl.

    Returns:
        The number of records dropped (events + jsonl lines).
    """
    dropped = sum(truncate_event_file(p, max_step) for p in event_files(run_dir))
    dropped += truncate_jsonl(Path(run_dir) / METRICS_FILE, max_step)
    if dropped:
        log.info("dropped %d log records after step %d (written after the checkpoint resumed from)", dropped, max_step)
    return dropped


def _jsonable(v: Any) -> Any:
    """A scalar as strict JSON: NaN and +-inf become ``null`` (TensorBoard keeps the value
    itself). A finite stand-in such as +-1e308 would be indistinguishable from a measured number
    (a sweep would average it)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _hparam_value(v: Any) -> Any:
    if isinstance(v, (bool, int, float, str)):
        return v
    return "null" if v is None else json.dumps(v)


class RunLogger:
    """Writes scalars, figures, text and hparams for one run (a no-op when ``enabled`` is False).

    Args:
        run_dir: the run directory (event files and metrics.jsonl go directly in it).
        enabled: False on non-main ranks (distributed training): nothing is opened or written.
        flush_secs: TensorBoard flush interval (seconds).
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, flush_secs: int = 30) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._writer = None
        self._jsonl = None
        if enabled:
            # optional tensorboard (seconds to import): only a run that logs loads it
            from torch.utils.tensorboard import SummaryWriter

            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(log_dir=str(self.run_dir), flush_secs=flush_secs)
            self._jsonl = open(self.run_dir / METRICS_FILE, "a", buffering=1)  # line-buffered

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Log ``{tag: value}`` at ``step`` to TensorBoard and as one metrics.jsonl line."""
        if not self.enabled or not values:
            return
        for tag, v in values.items():
            self._writer.add_scalar(tag, float(v), global_step=step)
        rec = {"step": int(step), "time": round(time.time(), 3)}
        rec.update({k: _jsonable(float(v)) for k, v in values.items()})
        self._jsonl.write(json.dumps(rec) + "\n")

    def figure(self, tag: str, fig: Any, step: int) -> None:
        """Log a matplotlib figure as an image (the figure is closed)."""
        if self.enabled:
            self._writer.add_figure(tag, fig, global_step=step, close=True)

    def text(self, tag: str, text: str, step: int) -> None:
        if self.enabled:
            self._writer.add_text(tag, text, global_step=step)

    def config(self, yaml_text: str, flat: Mapping[str, Any], metrics: tuple[str, ...] = ("train/loss",)) -> None:
        """Log the resolved config as text (step 0) and as TensorBoard hparams of this run.

        Args:
            yaml_text: the resolved config as YAML.
            flat: flattened config (``{"train.lr": 1e-4, ...}``); lists and None become strings.
            metrics: scalar tags the HParams dashboard shows beside the hyperparameters.
        """
        if not self.enabled:
            return

        self.text("config", "```yaml\n" + yaml_text + "\n```", 0)
        exp, ssi, sei = hparams({k: _hparam_value(v) for k, v in flat.items()}, {m: 0.0 for m in metrics})
        fw = self._writer._get_file_writer()
        for summary in (exp, ssi, sei):
            fw.add_summary(summary)

    def flush(self) -> None:
        if self.enabled:
            self._writer.flush()
            self._jsonl.flush()

    def close(self) -> None:
        if self.enabled and self._writer is not None:
            self._writer.close()
            self._jsonl.close()
            self._writer = self._jsonl = None
            self.enabled = False
