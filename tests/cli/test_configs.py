"""``rl-tformers configs`` (rl_tformers.cli.configs): the shipped configs, one line each, read from the files."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import available_configs, config_header, config_summary

runner = CliRunner()


def test_every_shipped_config_is_one_line_with_agent_data_and_description() -> None:
    r = runner.invoke(app, ["configs"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines] == available_configs()
    assert all(len(line.split(maxsplit=3)) == 4 for line in lines)  # name, agent, data, description
    rows = json.loads(runner.invoke(app, ["configs", "--json"]).stdout)
    assert [row["name"] for row in rows] == available_configs()
    assert [row for row in rows if not row["description"]] == []  # every file has a header comment


def test_a_config_line_reads_its_base_files_and_its_own_header() -> None:
    r = runner.invoke(app, ["configs", "dt/hopper_medium"])
    assert r.stdout == ("dt/hopper_medium  dt  rlt/hopper-v5/medium-v1  Decision Transformer on the data layer's "
                        "Hopper-v5 medium recipe (rl-tformers collect --recipe hopper-medium): the paper's settings "
                        "(Chen et al. 2021, table 8).\n")
    ppo = config_summary("gtrxl/ppo_cartpole")
    assert (ppo.agent, ppo.data) == ("gtrxl_ppo", "online rl_tformers/PositionOnlyCartPole-v1")
    assert config_summary("memory/recall32_xl").data == "data/memory/recall-d32.hdf5"


def test_the_description_is_the_first_sentence_of_the_header(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text("# The base.\nagent: {kind: toy}\n")
    child = tmp_path / "child.yaml"
    child.write_text("# Toy run after Chen et al. 2021, e.g. table 8, and\n# more (one sentence). Second sentence.\n"
                     "#   rl-tformers train -c child\n_base_: base.yaml\ndataset:\n  scripted: {task: recall}\n")
    assert config_header(child) == ("Toy run after Chen et al. 2021, e.g. table 8, and more (one sentence). Second "
                                    "sentence.")
    s = config_summary(str(child))
    assert (s.agent, s.data, s.description) == ("toy", "scripted recall",
                                                "Toy run after Chen et al. 2021, e.g. table 8, and more (one sentence).")


def test_a_pattern_that_matches_nothing_is_one_error_line_with_the_closest_names() -> None:
    r = runner.invoke(app, ["configs", "dt/hoper_medium"])
    assert (r.exit_code, r.stderr) == (2, "error: no shipped config matches 'dt/hoper_medium'; did you mean "
                                          "dt/hopper_medium, dt/hopper_medium_odt, bc/hopper_medium?\n")
    r = runner.invoke(app, ["configs", "nope/*"])
    assert (r.exit_code, r.stderr) == (2, "error: no shipped config matches 'nope/*'; the groups are bc/*, dt/*, "
                                          "gtrxl/*, memory/*\n")
    r = runner.invoke(app, ["configs", "memory/*"])
    assert [line.split()[0] for line in r.stdout.splitlines()] == [
        n for n in available_configs() if n.startswith("memory/")]
