"""Every number of the README's performance table and of docs/performance.md equals the JSON file
in docs/performance/ it is copied from (the benchmark commands write those files)."""

from __future__ import annotations

from tests.docs.markdown import DOCS_DIR, README_PATH, flat, load_perf

PERF_MD = DOCS_DIR / "performance.md"


def _load(name: str) -> dict:
    return load_perf(name)


def _rate(d: dict, impl: str, mode: str) -> dict:
    return next(r for r in d["rows"] if r["impl"] == impl and r["mode"] == mode)


def _ratio(d: dict, mode: str, impl: str, vs: str) -> float:
    return next(r["ratio"] for r in d["ratios"] if (r["mode"], r["impl"], r["vs"]) == (mode, impl, vs))


def intel_host_claims() -> list[str]:
    """The numbers of the Intel Sapphire Rapids host (MKL GEMMs) quoted in docs/performance.md."""
    q, t2, t1 = (
        _load("bench_train_t1_quiet.json"),
        _load("bench_train_t2_quiet.json"),
        _load("bench_train_t1.json"),
    )
    early, prof = _load("bench_train_t1_quiet_earlier.json"), _load("profile_ours_quiet.json")
    ev, data, ddp = _load("bench_eval.json"), _load("bench_data.json"), _load("ddp_throughput_quiet.json")
    ours, d3 = _rate(q, "ours", "e2e"), _rate(q, "d3rlpy", "e2e")
    peak = q["peak_gflops"]["fp32"]
    peers_mfu = [
        _rate(q, "d3rlpy", "e2e")["mfu"],
        _rate(q, "d3rlpy", "model")["mfu"],
        _rate(q, "hf", "model")["mfu"],
    ]
    matmul = prof["categories"]["matmul"]
    mem = {(m["kind"], m["mem_len"]): m["reencode_over_memory"] for m in ev["memory"]}
    win, seg = data["samplers"]
    eager, lazy = data["load"]
    u = ddp["updates_per_s"]
    return [
        f"load {q['machine']['loadavg_1_5_15'][0]:.2f} at the start, {q['machine']['loadavg_1_5_15_end'][0]:.2f} at the end",
        f"| **ours / d3rlpy** | **{_ratio(q, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({ours['steps_per_s']:.2f} vs "
        f"{d3['steps_per_s']:.2f}/s) | **{_ratio(q, 'model', 'ours', 'd3rlpy'):.2f}x** |",
        f"| ours / Hugging Face | – | {_ratio(q, 'model', 'ours', 'hf'):.2f}x |",
        f"| ours + bf16 autocast / d3rlpy | **{_ratio(q, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x** | "
        f"{_ratio(q, 'model', 'ours+bf16', 'd3rlpy'):.2f}x |",
        f"| ours + `torch.compile` / ours | {_ratio(q, 'e2e', 'ours+compile', 'ours'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+compile', 'ours'):.2f}x |",
        f"ours / d3rlpy **{_ratio(t2, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({_rate(t2, 'ours', 'e2e')['steps_per_s']:.2f} vs "
        f"{_rate(t2, 'd3rlpy', 'e2e')['steps_per_s']:.2f}/s), ours / Hugging Face {_ratio(t2, 'model', 'ours', 'hf'):.2f}x",
        f"{d3['flops_per_step'] / 1e9:.2f} → {ours['flops_per_step'] / 1e9:.2f} GFLOP per update",
        f"**MFU: {ours['mfu']:.0%}** ({ours['flops_per_step'] / 1e9:.2f} GFLOP x {ours['steps_per_s']:.2f}/s = "
        f"{ours['gflops_per_s']:.1f} GFLOP/s against a 1-thread fp32 matmul peak\nof {peak:.1f} GFLOP/s",
        f"the peers {round(100 * min(peers_mfu))}-{max(peers_mfu):.0%} of the same peak on their {d3['flops_per_step'] / 1e9:.2f}\nGFLOP",
        f"ours would be {ours['steps_per_s'] * d3['flops_per_step'] / 1e9 / peak:.0%} counted at the peers' FLOPs",
        f"MFU is {ours['mfu']:.0%}, not 50%",
        f"About {matmul['share']:.0%} of an update is the same MKL GEMMs the\npeers use, at about "
        f"{ours['flops_per_step'] / 1e9 / (matmul['ms'] / 1e3) / peak:.0%} of the peak",
        f"dropout random numbers: {prof['categories']['dropout RNG']['share']:.0%} alone",
        f"we would be at most {_ratio(q, 'e2e', 'ours', 'd3rlpy') / matmul['share']:.1f}x d3rlpy",
        # the earlier quiet run and the loaded run of the Intel host, in their own sections
        f"gave ours {_rate(early, 'ours', 'e2e')['steps_per_s']:.2f}/s, d3rlpy {_rate(early, 'd3rlpy', 'e2e')['steps_per_s']:.2f}/s:\n"
        f"{_ratio(early, 'e2e', 'ours', 'd3rlpy'):.2f}x, bf16 {_ratio(early, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x, "
        f"compile {_ratio(early, 'e2e', 'ours+compile', 'ours'):.2f}x, MFU {_rate(early, 'ours', 'e2e')['mfu']:.0%}",
        f"| **ours / d3rlpy** | **{_ratio(t1, 'e2e', 'ours', 'd3rlpy'):.2f}x** | **{_ratio(t1, 'model', 'ours', 'd3rlpy'):.2f}x** |",
        f"| ours + bf16 / d3rlpy | **{_ratio(t1, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x** | {_ratio(t1, 'model', 'ours+bf16', 'd3rlpy'):.2f}x |",
        f"Load average {t1['machine']['loadavg_1_5_15'][0]:.1f} at the start",
        f"**{mem[('xl', 32)]:.1f}x at M = 32 to {min(mem[('xl', 512)], mem[('gtrxl', 512)]):.0f}-"
        f"{max(mem[('xl', 512)], mem[('gtrxl', 512)]):.0f}x at M = 512**",
        f"the window sampler delivers {win['sampler_samples_per_s']:,.0f} samples/s and the segment sampler "
        f"{seg['sampler_samples_per_s']:,.0f}, against\n{win['training_samples_per_s']:.0f} and "
        f"{seg['training_samples_per_s']:.0f} consumed by training (**>{min(win['headroom'], seg['headroom']) // 10 * 10:.0f}x headroom**)",
        f"loads and validates in\n{eager['load_s']:.2f} s ({lazy['load_s']:.2f} s lazily)",
        f"trains at {u['p1t1']:.2f} updates/s in one\n1-thread process, {u['p1t2']:.2f} with 2 threads and "
        f"**{u['p2t1']:.2f} with `--nproc 2`** ({ddp['ratio_to_p1t1']['p2t1']:.2f}x;",
    ]


