"""``rl-tformers backbones [--json] [--slot]`` lists every registered component."""

from __future__ import annotations

import dataclasses
import json

import typer
from typer.testing import CliRunner

from rl_tformers.cli.backbones import register
from rl_tformers.registry import SLOTS, all_entries
from rl_tformers.runtime.run_config import available_configs


def _app() -> typer.Typer:
    app = typer.Typer()
    register(app)

    @app.callback()
    def _root() -> None:  # keep "backbones" a sub-command
        pass

    return app


def test_json_lists_every_registered_component_with_capabilities():
    res = CliRunner().invoke(_app(), ["backbones", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    want = {(e.slot, e.kind) for e in all_entries()}
    assert {(r["slot"], r["kind"]) for r in rows} == want and len(rows) == len(want)
    flags = {"causal", "bidirectional", "key_padding", "memory", "incremental", "stateful", "exact",
             "approximate", "subquadratic", "exact_chunking", "cross_attention", "positions"}
    for r in rows:
        assert r["description"] and r["paper"], r
        assert set(r["capabilities"]) == flags
    by = {(r["slot"], r["kind"]): r for r in rows}
    assert by[("attention", "sdpa")]["capabilities"]["incremental"] is True
    assert by[("block", "reversible")]["capabilities"]["memory"] is False
    assert "Parisotto" in by[("block", "gated")]["paper"]
    for kind in ("none", "sinusoidal", "learned", "shaw", "xl_relative", "rotary", "alibi", "distance_aware"):
        assert ("position", kind) in by
    # each kind's config fields with their defaults (JSON-ready: tuples as lists)
    assert by[("attention", "sdpa")]["fields"] == {}
    assert by[("attention", "sliding_window")]["fields"]["window"] == 32
    assert by[("attention", "performer")]["fields"]["orthogonal"] is True
    assert by[("attention", "longformer")]["fields"]["global_tokens"] == [0]
    for (slot, kind), r in by.items():
        entry = next(e for e in all_entries() if (e.slot, e.kind) == (slot, kind))
        assert set(r["fields"]) == {f.name for f in dataclasses.fields(entry.config_cls) if f.init}, (slot, kind)


def test_slot_filter_and_table():
    res = CliRunner().invoke(_app(), ["backbones", "--json", "--slot", "block"])
    assert res.exit_code == 0
    assert {r["kind"] for r in json.loads(res.output)} >= {"post_norm", "pre_norm", "gated", "reversible"}
    assert {r["slot"] for r in json.loads(res.output)} == {"block"}
    table = CliRunner().invoke(_app(), ["backbones"])
    assert table.exit_code == 0
    for slot in SLOTS:
        assert slot in table.output
    assert "xl_relative" in table.output and "reversible" in table.output
    assert "fields" in table.output and "mem_len=64" in table.output  # xl memory's default


def test_unknown_slot_is_refused_with_the_choices():
    res = CliRunner().invoke(_app(), ["backbones", "--slot", "bogus"])
    assert res.exit_code != 0
    assert "unknown slot 'bogus'" in res.output


def test_the_installed_cli_has_the_command():
    from rl_tformers.cli import app

    res = CliRunner().invoke(app, ["backbones", "--json", "--slot", "position"])
    assert res.exit_code == 0, res.output
    assert {r["kind"] for r in json.loads(res.output)} == {e.kind for e in all_entries() if e.slot == "position"}


def test_piped_listing_fits_80_columns_and_names_every_component():
    """Piped (no terminal, no $COLUMNS): 80 columns, one block per component, no line wider."""
    res = CliRunner().invoke(_app(), ["backbones"], env={"COLUMNS": None})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(ln) for ln in lines) <= 80, [ln for ln in lines if len(ln) > 80]
    for e in all_entries():
        assert f"{e.slot}/{e.kind}" in lines, (e.slot, e.kind)
    xl = lines.index("memory/xl")
    block = lines[xl:lines.index("", xl)]
    assert block[1].startswith("  ") and any(ln.startswith("  paper: ") for ln in block)
    assert "mem_len=64" in " ".join(block)


def test_listing_fits_the_terminal_width_it_is_given():
    """$COLUMNS (a terminal's width) 160: the table, no line wider than 160 characters."""
    res = CliRunner().invoke(_app(), ["backbones"], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(len(ln) for ln in lines) <= 160 and "┃ slot" in res.output


def test_listing_ends_with_the_per_layer_stacks_note_naming_the_example_configs():
    res = CliRunner().invoke(_app(), ["backbones", "--slot", "depth"], env={"COLUMNS": None})
    assert res.exit_code == 0, res.output
    tail = " ".join(res.output.split("\n\n")[-1].split())
    assert tail.startswith("Per-layer stacks: backbone.layers sets the attention, position and block kinds")
    named = [w.strip(",.") for w in tail.split() if w.startswith(("dt/", "gtrxl/"))]
    assert len(named) == 4 and set(named) <= set(available_configs())
    assert "Per-layer" not in CliRunner().invoke(_app(), ["backbones", "--json"]).output
