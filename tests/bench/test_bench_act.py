"""``rl-tformers bench act``: act() latency of the in-package policy, TorchScript and onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()


def test_bench_act_times_the_three_paths_at_each_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "act.json"
    r = runner.invoke(app, ["bench", "act", "--batches", "1,3", "--steps", "2", "--warmup", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert [(row["batch"], row["path"]) for row in data["rows"]] == [
        (n, p) for n in (1, 3) for p in ("in-package", "torchscript", "onnx")]
    assert all(row["ratio"] == row["ms_per_step"] / data["rows"][3 * (i // 3)]["ms_per_step"]
               for i, row in enumerate(data["rows"]))
    assert "| 3 | onnx |" in r.stdout and data["settings"]["threads"] == 1


def test_bench_act_refuses_a_repeated_batch_size_before_measuring() -> None:
    r = runner.invoke(app, ["bench", "act", "--batches", "32,32"])
    assert r.exit_code == 2 and r.stderr == "error: --batches: 32 is given twice\n"


def test_the_act_latency_table_of_docs_performance_is_its_json() -> None:
    """Every row of the ``act()`` latency table in docs/performance.md is the measured JSON's."""
    root = Path(__file__).resolve().parents[2]
    data = json.loads((root / "docs" / "performance" / "bench_act.json").read_text())
    text = (root / "docs" / "performance.md").read_text()
    section = text[text.index("### act() latency of exported policies"):text.index("### Attention scaling")]
    rows = [f"| {r['batch']} | {r['path']} | {r['ms_per_step']:.3f} | {r['ratio']:.2f}x |" for r in data["rows"]]
    assert [line for line in section.splitlines() if line.startswith("| ") and "x |" in line] == rows
    load = " ".join(map(str, data["machine"]["loadavg_1_5_15"]))
    assert f"{data['settings']['threads']} thread, {data['machine']['date']}, load average {load}" in section
    assert f"--steps {data['settings']['steps']}" in section