def amd_host_claims() -> list[str]:
    """The numbers of the AMD EPYC host (oneDNN GEMMs through ``cpu_matmul: auto``) quoted in
    docs/performance.md; the rows of its ratio table are the README's headline table too."""
    q, t2, prof = _load("bench_train_t1_amd.json"), _load("bench_train_t2_amd.json"), _load("profile_ours_amd.json")
    o, d3 = _rate(q, "ours", "e2e"), _rate(q, "d3rlpy", "e2e")
    peak, mkl_peak = q["peak_gflops"]["fp32"], max(q["peak_gflops_by_size"]["fp32"].values())
    peers = [_rate(q, "d3rlpy", "e2e")["mfu"], _rate(q, "d3rlpy", "model")["mfu"], _rate(q, "hf", "model")["mfu"]]
    mm, ops = prof["categories"]["matmul"], dict(prof["top_ops"])
    e2e = _ratio(q, "e2e", "ours", "d3rlpy")
    return [
        f"load {q['machine']['loadavg_1_5_15'][0]:.2f} at the start, {q['machine']['loadavg_1_5_15_end'][0]:.2f} at the end; "
        f"`docs/performance/bench_train_t1_amd.json`",
        f"| **ours / d3rlpy** | **{e2e:.2f}x** ({o['steps_per_s']:.2f} vs {d3['steps_per_s']:.2f}/s) | "
        f"**{_ratio(q, 'model', 'ours', 'd3rlpy'):.2f}x** |",
        f"| ours / Hugging Face | – | {_ratio(q, 'model', 'ours', 'hf'):.2f}x |",
        f"| ours with PyTorch's MKL GEMMs (`cpu_matmul=mkl`) / d3rlpy | {_ratio(q, 'e2e', 'ours+mkl', 'd3rlpy'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+mkl', 'd3rlpy'):.2f}x |",
        f"| ours + bf16 autocast / d3rlpy | {_ratio(q, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+bf16', 'd3rlpy'):.2f}x |",
        f"| ours + `torch.compile` / ours | {_ratio(q, 'e2e', 'ours+compile', 'ours'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+compile', 'ours'):.2f}x |",
        f"ours / d3rlpy **{_ratio(t2, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({_rate(t2, 'ours', 'e2e')['steps_per_s']:.2f} vs "
        f"{_rate(t2, 'd3rlpy', 'e2e')['steps_per_s']:.2f}/s), ours / Hugging Face {_ratio(t2, 'model', 'ours', 'hf'):.2f}x",
        f"Most of the step from {_ratio(q, 'e2e', 'ours+mkl', 'd3rlpy'):.2f}x to {e2e:.2f}x",
        f"(1-thread SGEMM {mkl_peak:.0f} GFLOP/s here)", f"reaches {peak:.1f} GFLOP/s (`rl-tformers bench gemm`",
        f"**MFU: {o['mfu']:.0%}** (11.91 GFLOP x {o['steps_per_s']:.2f}/s = {o['gflops_per_s']:.1f} GFLOP/s against a "
        f"1-thread fp32 matmul peak of {peak:.1f} GFLOP/s",
        f"the peers {round(100 * min(peers))}-{max(peers):.0%} of the same peak; ours would be "
        f"{o['steps_per_s'] * d3['flops_per_step'] / 1e9 / peak:.0%} counted at the peers' FLOPs",
        f"1.5x d3rlpy met in fp32 ({e2e:.2f}x); MFU {o['mfu']:.0%}, not 50%.",
        f"the GEMMs take {mm['share']:.0%} of an update and run at "
        f"{o['flops_per_step'] / 1e9 / (mm['ms'] / 1e3) / peak:.0%} of the peak",
        f"dropout random numbers ({prof['categories']['dropout RNG']['share']:.0%})",
        f"{ops['aten::copy_']:.0f} of {prof['profiled_ms_per_update']:.0f} ms per update",
    ]




