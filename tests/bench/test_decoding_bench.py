"""``rl-tformers bench decoding`` (rl_tformers/bench/decoding.py): the trimmed state holds the
slots the kinds declare (window or none), the untrimmed baseline one per token, both give the
same step output, and bad options are refused by name. Tiny sizes: the timings mean nothing here."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rl_tformers.bench.decoding import KINDS, run
from rl_tformers.cli import app
from tests.threads import one_thread

_one_thread = one_thread


def test_trimmed_state_holds_the_declared_slots_and_equals_the_baseline():
    res = run(steps=(4, 70), repeats=1, d_model=16, n_heads=2, chunk=16)
    rows = {(r["kind"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {(k, m) for k in KINDS for m in ("trimmed", "untrimmed")}
    # sliding_window w=32: (w - 1) keys; local block 32 + memory 32: block - 1 + memory; linear: none
    want = {"sliding_window": 31, "local": 63, "performer": 0, "rfa": 0, "rfa_gated": 0}
    for k, slots in want.items():
        assert rows[(k, "trimmed")]["slots"] == {4: min(4, slots), 70: slots}
        assert rows[(k, "untrimmed")]["slots"] == {4: 4, 70: 70}
        assert rows[(k, "trimmed")]["max_abs_diff"] <= 1e-5
        assert all(v > 0 for v in rows[(k, "trimmed")]["ms"].values())


@pytest.mark.parametrize("args, msg", [
    (["--kinds", "dense"], "--kinds: dense; choose from"),
    (["--steps", "100"], "--steps must be at least 2 increasing"),
    (["--steps", "100,10"], "--steps must be at least 2 increasing"),
    (["--steps", "a,b"], "--steps must be comma-separated integers"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bad_options_are_refused_by_name(args, msg):
    res = CliRunner().invoke(app, ["bench", "decoding", *args])
    assert res.exit_code == 2 and msg in res.output, res.output


def test_json_output(tmp_path):
    out = tmp_path / "d.json"
    res = CliRunner().invoke(app, ["bench", "decoding", "--kinds", "performer", "--steps", "2,5", "--repeats", "1",
                                   "--json", "--out", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["rows"]] == ["trimmed", "untrimmed"] and data["steps"] == [2, 5]
    assert data["rows"][0]["slots"] == {"2": 0, "5": 0}
