"""``rl-tformers bench eval``: batched vs one-env-at-a-time on the same episodes, and the per-step
cost of XL / GTrXL memory vs re-encoding the window."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rl_tformers.bench import eval as be
from rl_tformers.cli import app
from tests.datafiles import write_d4rl_h5
from tests.runs import tripwire


def test_batched_and_sequential_play_the_same_episodes(tiny_hdf5):
    s = be.Settings(dataset=str(tiny_hdf5), episodes=3, n_envs=3, max_episode_steps=12, memory_kinds=(),
                    train_updates=0)
    res = be.run(s)
    batched, seq = res.rollouts
    assert (batched["mode"], batched["n_envs"], seq["mode"], seq["n_envs"]) == ("batched", 3, "sequential", 1)
    assert batched["lengths"] == seq["lengths"] and max(seq["lengths"]) <= 12  # same seeds, same episodes
    assert batched["return_mean"] == pytest.approx(seq["return_mean"], rel=1e-6)
    assert res.rollout_ratio == pytest.approx(batched["env_steps_per_s"] / seq["env_steps_per_s"])
    assert batched["loop_steps"] == max(batched["lengths"]) and seq["loop_steps"] == sum(seq["lengths"])
    assert "untrained DT" in res.notes[0]
    assert "batched / sequential" in be.markdown(res)


def test_the_default_policy_is_trained_inside_the_benchmark_and_profiled(tiny_hdf5, tmp_path):
    """--train-updates trains the small DT first; --profile splits every evaluation into parts that
    add up to its wall time, and profiles DT, BC and GTrXL on Hopper and CartPole; three N fit the growth."""
    plot = tmp_path / "growth.png"
    s = be.Settings(dataset=str(tiny_hdf5), episodes=4, n_envs=(2, 4), max_episode_steps=6, memory_kinds=(),
                    train_updates=2, profile=True, plot=str(plot))
    res = be.run(s)
    assert "trained 2 updates" in res.notes[0]
    assert [(r["mode"], r["n_envs"]) for r in res.rollouts] == [("batched", 2), ("batched", 4), ("sequential", 1)]
    for r in res.rollouts + res.profile:
        sp = r["split"]
        parts = sum(sp[f"{k}_s"] for k in ("forward", "context", "env", "decode", "bookkeeping"))
        assert parts == pytest.approx(sp["total_s"]) and sp["forward_s"] > 0 and sp["env_s"] > 0
    assert [(r["agent"], r["env"]) for r in res.profile] == [
        (a, e) for e in ("Hopper-v5", "CartPole-v1") for a in ("dt", "bc", "gtrxl")]
    assert res.growth["n"] == [1, 2, 4] and plot.stat().st_size > 0
    text = be.markdown(res)
    assert "| gtrxl | CartPole-v1 |" in text and "policy share" in text and "load average at start" in text


def test_the_default_dt_computes_with_the_gemm_library_a_run_would(tiny_hdf5):
    """The small DT's linear layers run in the library cpu_matmul: auto picks on this host (as a
    trained run's do when evaluated), and its description names it."""
    from torch import nn

    from rl_tformers.bench._eval_policies import train_small_dt
    from rl_tformers.runtime.cpu_matmul import OneDNNLinear, resolve_cpu_matmul

    bp = train_small_dt(str(tiny_hdf5), 0, 0, "cpu")
    lib = resolve_cpu_matmul("auto")
    assert bp.what.endswith(f"; cpu_matmul {lib})")
    linears = [m for m in bp.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, OneDNNLinear) == (lib == "onednn") for m in linears)


def test_an_evaluation_that_plays_other_episodes_with_n_envs_fails_with_exit_1(tiny_hdf5, monkeypatch):
    """The benchmark asserts that every N plays the episodes of one at a time: a policy whose
    action depends on the batch size makes it stop with one error line, exit 1."""
    from rl_tformers.bench import _eval_policies

    real = _eval_policies.train_small_dt

    def batch_dependent(*args, **kwargs):
        bp = real(*args, **kwargs)
        inner = bp.policy.act

        def act(obs, state, start, reward=None):
            a, state = inner(obs, state, start, reward)
            return a * (0.5 if len(start) > 1 else 1.0), state

        bp.policy.act = act
        return bp

    monkeypatch.setattr(be, "train_small_dt", batch_dependent)
    r = runner.invoke(app, ["bench", "eval", "--dataset", str(tiny_hdf5), "--train-updates", "0", "--episodes", "2",
                            "--n-envs", "2", "--max-episode-steps", "30", "--memory-kinds", ""])
    assert r.exit_code == 1, r.output
    assert r.stderr.splitlines()[-1].startswith(
        "error: bench eval: 2 environments played other episodes than one at a time (lengths [30, 30] vs [30, 30], "
        "largest relative return difference")


