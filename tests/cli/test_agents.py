"""``rl-tformers agents [KIND]`` (rl_tformers.cli.agents): every kind's agent.* options."""

from __future__ import annotations

from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()


def test_a_kind_without_a_typed_config_lists_the_keys_of_its_registered_defaults() -> None:
    r = runner.invoke(app, ["agents", "toy"])
    assert r.exit_code == 0, r.output
    note = "(registered default; no type or range declared)"
    assert r.stdout.splitlines() == [
        "toy: tiny causal sequence regression (tests, demo fallback)",
        f"  agent.in_dim = 3           {note}",
        f"  agent.out_dim = 2          {note}",
        f"  agent.seq_len = 8          {note}",
        f"  agent.noise = 0.01         {note}",
        f"  agent.eval_size = 64       {note}",
        f"  agent.eval_figure = false  {note}",
    ]


def test_the_offline_agents_default_env_kwargs_alike() -> None:
    """``agent.env_kwargs`` of every offline agent is null (the dataset's), listed and composed the same."""
    from rl_tformers.runtime.run_config import compose

    for kind in ("dt", "bc", "gtrxl"):
        line = next(ln for ln in runner.invoke(app, ["agents", kind]).stdout.splitlines() if "agent.env_kwargs" in ln)
        assert line.split()[:3] == ["agent.env_kwargs", "=", "null"], line
    assert compose("gtrxl/recall_bc", []).agent.env_kwargs is None