def zen5_dropout_claims() -> list[str]:
    """The numbers of the Zen 5 host's dropout-draws section of docs/performance.md; the rows of its
    1-thread table are the README's headline table too."""
    q, t2, r2 = (_load("bench_train_t1_zen5_lanes.json"), _load("bench_train_t2_zen5_lanes.json"),
                 _load("bench_train_t2_zen5_lanes_r2.json"))
    ab = _load("dropout_loss_ab.json")
    o, d3 = _rate(q, "ours", "e2e"), _rate(q, "d3rlpy", "e2e")

    def gain(d: dict, mode: str) -> float:  # ours over ours with F.dropout, same run
        return _rate(d, "ours", mode)["steps_per_s"] / _rate(d, "ours+torch-dropout", mode)["steps_per_s"]

    def e2e(d: dict, impl: str) -> float:
        return _rate(d, impl, "e2e")["steps_per_s"]

    amp = _load("amp_loss_ab.json")["summary"]
    diffs = [abs(r["difference"]) for r in ab["summary"]]
    sds = [r["seed_sd"] for r in ab["summary"]]
    last = ab["summary"][-1]
    return [
        f"| **ours / d3rlpy** | **{_ratio(q, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({o['steps_per_s']:.2f} vs "
        f"{d3['steps_per_s']:.2f}/s) | **{_ratio(q, 'model', 'ours', 'd3rlpy'):.2f}x** |",
        f"| ours / Hugging Face | – | {_ratio(q, 'model', 'ours', 'hf'):.2f}x |",
        f"| ours with PyTorch's `F.dropout` draws / d3rlpy | {_ratio(q, 'e2e', 'ours+torch-dropout', 'd3rlpy'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+torch-dropout', 'd3rlpy'):.2f}x |",
        f"| ours with PyTorch's MKL GEMMs (`cpu_matmul=mkl`) / d3rlpy | {_ratio(q, 'e2e', 'ours+mkl', 'd3rlpy'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+mkl', 'd3rlpy'):.2f}x |",
        f"| ours + bf16 autocast / d3rlpy | {_ratio(q, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x | "
        f"{_ratio(q, 'model', 'ours+bf16', 'd3rlpy'):.2f}x |",
        f"**{gain(q, 'e2e'):.2f}x** at 1 thread ({gain(q, 'model'):.2f}x update\nonly), {gain(t2, 'e2e'):.2f}x and "
        f"{gain(r2, 'e2e'):.2f}x at 2 threads",
        f"ours / d3rlpy **{_ratio(t2, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({e2e(t2, 'ours'):.2f} vs\n{e2e(t2, 'd3rlpy'):.2f}/s) "
        f"and **{_ratio(r2, 'e2e', 'ours', 'd3rlpy'):.2f}x** ({e2e(r2, 'ours'):.2f} vs {e2e(r2, 'd3rlpy'):.2f}/s) in two runs, "
        f"{_ratio(t2, 'model', 'ours', 'd3rlpy'):.2f}x and {_ratio(r2, 'model', 'ours', 'd3rlpy'):.2f}x update only",
        f"(with\n`F.dropout`'s draws {_ratio(t2, 'e2e', 'ours+torch-dropout', 'd3rlpy'):.2f}x and "
        f"{_ratio(r2, 'e2e', 'ours+torch-dropout', 'd3rlpy'):.2f}x); bf16 autocast / d3rlpy "
        f"{_ratio(t2, 'e2e', 'ours+bf16', 'd3rlpy'):.2f}x (first run)",
        f"MFU at 1 thread: **{o['mfu']:.0%}** e2e, {_rate(q, 'ours', 'model')['mfu']:.0%} update only "
        f"({o['flops_per_step'] / 1e9:.2f} GFLOP x {o['steps_per_s']:.2f}/s = {o['gflops_per_s']:.1f} GFLOP/s",
        f"oneDNN's {q['peak_gflops']['fp32']:.1f} GFLOP/s fp32 peak",
        f"with `F.dropout` {_rate(q, 'ours+torch-dropout', 'e2e')['mfu']:.0%}; d3rlpy {d3['mfu']:.0%}",
        f"(1-minute load average {q['machine']['loadavg_1_5_15'][0]:.2f}, {t2['machine']['loadavg_1_5_15'][0]:.2f} and "
        f"{r2['machine']['loadavg_1_5_15'][0]:.2f} at the starts, {q['machine']['loadavg_1_5_15_end'][0]:.2f}, "
        f"{t2['machine']['loadavg_1_5_15_end'][0]:.2f} and {r2['machine']['loadavg_1_5_15_end'][0]:.2f} at the ends)",
        f"by at most {max(diffs):.5f}",
        f"is {min(sds):.5f}-{max(sds):.5f} per block; after\n1,000 updates {last['lanes_mean']:.5f} against "
        f"{last['torch_mean']:.5f} (seed spread {last['seed_sd']:.5f})",
        f"differ by at most {max(abs(r['difference']) for r in amp):.5f} against a seed spread of\n"
        f"{min(r['seed_sd'] for r in amp):.5f} or more; after 1,000 updates {amp[-1]['fp32_mean']:.5f} in both "
        f"({amp[-1]['fp32_mean']:.6f} and {amp[-1]['bf16_mean']:.6f})",
    ]