def test_memory_vs_reencoding_rows():
    s = be.Settings(skip_rollouts=True, memory_kinds=("xl", "gtrxl"), mem_lens=(4, 8), mem_envs=2, mem_steps=2,
                    d_model=16, n_layers=1, n_heads=2)
    res = be.run(s)
    assert [(r["kind"], r["mem_len"]) for r in res.memory] == [("xl", 4), ("xl", 8), ("gtrxl", 4), ("gtrxl", 8)]
    for r in res.memory:
        assert r["memory_ms_per_step"] > 0 and r["reencode_over_memory"] == pytest.approx(
            r["reencode_ms_per_step"] / r["memory_ms_per_step"])
    assert be.memory_backbone("xl", 4, s).blocks[0].__class__ is not be.memory_backbone("gtrxl", 4, s).blocks[0].__class__
    with pytest.raises(ValueError, match="xl or gtrxl"):
        be.memory_backbone("lstm", 4, s)


def test_cli_json(tmp_path):
    import json

    from rl_tformers.cli import app

    out = tmp_path / "e.json"
    r = CliRunner().invoke(app, ["bench", "eval", "--skip-rollouts", "--memory-kinds", "xl", "--mem-lens", "4",
                                 "--mem-envs", "2", "--mem-steps", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads(out.read_text())["memory"][0]["mem_len"] == 4


runner = CliRunner()


@pytest.mark.parametrize("args, message", [
    (["--mem-envs", "0"], "--mem-envs"), (["--mem-envs", "-1"], "--mem-envs"),
    (["--mem-steps", "0"], "--mem-steps"), (["--mem-steps", "-3"], "--mem-steps"),
    (["--threads", "0"], "--threads"), (["--threads", "-1"], "--threads"),
    (["--max-episode-steps", "-1"], "--max-episode-steps"), (["--max-episode-steps", "0"], "--max-episode-steps"),
    (["--mem-lens", "0"], "error: --mem-lens: every memory length must be >= 1, got 0"),
    (["--mem-lens", "4,abc"], "error: --mem-lens: 'abc' is not an integer"),
    (["--mem-lens", ","], "error: --mem-lens: give at least one memory length"),
    (["--n-envs", "10,x"], "error: --n-envs: 'x' is not an integer"),
    (["--n-envs", "0"], "--n-envs must be >= 1"), (["--n-envs", "10,10"], "error: --n-envs: 10 is given twice"),
    (["--train-updates", "-1"], "--train-updates must be >= 0"),
    (["--vector", "threads"], "error: --vector: unknown kind 'threads'; use sync or async"),
    (["--memory-kinds", "xl,bogus"], "error: --memory-kinds: unknown kind 'bogus'; use a comma-separated subset "
                                     "of xl,gtrxl"),
])
def test_bench_eval_options_are_checked_before_any_work(monkeypatch, args: list[str], message: str) -> None:
    from rl_tformers.bench import eval as be

    monkeypatch.setattr(be, "run", tripwire)
    r = runner.invoke(app, ["bench", "eval", "--skip-rollouts", *args])
    assert r.exit_code == 2 and message in r.output, r.output


def test_bench_eval_refuses_more_environments_than_episodes(monkeypatch) -> None:
    from rl_tformers.bench import eval as be

    monkeypatch.setattr(be, "run", tripwire)
    r = runner.invoke(app, ["bench", "eval", "--episodes", "5", "--n-envs", "2,10", "--memory-kinds", ""])
    assert r.exit_code == 2, r.output
    assert [ln for ln in r.output.splitlines() if ln.startswith("error: ")] == [
        "error: --n-envs 10 is more than --episodes 5: every environment plays whole episodes, so at most 5 would "
        "run; use --n-envs <= 5 or more --episodes"]


def test_bench_eval_profile_keeps_the_episode_cap(monkeypatch) -> None:
    """``--profile --max-episode-steps 7``: every profiled evaluation caps its episodes at 7 steps."""
    from rl_tformers.bench import eval as be

    seen = []
    monkeypatch.setattr(be, "untrained", lambda kind, env_id, seed, device: type("P", (), {"what": kind})())
    monkeypatch.setattr(be, "rollout", lambda bp, n, episodes, seed, **kw: seen.append(kw) or {
        "split": dict.fromkeys(("forward_frac", "context_frac", "env_frac", "decode_frac", "bookkeeping_frac"), 0.2)})
    be.profile_cases(be.Settings(episodes=4, n_envs=(2,), max_episode_steps=7), lambda m: None)
    assert seen and all(kw == {"max_episode_steps": 7, "profile": True} for kw in seen)


def test_bench_eval_settings_are_checked_in_python_too(monkeypatch) -> None:
    from rl_tformers.bench import eval as be

    monkeypatch.setattr(be, "load_agent", tripwire)
    monkeypatch.setattr(be, "memory_step_cost", tripwire)
    with pytest.raises(ValueError, match=r"^--max-episode-steps must be >= 1, got 0 \(leave the option out"):
        be.run(be.Settings(max_episode_steps=0))
    with pytest.raises(ValueError, match=r"^--mem-steps must be >= 1, got 0$"):
        be.run(be.Settings(mem_steps=0))


# -- `bench eval --mem-lens 1000000000` died in the allocator with a traceback ---------------------
def test_bench_eval_refuses_a_memory_length_that_cannot_fit(monkeypatch):
    from rl_tformers.bench import eval as be

    def tripwire(*args, **kwargs):
        raise AssertionError("part 2 ran")

    monkeypatch.setattr(be, "memory_step_cost", tripwire)
    monkeypatch.setattr(be, "device_memory_bytes", lambda device: 16 * 2**30, raising=False)
    r = runner.invoke(app, ["bench", "eval", "--skip-rollouts", "--memory-kinds", "xl", "--mem-lens", "32,1000000000"])
    assert r.exit_code == 2, r.output
    assert r.stderr == (
        "error: --mem-lens: M = 1000000000 needs about 1.49e+12 GiB in part 2 (re-encoding M + 1 tokens forms about "
        "10 float32 score tensors of --mem-envs 10 x 4 heads x (M + 1)^2), more than the 16.00 GiB of this machine; "
        "the largest M that fits is 3274 (keep M to the memory length an agent would use, e.g. up to its episode "
        "length)\n")
    assert "Traceback" not in r.output
    # the limit is the estimate's: 3274 fits in 16 GiB, 3275 does not; the defaults (up to 512) need 0.33 GiB
    s = be.Settings(memory_kinds=("xl",), mem_lens=(3274,), skip_rollouts=True)
    assert be.part2_bytes(3274, s) <= 16 * 2**30 < be.part2_bytes(3275, s)
    s.check_memory(16 * 2**30)
    assert be.part2_bytes(512, be.Settings()) == 4 * 10 * (10 * 4 * 513**2 + (512 + 50 + 1) * 128)
    r = runner.invoke(app, ["bench", "eval", "--skip-rollouts", "--mem-lens", "4", "--mem-steps", str(10**12)])
    assert r.exit_code == 2 and r.stderr == (
        "error: --mem-steps 1000000000000: part 2 keeps all M + 1000000000000 input tokens of --mem-envs 10 "
        "environments in memory, more than the 16.00 GiB of this machine; lower --mem-steps\n")


def test_bench_eval_of_a_run_whose_agent_cannot_be_evaluated_exits_2_in_one_line(tmp_path) -> None:
    run = tmp_path / "toy"
    r = runner.invoke(app, ["train", "-c", "toy", "--device", "cpu", "train.steps=2", "train.progress=false",
                            "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["bench", "eval", "--run", str(run), "--memory-kinds", ""])
    assert r.exit_code == 2, r.output
    assert r.stderr == (f"error: --run {run}: agent 'toy' cannot be evaluated: it lacks policy(), make_env(), "
                        f"default_targets()\n")
    assert "Traceback" not in r.output


def test_bench_eval_of_a_dt_run_shorter_than_the_env_s_episodes_exits_2_in_one_line(tmp_path) -> None:
    data = write_d4rl_h5(tmp_path / "cartpole.hdf5")  # 10-step episodes
    run = tmp_path / "dt"
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={data}", "backbone.d_model=16",
                            "backbone.n_heads=1", "backbone.n_layers=1", "agent.context_len=4", "agent.max_ep_len=16",
                            "agent.targets=[6]", "agent.eval_figure=false", "train.steps=1", "train.batch_size=4",
                            "train.warmup_steps=1", "train.progress=false", "eval.every=0", "eval.at_end=false",
                            "--device", "cpu", "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["bench", "eval", "--run", str(run), "--episodes", "2", "--n-envs", "2",
                            "--memory-kinds", ""])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[-1].startswith(
        f"error: --run {run}: Decision Transformer: episode step 16 >= agent.max_ep_len=16 ")
    assert "Traceback" not in r.output and r.stdout == ""


def test_bench_eval_refuses_a_plot_path_under_a_file_before_any_work(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(be, "run", lambda *a, **k: pytest.fail("ran despite a bad --plot"))
    (tmp_path / "afile").write_text("")
    plot = tmp_path / "afile" / "growth.png"
    r = runner.invoke(app, ["bench", "eval", "--skip-rollouts", "--plot", str(plot)])
    assert r.exit_code == 2, r.output
    assert r.stderr == f"error: --plot {plot}: {tmp_path / 'afile'} is a file, not a directory\n"


def test_the_evaluation_tables_of_docs_performance_are_its_json() -> None:
    """The throughput and profile rows of docs/performance.md's evaluation section are the measured JSON's."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    data = json.loads((root / "docs" / "performance" / "bench_eval_throughput.json").read_text())
    text = (root / "docs" / "performance.md").read_text()
    section = text[text.index("### Evaluation throughput"):text.index("**Memory backbones, per-step cost**")]
    rows = [be.rollout_line(r) for r in data["rollouts"]] + [be.profile_line(r) for r in data["profile"]]
    assert [line for line in section.splitlines()
            if line.startswith(("| batched", "| sequential", "| dt |", "| bc |", "| gtrxl |"))] == rows
    for key in ("loadavg_start", "loadavg_end"):
        assert " ".join(f"{v:.2f}" for v in data["machine"][key]) in section
    g = data["growth"]
    assert f"{g['a_ms']:.2f} + {g['b_ms_per_env']:.3f} N" in section
