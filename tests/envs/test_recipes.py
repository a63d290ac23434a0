"""Recipes: structure (fast) and reproduction of every measured line of docs/data.md (slow)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from rl_tformers.envs.recipes import (
    LEVEL_POLICIES,
    MINATAR_DQN,
    PIXEL_STEPS,
    Shard,
    all_recipes,
    build_record,
    make_recipe,
    match_recipes,
    recipe_of_dataset,
    train_kwargs,
)
from typer.testing import CliRunner

from rl_tformers.cli import app

DOC = Path(__file__).resolve().parents[2] / "docs" / "data.md"
#: the CPU vendor of the host that measured the agent-driven rows of docs/data.md
MEASURED_ON = "GenuineIntel"


def test_recipe_catalogue():
    recipes = all_recipes()
    assert len(recipes) == 31 and len(all_recipes(version=0)) == 30  # 30 MuJoCo recipes, a pixel one in version 1
    me = make_recipe("hopper", "medium-expert")
    assert [(s.policy, s.steps, s.stochastic) for s in me.shards] == [("sac", 1_000_000, True), ("ars", 1_000_000, False)]
    assert me.dataset_id == "rlt/hopper-v5/medium-expert-v1" and me.describe() == "sac (sampled) 1M + ars 1M"
    mr = make_recipe("walker2d", "medium-replay", positions=True)
    assert mr.shards == (Shard("sac", 1_000_000, train=True, until_return=986.0),) and mr.positions
    assert mr.dataset_id == "rlt/walker2d-v5/medium-replay-positions-v1"
    assert mr.describe() == "sac training replay until return 986 (at most 1M), positions only"
    assert [r.name for r in match_recipes(["hopper-medium", "hopper-medium*"])][:2] == [
        "hopper-medium", "hopper-medium-positions"]


def test_the_pixel_recipe_is_a_dqn_training_replay_with_minatar_settings():
    r = make_recipe("minatar-breakout", "dqn-replay")
    assert r.env_id == "MinAtar/Breakout-v1" and r.dataset_id == "rlt/minatar-breakout/dqn-replay-v1"
    assert r.shards == (Shard("dqn", PIXEL_STEPS, train=True),) and PIXEL_STEPS == 250_000
    assert r.describe() == "dqn training replay with its exploration (250k)"
    kw = train_kwargs(r, r.shards[0])
    assert kw == {**MINATAR_DQN, "exploration_fraction": 0.4}  # epsilon 1 -> 0.1 over the first 100k steps
    assert train_kwargs(make_recipe("hopper", "medium-replay"), make_recipe("hopper", "medium-replay").shards[0]) == {}
    assert recipe_of_dataset("rlt/minatar-breakout/dqn-replay-v1") == r
    with pytest.raises(ValueError, match="only recipe version 1"):
        make_recipe("minatar-breakout", "dqn-replay", version=0)


def test_the_pixel_recipe_records_its_dqn_transitions_as_uint8_frames(tmp_path):
    """A 300-step build (before the DQN's first update at 5000 steps: all epsilon-greedy at
    epsilon near 1): every transition recorded, frames (4, 10, 10) uint8, the DQN settings in the metadata."""
    pytest.importorskip("minatar")
    from rl_tformers.envs.collect import build_recipe
    from rl_tformers.envs.loaders import load_dataset

    r = make_recipe("minatar-breakout", "dqn-replay", steps=300)
    build_recipe(r, root=tmp_path, progress=False)
    ds = load_dataset(r.dataset_id, root=tmp_path)
    assert ds.num_steps == 300 and ds.observations.dtype == np.uint8 and ds.observations.shape == (300, 4, 10, 10)
    assert ds.frame_stack == 1 and ds.metadata.env_id == "MinAtar/Breakout-v1"
    assert ds.metadata.extra["train_kwargs"] == {**MINATAR_DQN, "exploration_fraction": 1.0}
    assert build_record(tmp_path / r.dataset_id)["recipe"] == "minatar-breakout-dqn-replay"


def test_version_0_recipes_are_the_deterministic_100k_sets():
    me = make_recipe("hopper", "medium-expert", version=0)
    assert [(s.policy, s.steps, s.stochastic) for s in me.shards] == [("sac", 100_000, False), ("ars", 100_000, False)]
    assert me.dataset_id == "rlt/hopper-v5/medium-expert-v0"
    mr = make_recipe("walker2d", "medium-replay", positions=True, version=0)
    assert mr.steps == 100_000 and mr.shards[0].policy == "random" and mr.positions
    assert {s.policy for s in mr.shards[1:]} == {LEVEL_POLICIES["walker2d"][0]}
    assert mr.dataset_id == "rlt/walker2d-v5/medium-replay-positions-v0"
    assert recipe_of_dataset("rlt/walker2d-v5/medium-replay-positions-v0") == mr
    assert recipe_of_dataset("rlt/hopper-v5/medium-v1") == make_recipe("hopper", "medium")
    assert recipe_of_dataset("rlt/hopper-v5/medium-v7") is None
    with pytest.raises(ValueError, match="unknown recipe version 2; versions: 0, 1"):
        make_recipe("hopper", "medium", version=2)


def test_a_sampling_shard_draws_the_same_actions_on_every_build_and_differs_from_the_mode(shared_dir, tmp_path):
    """Version 1's medium shard samples SAC's actions from a stream seeded by the shard: two builds
    are identical, and the sampled episodes differ from the deterministic (version 0) ones."""
    from rl_tformers.envs.collect import build_recipe

    runs = [build_recipe(make_recipe("hopper", "medium", steps=300), root=tmp_path / str(i), progress=False,
                         policies=shared_dir / "policies") for i in range(2)]
    mode = build_recipe(make_recipe("hopper", "medium", steps=300, version=0), root=tmp_path / "v0", progress=False,
                        policies=shared_dir / "policies")
    assert runs[0].episode_returns.tolist() == runs[1].episode_returns.tolist()
    assert runs[0].episode_returns.tolist() != mode.episode_returns.tolist()
    record = build_record(runs[0].path)
    assert record["recipe_version"] == 1 and record["behaviours"][0]["stochastic"] is True


def test_a_misspelt_recipe_name_is_refused_naming_the_closest_recipe():
    with pytest.raises(ValueError) as exc:
        match_recipes(["hoper-medium"])
    assert str(exc.value).startswith("no recipe matches 'hoper-medium'; did you mean hopper-medium? recipes: hopper-random, ")
    with pytest.raises(ValueError) as exc:
        match_recipes(["pong-*"])
    assert str(exc.value).startswith("no recipe matches 'pong-*'; recipes: hopper-random, ")


def documented_rows():
    """Rows of the recipe table in docs/data.md that carry measured numbers."""
    rows = []
    for line in DOC.read_text().splitlines():
        m = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|\s*`rlt/[^`]*-v(\d+)`\s*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|"
                     r"\s*(-?[\d.]+) ± ([\d.]+)\s*\|", line)
        if m:
            rows.append((m.group(1), int(m.group(2)), int(m.group(3).replace(",", "")), int(m.group(4).replace(",", "")),
                         float(m.group(5)), float(m.group(6))))
    return rows


def test_docs_have_measured_recipe_rows():
    rows = documented_rows()
    for version in (0, 1):
        names = {r[0] for r in rows if r[1] == version}
        assert names >= {r.name for r in match_recipes(["hopper-*"], version=0)} if version == 0 else names, version


@pytest.mark.slow
@pytest.mark.parametrize("row", documented_rows(), ids=lambda r: f"{r[0]}-v{r[1]}")
def test_every_documented_recipe_line_is_reproduced_by_its_command(row, shared_dir, tmp_path):
    """One measured line of docs/data.md (select one with ``-k hopper-medium-replay``).

    Rows of recipes that run a pretrained SB3 agent reproduce only on the kind of CPU that
    measured them (docs/data.md, "Which host": the agent's float32 products round differently
    elsewhere); random-action rows reproduce on any CPU."""
    name, version, episodes, steps, mean, std = row
    from rl_tformers.runtime.host import cpu_vendor

    uses_agent = any(shard.policy != "random" for shard in all_recipes(version=version)[name].shards)
    if uses_agent and cpu_vendor() != MEASURED_ON:
        pytest.skip(f"{name}: measured on a {MEASURED_ON} CPU; an SB3 agent's rollout rounds differently on "
                    f"{cpu_vendor() or 'this CPU'} (docs/data.md, 'Which host')")
    r = CliRunner().invoke(app, ["collect", "--recipe", name, "--recipe-version", str(version), "--root", str(tmp_path),
                                 "--json", "--no-progress",
                                 "--policies", str(shared_dir / "policies")])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert (got["episodes"], got["steps"]) == (episodes, steps), name
    assert f"{got['return_mean']:.1f} ± {got['return_std']:.1f}" == f"{mean:.1f} ± {std:.1f}", name


runner = CliRunner()


# ------------------------------------------------------------------- collect --skip-existing
def test_skip_existing_does_not_silently_keep_a_recipe_built_with_another_size(tmp_path: Path) -> None:
    """The README's path: `collect --recipe hopper-medium --recipe-steps 5000` (a small set to
    try things), later `collect --recipe 'hopper-*'`, which stops and suggests --skip-existing.
    --skip-existing does not keep the 5k-step set under the full recipe's id with a bare
    "exists ..., skipped": the dataset's metadata records the size it was built with."""
    args = ["collect", "--recipe", "hopper-random", "--root", str(tmp_path), "--no-progress"]
    r = runner.invoke(app, [*args, "--recipe-steps", "6"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*args, "--skip-existing"])  # the recipe's own 1M steps
    line = next((ln for ln in r.output.splitlines() if "random-v1" in ln), r.output)
    assert any(s in line for s in ("--recipe-steps", "--overwrite", "1M", "1000000")), r.output
