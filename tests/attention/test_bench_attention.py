"""``rl-tformers bench attention``: rows, ratios to SDPA, budgets, errors, crossover, plot, CLI, RL-scale hook."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rl_tformers.bench import attention as ba
from rl_tformers.cli.bench import bench_modules

TINY = {"lengths": (32, 64), "d_model": 16, "n_heads": 2, "repeats": 1}


def _rows(res, kind):
    return [r for r in res.rows if r["kind"] == kind]


def test_rows_ratios_and_modes():
    res = ba.run(["performer", "linformer"], ba.Settings(**TINY))
    assert {(r["kind"], r["mode"]) for r in res.rows} == {
        ("sdpa", "causal"), ("sdpa", "bidirectional"), ("performer", "causal"), ("linformer", "bidirectional"),
    }
    assert all(r["status"] == "ok" and r["seconds"] > 0 and r["peak_mib"] > 0 for r in res.rows)
    for r in _rows(res, "sdpa"):
        assert r["time_ratio"] == pytest.approx(1.0) and r["mem_ratio"] == pytest.approx(1.0)
    base = {(r["length"], r["mode"]): r for r in _rows(res, "sdpa")}
    for r in _rows(res, "linformer"):  # compared with bidirectional sdpa at the same length
        b = base[(r["length"], "bidirectional")]
        assert r["time_ratio"] == pytest.approx(r["seconds"] / b["seconds"])
        assert r["mem_ratio"] == pytest.approx(r["peak_mib"] / b["peak_mib"])
    assert set(res.crossover) == {"performer", "linformer"}


def test_dense_over_the_memory_budget_is_skipped_not_run():
    s = ba.Settings(**{**TINY, "lengths": (32, 4096)}, memory_budget_gb=0.05, padded=True)
    res = ba.run(["reference", "performer"], s)
    skipped = [r for r in res.rows if r["status"].startswith("skipped")]
    assert {(r["kind"], r["length"]) for r in skipped} == {("sdpa", 4096), ("reference", 4096)}
    assert all(r["seconds"] is None and r["time_ratio"] is None for r in skipped)
    perf = {r["length"]: r for r in _rows(res, "performer")}
    assert perf[4096]["status"] == "ok" and perf[4096]["time_ratio"] is None  # no baseline to divide by
    assert res.crossover["performer"]["only_it_runs_at"] == [4096]
    # the sub-quadratic kind's *measured* peak fits the budget that dense attention's L x L
    # scores would exceed (the complexity check: measured, not an element count)
    budget_mib = s.memory_budget_gb * 1024
    assert perf[4096]["peak_mib"] is not None and 0 < perf[4096]["peak_mib"] < budget_mib
    assert ba.dense_bytes_estimate("reference", 4096, s) / 2**20 > budget_mib
    scores_mib = 2 * s.batch * s.n_heads * 4096 * 4096 * 4 / 2**20  # (B, H, L, L) float32 scores + probabilities
    assert perf[4096]["peak_mib"] < scores_mib / 10


def test_a_kind_that_cannot_run_is_reported(monkeypatch):
    real = ba.kind_fields
    monkeypatch.setattr(ba, "kind_fields", lambda k, n: {"max_len": 40} if k == "linformer" else real(k, n))
    res = ba.run(["linformer"], ba.Settings(**TINY))
    rows = {r["length"]: r for r in _rows(res, "linformer")}
    assert rows[32]["status"] == "ok"
    assert rows[64]["status"].startswith("error: ValueError") and "max_len" in rows[64]["status"]


def test_time_budget_stops_longer_lengths():
    res = ba.run(["performer"], ba.Settings(**{**TINY, "lengths": (32, 64, 128)}, time_budget_s=0.0))
    status = [r["status"] for r in _rows(res, "performer")]
    assert status[0] == "ok" and all(s.startswith("skipped: over the time budget") for s in status[1:])


def test_crossover_is_the_first_length_from_which_the_kind_stays_better():
    rows = []
    for n, t, m in ((256, 2.0, 3.0), (1024, 0.8, 1.2), (4096, 1.1, 0.5), (16384, 0.5, 0.2)):
        rows.append({"kind": "k", "length": n, "status": "ok", "time_ratio": t, "mem_ratio": m})
        rows.append({"kind": "sdpa", "length": n, "status": "ok", "time_ratio": 1.0, "mem_ratio": 1.0})
    c = ba.crossover(rows)["k"]
    assert c["faster_from"] == 16384 and c["lighter_from"] == 4096 and c["only_it_runs_at"] == []


def test_table_plot_and_all_kinds(tmp_path):
    res = ba.run(["rfa"], ba.Settings(**TINY))
    table = ba.markdown_table(res)
    assert table.splitlines()[0].startswith("| kind | mode | L=32") and "| rfa | causal |" in table
    ba.plot(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    kinds = ba.all_kinds()
    assert kinds[0] == "sdpa" and {"lsh", "routing", "linformer", "rfa", "performer", "sinkhorn"} <= set(kinds)


def test_cli_writes_json(tmp_path):
    from rl_tformers.cli import app

    out = tmp_path / "b.json"
    r = CliRunner().invoke(app, ["bench", "attention", "--kinds", "lsh", "--lengths", "32", "--repeats", "1",
                                 "--d-model", "16", "--n-heads", "2", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert {r["kind"] for r in data["rows"]} == {"sdpa", "lsh"}
    assert data["settings"]["lengths"] == [32]
    bad = CliRunner().invoke(app, ["bench", "attention", "--kinds", "nope", "--lengths", "32"])
    assert bad.exit_code != 0


def test_rl_scale_hook(monkeypatch):
    monkeypatch.setattr(ba, "RL_SCALE_CASES", {})
    rows, notes = ba.run_rl_scale(["sdpa"], "cpu")
    assert rows == [] and "K = 500" in notes[0]
    ba.register_rl_scale_case("dt_k500", lambda kinds, device: [{"case": "dt_k500", "kind": k} for k in kinds])
    with pytest.raises(ValueError, match="already registered"):
        ba.register_rl_scale_case("dt_k500", lambda kinds, device: [])
    rows, notes = ba.run_rl_scale(["sdpa", "performer"], "cpu")
    assert [r["kind"] for r in rows] == ["sdpa", "performer"] and notes == []


def test_bench_group_is_assembled_from_modules():
    assert "rl_tformers.bench.attention" in bench_modules()
    assert "rl_tformers.cli.bench" not in bench_modules()


def test_dense_estimate_extrapolates_the_measured_peak_quadratically():
    s = ba.Settings(**TINY, padded=True)
    assert ba.dense_bytes_estimate("performer", 4096, s, (1024, 1e6)) == 0  # sub-quadratic: never skipped
    assert ba.dense_bytes_estimate("sdpa", 4096, s, (1024, 1e6)) == 16_000_000
    assert ba.dense_bytes_estimate("sdpa", 4096, s) == 4096 * 4096  # first length: the bool mask
    assert ba.dense_bytes_estimate("sdpa", 4096, ba.Settings(**TINY)) == 0  # fused, unmasked: O(L)
    assert ba.dense_bytes_estimate("reference", 64, s) == 2 * 1 * 2 * 64 * 64 * 4
