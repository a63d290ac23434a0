"""The pixel DT's training-speed numbers in docs/encoders.md and docs/performance.md equal the
JSON of the run they are copied from (``docs/performance/bench_train_minatar_t1.json``, written by
``rl-tformers bench train --task minatar-breakout ... --memory``)."""

from __future__ import annotations

from tests.docs.markdown import DOCS_DIR, load_perf

RUN = "bench_train_minatar_t1.json"


def _rate(d: dict, impl: str, mode: str) -> float:
    return next(r["steps_per_s"] for r in d["rows"] if (r["impl"], r["mode"]) == (impl, mode))


def _ratio(d: dict, mode: str, impl: str, vs: str) -> float:
    return next(r["ratio"] for r in d["ratios"] if (r["mode"], r["impl"], r["vs"]) == (mode, impl, vs))


def _mib(v: int) -> str:
    return f"{v / 2**20:.0f} MiB"


def test_pixel_training_speed_numbers_are_the_runs():
    d = load_perf(RUN)
    assert d["settings"]["task"] == "minatar-breakout" and d["settings"]["threads"] == 1
    text = (DOCS_DIR / "encoders.md").read_text()
    e, m = "e2e", "model"
    claims = [
        f"| **ours (float32) / d3rlpy** | **{_ratio(d, e, 'ours', 'd3rlpy'):.2f}x** "
        f"({_rate(d, 'ours', e):.2f} vs {_rate(d, 'd3rlpy', e):.2f}/s) | **{_ratio(d, m, 'ours', 'd3rlpy'):.2f}x** "
        f"({_rate(d, 'ours', m):.2f} vs {_rate(d, 'd3rlpy', m):.2f}/s) |",
        f"| ours + bf16 autocast / d3rlpy | {_ratio(d, e, 'ours+bf16', 'd3rlpy'):.2f}x "
        f"({_rate(d, 'ours+bf16', e):.2f}/s) | {_ratio(d, m, 'ours+bf16', 'd3rlpy'):.2f}x "
        f"({_rate(d, 'ours+bf16', m):.2f}/s) |",
        f"| ours + bf16 autocast / ours | {_ratio(d, e, 'ours+bf16', 'ours'):.2f}x | "
        f"{_ratio(d, m, 'ours+bf16', 'ours'):.2f}x |",
    ]
    params = {r["impl"]: r["params"] for r in d["rows"]}
    claims.append(f"{params['d3rlpy']:,} parameters against our {params['ours']:,}")
    flops = {r["impl"]: r["flops_per_step"] / 1e9 for r in d["rows"]}
    claims.append(f"{flops['ours']:.2f} GFLOP against d3rlpy's {flops['d3rlpy']:.2f}")
    for impl, held in (("ours", "one array"), ("d3rlpy", "8,069 episode arrays")):
        mem = d["memory"][impl]
        claims.append(f"| {impl} | {mem['observations_dtype']}, {_mib(mem['observations_bytes'])} ({held}) | "
                      f"{_mib(mem['rss_start'])} | {_mib(mem['rss_built'])} | {_mib(mem['peak_rss'])} |")
    missing = [c for c in claims if c not in text]
    assert not missing, "\n".join(missing)
    perf = (DOCS_DIR / "performance.md").read_text()
    line = (f"ours / d3rlpy **{_ratio(d, e, 'ours', 'd3rlpy'):.2f}x** in float32 ({_rate(d, 'ours', e):.2f} vs "
            f"{_rate(d, 'd3rlpy', e):.2f} updates/s")
    assert line in " ".join(perf.split()), line
