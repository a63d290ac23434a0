"""``rl-tformers bench act``: act() latency of the in-package policy, TorchScript and onnxruntime."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from rl_tformers.bench.act import row_line
from rl_tformers.cli import app
from rl_tformers.runtime.host import host_caption

runner = CliRunner()


def test_bench_act_times_the_three_paths_and_the_bare_forward_at_each_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "act.json"
    r = runner.invoke(app, ["bench", "act", "--batches", "1,3", "--steps", "2", "--warmup", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert [(row["policy"], row["batch"], row["path"]) for row in data["rows"]] == [
        (k, n, p) for k in ("dt", "gtrxl") for n in (1, 3) for p in ("in-package", "torchscript", "onnx")]
    assert all(row["ratio"] == row["ms_per_step"] / data["rows"][3 * (i // 3)]["ms_per_step"]
               for i, row in enumerate(data["rows"]))
    for row in data["rows"]:  # the bare forward is timed beside the in-package act()
        if row["path"] == "in-package":
            assert row["forward_ms"] > 0 and row["act_over_forward"] == row["ms_per_step"] / row["forward_ms"]
        else:
            assert "forward_ms" not in row
    assert "| gtrxl | 3 | onnx |" in r.stdout and data["settings"]["threads"] == 1


def test_the_bare_forward_of_gtrxl_is_the_forward_that_act_runs() -> None:
    """The bare forward's action equals the in-package policy's (same tokens, same memory)."""
    import numpy as np
    import torch
    from rl_tformers.agents.decision_transformer.model import to_env_action

    from rl_tformers.bench.act import bare_forward, untrained_gtrxl

    policy, _ = untrained_gtrxl()
    obs = np.random.default_rng(0).normal(size=(3, 2, 11)).astype(np.float32)
    state = policy.initial_state(2)
    for t in range(3):
        start = np.full(2, t == 0)
        before = state
        a, state = policy.act(obs[t], before, start, np.zeros(2))
        with torch.no_grad():
            out = bare_forward(policy, before, obs[t], start, np.zeros(2), state)()
        assert np.array_equal(to_env_action(out.clamp(-1, 1), policy.low, policy.high).numpy(), a)


def test_bench_act_of_a_run_names_the_run_s_own_observation_and_action_sizes(tmp_path: Path) -> None:
    """A PPO run on position-only CartPole (2 observations, 2 discrete actions): the caption says
    so, not the sizes of the untrained policies (Hopper's 11 and 3)."""
    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    run = tmp_path / "ppo"
    train(compose(overrides=[
        "agent.kind=gtrxl_ppo", "agent.n_envs=2", "agent.n_steps=4", "agent.n_epochs=1", "agent.n_minibatches=1",
        "train.steps=1", "train.progress=false", "eval.at_end=false", "eval.every=0", "device=cpu",
        "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]), run)
    r = runner.invoke(app, ["bench", "act", "--run", str(run), "--batches", "1", "--steps", "1", "--warmup", "1",
                            "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["policy"] == f"the run {run} (2 observations, 2 discrete actions)"


def test_bench_act_refuses_a_repeated_batch_size_before_measuring() -> None:
    r = runner.invoke(app, ["bench", "act", "--batches", "32,32"])
    assert r.exit_code == 2 and r.stderr == "error: --batches: 32 is given twice\n"
    r = runner.invoke(app, ["bench", "act", "--policies", "dt,bc"])
    assert r.exit_code == 2 and r.stderr == "error: --policies: 'bc' is not a policy; use a comma-separated subset of dt,gtrxl\n"


def test_the_act_latency_table_of_docs_performance_is_its_json() -> None:
    """Every row of the ``act()`` latency table in docs/performance.md is the measured JSON's."""
    root = Path(__file__).resolve().parents[2]
    data = json.loads((root / "docs" / "performance" / "bench_act.json").read_text())
    text = (root / "docs" / "performance.md").read_text()
    section = text[text.index("### act() latency of exported policies"):text.index("### Attention scaling")]
    rows = [row_line(r) for r in data["rows"]]
    assert [line for line in section.splitlines() if line.startswith("| ") and "x |" in line] == rows
    load = " ".join(map(str, data["machine"]["loadavg_1_5_15"]))
    end = " ".join(map(str, data["machine"]["loadavg_end"]))
    assert (f"*{host_caption(data['machine'])}, {data['settings']['threads']} thread(s), {data['machine']['date']}, "
            f"load average {load} at the start, "
            f"{end} at the end") in section
    assert f"--steps {data['settings']['steps']}" in section