def test_zen5_dropout_numbers_equal_their_json() -> None:
    text = flat(PERF_MD.read_text())
    missing = "\n".join(claim for claim in zen5_dropout_claims() if flat(claim) not in text)
    assert not missing, f"docs/performance.md text not found (numbers differ from *_zen5_lanes*.json):\n{missing}"


def test_amd_host_numbers_equal_their_json() -> None:
    text = flat(PERF_MD.read_text())
    missing = "\n".join(claim for claim in amd_host_claims() if flat(claim) not in text)
    assert not missing, f"docs/performance.md text not found (numbers differ from docs/performance/*_amd.json):\n{missing}"


def test_readme_performance_table_rows_equal_their_json() -> None:
    readme = flat(README_PATH.read_text())
    rows = [claim for claim in zen5_dropout_claims() if claim.startswith("| ")]
    assert len(rows) == 5
    missing = "\n".join(row for row in rows if flat(row) not in readme)
    assert not missing, f"README rows not found (numbers differ from docs/performance/bench_train_t1_zen5_lanes.json):\n{missing}"


def test_dt_acting_forward_numbers_equal_their_json() -> None:
    text = flat(PERF_MD.read_text())
    missing = "\n".join(claim for claim in dt_acting_claims() if flat(claim) not in text)
    assert not missing, f"docs/performance.md text not found (numbers differ from dt_acting_forward.json):\n{missing}"


