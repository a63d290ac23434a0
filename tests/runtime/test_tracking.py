"""Event-file and metrics.jsonl truncation used on resume."""

from __future__ import annotations

import json
from pathlib import Path

from runtime_helpers import read_events

from rl_tformers.runtime.tracking import METRICS_FILE, RunLogger, event_files, truncate_run_logs


def test_truncate_drops_later_records(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path)
    logger.config("seed: 0\n", {"seed": 0, "train.betas": [0.9, 0.99], "run_dir": None})
    for step in range(1, 11):
        logger.scalars(step, {"train/loss": 1.0 / step})
    logger.close()
    (events_file,) = event_files(tmp_path)
    with open(events_file, "ab") as f:
        f.write(b"\x10\x00\x00")  # a record cut off by a crash
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 11, "train/lo')  # a line cut off by a crash

    dropped = truncate_run_logs(tmp_path, 6)
    assert dropped == 4 + 4 + 1  # events and jsonl lines of steps 7..10, plus the broken line
    steps = [ev.step for ev in read_events(tmp_path) if any(v.tag == "train/loss" for v in ev.summary.value)]
    assert steps == [1, 2, 3, 4, 5, 6]
    tags = {v.tag for ev in read_events(tmp_path) for v in ev.summary.value}
    assert {"config/text_summary", "_hparams_/experiment", "_hparams_/session_start_info"} <= tags
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert truncate_run_logs(tmp_path, 6) == 0  # idempotent, files untouched


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path / "r", enabled=False)
    logger.scalars(1, {"a": 1.0})
    logger.close()
    assert not (tmp_path / "r").exists()


def test_metrics_jsonl_writes_every_non_finite_scalar_as_null(tmp_path):
    import json
    import math

    from rl_tformers.runtime.tracking import RunLogger

    log = RunLogger(tmp_path)
    log.scalars(3, {"a": math.inf, "b": -math.inf, "c": math.nan, "d": 1e308, "e": 2.5})
    log.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert {k: rec[k] for k in "abcde"} == {"a": None, "b": None, "c": None, "d": 1e308, "e": 2.5}
