"""``rl-tformers bench context``: DT update time against the context length K per attention kind,
its log-log growth fit and plot, and the option checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rl_tformers.bench import context as bc
from rl_tformers.cli import app


def test_loglog_slope_is_the_exponent_of_a_power_law():
    ks = [20, 50, 100, 200, 500]
    assert bc.loglog_slope(ks, [3e-3 * k ** 2 for k in ks]) == pytest.approx(2.0, abs=1e-12)
    assert bc.loglog_slope(ks, [7e-4 * k for k in ks]) == pytest.approx(1.0, abs=1e-12)
    assert (bc.growth(1.1), bc.growth(1.9)) == ("linear", "quadratic")
    with pytest.raises(ValueError, match="two or more positive"):
        bc.loglog_slope([20], [1.0])


def test_every_kind_and_length_is_timed_and_fitted(tmp_path: Path):
    s = bc.Settings(kinds=("sdpa", "local"), lengths=(4, 8, 12), batch_size=2, d_model=16, n_layers=1, n_heads=2,
                    steps=1, warmup=0)
    res = bc.run(s, plot=str(tmp_path / "k.png"))
    assert [(r["kind"], r["context_len"], r["tokens"]) for r in res.rows] == [
        ("sdpa", 4, 12), ("sdpa", 8, 24), ("sdpa", 12, 36), ("local", 4, 12), ("local", 8, 24), ("local", 12, 36)]
    assert all(r["seconds_per_update"] == min(r["seconds"]) > 0 and len(r["seconds"]) == 1 for r in res.rows)
    assert [f["kind"] for f in res.fits] == ["sdpa", "local"]
    for f in res.fits:
        rows = [r for r in res.rows if r["kind"] == f["kind"]]
        assert f["slope_all"] == bc.loglog_slope([r["context_len"] for r in rows],
                                                 [r["seconds_per_update"] for r in rows])
        assert f["top3_lengths"] == [4, 8, 12] and f["growth"] in ("linear", "quadratic")
    assert res.fits[0]["ratio_to_dense_at_max_k"] == 1.0
    assert (tmp_path / "k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = bc.markdown(res)
    assert table.splitlines()[0] == "| K (tokens) | sdpa ms/update | local ms/update |"
    assert "| 12 (36) | " in table and "plot: " in table
    json.dumps(res.as_dict())


@pytest.mark.parametrize("args, message", [
    (["--kinds", "dense"], "--kinds: unknown attention kind 'dense'"),
    (["--lengths", "20,20"], "--lengths: 20 is given twice"),
    (["--lengths", "0"], "--lengths 0: a context length must be in [1, 1000]"),
    (["--lengths", "2000"], "--lengths 2000: a context length must be in [1, 1000]"),
    (["--lengths", "a,b"], "--lengths 'a,b': give a comma-separated list"),
    (["--heads", "3"], "--d-model 64 is not divisible by --heads 3"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--device", "tpu"], "--device 'tpu': use cpu or cuda"),
])
def test_bad_options_are_one_error_line_before_any_work(args: list[str], message: str, monkeypatch) -> None:
    monkeypatch.setattr(bc, "measure", lambda *a: pytest.fail("measured despite a bad option"))
    r = CliRunner().invoke(app, ["bench", "context", *args])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1].startswith(f"error: {message}"), r.output


def test_a_plot_path_under_a_file_or_a_folder_is_refused_before_any_work(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(bc, "measure", lambda *a: pytest.fail("measured despite a bad --plot"))
    (tmp_path / "afile").write_text("")
    for plot, message in ((tmp_path / "afile" / "k.png", f"--plot {tmp_path / 'afile' / 'k.png'}: "
                                                         f"{tmp_path / 'afile'} is a file, not a directory"),
                          (tmp_path, f"--plot {tmp_path} is a directory; give a file name, e.g. "
                                     f"{tmp_path / 'bench_context.png'}")):
        r = CliRunner().invoke(app, ["bench", "context", "--plot", str(plot)])
        assert r.exit_code == 2, r.output
        assert r.stderr == f"error: {message}\n" and r.stdout == ""