def dt_acting_claims() -> list[str]:
    """The numbers of the DT acting-forward paragraph of docs/performance.md
    (docs/performance/dt_acting_forward.json)."""
    d = _load("dt_acting_forward.json")
    ds, lq = d["deciding_step_only"], d["rows_past_quota"]
    p10, p50 = ds["paired"]
    l10, l50 = lq["paired"]
    full = [r for r in ds["rollouts"] if r["mode"] == "full"]
    seq = {r["round"]: r["seconds"] for r in full if r["n_envs"] == 1}
    over = {(r["round"], r["n_envs"]): seq[r["round"]] / r["seconds"] for r in full if r["n_envs"] > 1}
    share = [r["split"]["forward_frac"] for r in full]
    steps = {r["n_envs"]: r["env_steps"] for r in ds["rollouts"] if r["mode"] == "predict_at" and r["round"] == 0}
    live = {r["n_envs"]: r["live_row_frac"] for r in lq["round_robin"]["rollouts"]
            if r["round"] == 0 and r["mode"] == "all_rows"}
    return [
        f"under load {ds['loadavg_start'][0]:.2f} → {ds['loadavg_end'][0]:.2f} and {lq['loadavg_start'][0]:.2f} → "
        f"{lq['loadavg_end'][0]:.2f}",
        f"{d['episodes']} episodes ({full[0]['env_steps']:,} env steps)",
        f"**{p10['ratio_of_means']:.2f}x at 10 environments** ({p10['predict_at_ms_mean']:.2f} vs "
        f"{p10['full_ms_mean']:.2f} ms per call; median per-call ratio {p10['median_of_ratios']:.2f}x)",
        f"**{p50['ratio_of_means']:.2f}x at 50** ({p50['predict_at_ms_mean']:.2f} vs {p50['full_ms_mean']:.2f} ms; "
        f"{p50['median_of_ratios']:.2f}x)",
        f"played {steps[1]:,}, {steps[10]:,} and {steps[50]:,} env steps (returns up to "
        f"{max(r['max_return_rel_diff'] for r in ds['rollouts']):.1%} apart)",
        f"their rows were {1 - live[10]:.0%} (10 environments) and {1 - live[50]:.0%} (50)",
        f"**{l10['ratio_of_means']:.2f}x at 10 and {l50['ratio_of_means']:.2f}x at 50** "
        f"({l10['ratio_of_means_on_calls_with_rows_past_quota']:.2f}x and "
        f"{l50['ratio_of_means_on_calls_with_rows_past_quota']:.2f}x on the calls with idle rows)",
        f"two rounds): {over[(0, 10)]:.2f}x and {over[(1, 10)]:.2f}x at 10 environments, {over[(0, 50)]:.2f}x and "
        f"{over[(1, 50)]:.2f}x at 50",
        f"forward is {min(share):.0%}-{max(share):.0%} of the loop at every N",
    ]


def test_intel_host_numbers_equal_their_json() -> None:
    text = flat(PERF_MD.read_text())
    missing = "\n".join(claim for claim in intel_host_claims() if flat(claim) not in text)
    assert not missing, f"docs/performance.md text not found (numbers differ from docs/performance/*.json):\n{missing}"


def test_performance_profile_table_equals_its_json() -> None:
    before, after = _load("profile_ours_before.json")["categories"], _load("profile_ours.json")["categories"]
    rows = {  # table row -> profiler categories summed
        "matmul (`mm`, `addmm`, `bmm`, `baddbmm`)": ["matmul"],
        "elementwise (ReLU and its backward, adds, dropout/mask multiplies)": ["elementwise"],
        "dropout random numbers (`bernoulli_`)": ["dropout RNG"],
        "other (copies, views, Python)": ["other"],
        "bias copies inside `addmm`": ["addmm bias copy"],
        "LayerNorm": ["norm"],
        "reductions, softmax": ["reduction", "softmax"],
        "AdamW (fused)": ["optimizer"],
    }
    text = PERF_MD.read_text()
    for row, cats in rows.items():
        b = sum(before[c]["share"] for c in cats)
        ms = sum(after[c]["ms"] for c in cats)
        a = sum(after[c]["share"] for c in cats)
        a_txt = f"{a:.1%}" if a < 0.01 else f"{a:.0%}"
        expected = f"| {row} | {b:.0%} | {ms:.0f} | {a_txt} |"
        assert expected in text, expected


