"""The capability lists and tables of docs/*.md equal the registry: which kinds the
encoder-decoder refuses as cross-attention, the sparse, kernel and memory/depth capability
tables, and the DT's causal-mode table."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.registry import REGISTRIES, Capabilities
from tests.docs.markdown import DOCS_DIR, REPO, flat, table


def _caps(slot: str) -> dict[str, Capabilities]:
    return {e.kind: e.capabilities for e in REGISTRIES[slot]}


def _yes(cell: str) -> bool:
    """``yes``, ``yes (...)``, ``yes: (S, z)``, ``**yes**`` -> True; ``no``, ``**no**``, ``-`` -> False."""
    m = re.match(r"\**(yes|no|-)\b|\**(-)$", cell.strip())
    assert m, cell
    return (m.group(1) or m.group(2)) == "yes"


# -- capability lists --------------------------------------------------------------------------
def test_backbone_md_lists_exactly_the_kinds_the_encoder_decoder_refuses_as_cross_attention() -> None:
    """backbone.md named sinkhorn and the last-T-keys kinds; the key-index patterns and
    ``blockwise`` were added to the refusals today. The paragraph must name every kind refused,
    and the config must refuse each and accept the others."""
    from rl_tformers.backbone_config import IncompatibleConfig
    from rl_tformers.encoder_decoder import EncoderDecoderConfig

    text = flat((DOCS_DIR / "backbone.md").read_text())
    m = re.search(r"\(capability `cross_attention`\);(.*?)are refused when the config is built", text)
    assert m, "backbone.md: the cross-attention paragraph moved"
    named = set(re.findall(r"`(\w+)`", m.group(1)))
    caps = _caps("attention")
    refused = {k for k, c in caps.items() if not (c.cross_attention and c.bidirectional)}
    assert named == refused, sorted(named ^ refused)
    for kind in caps:
        if kind in refused:
            with pytest.raises(IncompatibleConfig, match="cross_attention.kind"):
                EncoderDecoderConfig.from_dict({"cross_attention": {"kind": kind}})
        else:
            EncoderDecoderConfig.from_dict({"cross_attention": {"kind": kind}})


@pytest.mark.parametrize(
    ("doc", "header", "columns"),
    [
        ("attention_sparse.md", "| kind | paper | pattern",
         {"causal": 3, "bidirectional": 4, "memory": 5, "incremental": 6}),
        ("attention_kernel.md", "| kind | paper (where) |",
         {"causal": 2, "bidirectional": 3, "memory": 4, "incremental": 5}),
    ],
)
def test_attention_capability_tables_equal_the_registry(doc: str, header: str, columns: dict[str, int]) -> None:
    caps = _caps("attention")
    rows = table((DOCS_DIR / doc).read_text(), header)
    assert len(rows) >= 6
    for row in rows:
        kind = row[0].strip("`")
        for flag, col in columns.items():
            assert _yes(row[col]) == getattr(caps[kind], flag), f"{doc}: {kind} {flag} column says {row[col]!r}"


def test_memory_adaptive_capability_table_equals_the_registry() -> None:
    rows = table((DOCS_DIR / "memory_adaptive.md").read_text(), "| kind | stateful | memory keys |")
    caps = {**_caps("memory"), **_caps("depth")}
    assert {r[0].strip("`") for r in rows} == {"xl", "compressive", "knn", "spalm", "universal", "early_exit"}
    for row in rows:
        c = caps[row[0].strip("`")]
        shown = (_yes(row[1]), _yes(row[2]), _yes(row[3]), _yes(row[4]))
        assert shown == (c.stateful, c.memory, c.incremental, c.exact_chunking), (row[0], shown)


def test_dt_mode_table_matches_the_attention_capabilities() -> None:
    r = CliRunner().invoke(app, ["backbones", "--json", "--slot", "attention"])
    causal = {e["kind"]: e["capabilities"]["causal"] for e in json.loads(r.output)}
    text = (REPO / "docs/dt.md").read_text()
    with_causal = set(re.search(r"^\| `causal` \(([^)]*)\)", text, re.M).group(1).split(", "))
    without = set(re.search(r"^\| no causal form \(([^)]*)\)", text, re.M).group(1).split(", "))
    assert with_causal == {k for k, c in causal.items() if c}
    assert without == {k for k, c in causal.items() if not c}