def performance_md_claims() -> list[str]:
    out = []
    for name, bold_mfu, hf_note in (
        ("bench_train_t1_quiet.json", True, " (model)"),
        ("bench_train_t1.json", False, ""),
    ):
        d = _load(name)

        def row(impl, d=d):
            e2e, model = _rate(d, impl, "e2e") if impl != "hf" else None, _rate(d, impl, "model")
            return e2e, model, f"{model['flops_per_step'] / 1e9:.2f}"

        e, m, gf = row("ours")
        mfu = f"**{e['mfu']:.0%}**" if bold_mfu else f"{e['mfu']:.0%}"
        out.append(
            f"| **ours** (shipped `dt/hopper_medium`) | **{e['steps_per_s']:.2f}** | **{m['steps_per_s']:.2f}** | {gf} | {mfu} |"
        )
        for impl, label, peak in (("ours+bf16", "ours + `train.amp=bf16`", " of the bf16 peak"),
                                  ("ours+compile", "ours + `train.compile=true`", ""),
                                  ("d3rlpy", "d3rlpy 2.8.1", "")):
            e, m, gf = row(impl)
            out.append(f"| {label} | {e['steps_per_s']:.2f} | {m['steps_per_s']:.2f} | {gf} | {e['mfu']:.0%}{peak} |")
        _, m, gf = row("hf")
        out.append(f"| Hugging Face 5.24 | – | {m['steps_per_s']:.2f} | {gf} | {m['mfu']:.0%}{hf_note} |")
    ev, data, ddp = _load("bench_eval.json"), _load("bench_data.json"), _load("ddp_throughput_quiet.json")
    # the evaluation throughput rows come from bench_eval_throughput.json (tests/bench/test_bench_eval.py)
    names = {"xl": "Transformer-XL (pre-norm)", "gtrxl": "GTrXL (gated)"}
    for m in ev["memory"]:
        out.append(
            f"| {names[m['kind']]} | {m['mem_len']} | {m['memory_ms_per_step']:.2f} | "
            f"{m['reencode_ms_per_step']:.2f} | {m['reencode_over_memory']:.1f}x |"
        )
    for s in data["samplers"]:
        out.append(
            f"| {s['sampler_samples_per_s']:,.0f} | {s['training_samples_per_s']:.0f} | {s['headroom']:.0f}x |"
        )
    for r in data["load"]:
        out.append(f"| {r['load_s']:.2f} s | {r['first_batch_s']:.2f} s |")
    u, x = ddp["updates_per_s"], ddp["ratio_to_p1t1"]
    out += [
        f"| one process, 1 thread | {u['p1t1']:.2f} | 1 |",
        f"| one process, 2 threads (`OMP_NUM_THREADS=2`) | {u['p1t2']:.2f} | {x['p1t2']:.2f}x |",
        f"| **{u['p2t1']:.2f}** | **{x['p2t1']:.2f}x** |",
    ]
    return out


def test_performance_md_tables_equal_their_json() -> None:
    text = PERF_MD.read_text()
    missing = "\n".join(claim for claim in performance_md_claims() if claim not in text)
    assert not missing, f"docs/performance.md rows not found (numbers differ from their JSON):\n{missing}"


def test_minari_sampling_table_equals_its_json() -> None:
    d = _load("bench_minari.json")
    s = d["settings"]
    claims = [f"| {r['reader']} | {r['seconds']:.4f} | {r['repeats']} | {r['ratio_to_minari']:.2f}x |" for r in d["rows"]]
    claims += [f"load average {d['machine']['loadavg_1_5_15'][0]:.1f}",
               f"rl-tformers bench minari --episodes {s['episodes']} --repeats {s['repeats']} ",
               f"{s['sample']} of {s['episodes']:,} episodes, {s['repeats']} rounds ({s['full_repeats']} full read)"]
    text = flat(PERF_MD.read_text())
    missing = "\n".join(c for c in claims if flat(c) not in text)
    assert not missing, f"docs/performance.md text not found (numbers differ from bench_minari.json):\n{missing}"
