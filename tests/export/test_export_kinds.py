"""Which backbone kinds export to which formats: every registered kind (a small model, untrained)
is exported to TorchScript and ONNX; a kind that cannot be is refused with one message naming the
kind and the format, and the table of docs/deployment.md is what export does.

``RL_TFORMERS_WRITE_EXPORT_TABLE=1`` writes the table found into docs/deployment.md."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.decision_transformer.policy import DTPolicy
from rl_tformers.agents.export.exporters import FORMATS, REFUSED, ExportRefused, export_model
from rl_tformers.agents.export.folder import acting_spec
from rl_tformers.agents.gtrxl.agent import GTrXLPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel

from rl_tformers.registry import REGISTRIES, SLOTS
from tests.contracts.contract_variants import make_variant

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
START, END = "<!-- export table: start -->", "<!-- export table: end -->"
ALL = [(s, e.kind) for s in SLOTS for e in REGISTRIES[s]]


def _model(slot: str, kind: str):
    """``(family, model, model_cfg, acting)`` of a small model with ``slot: kind``: a DT (K = 4, 12
    tokens; ``last_action`` mode for kinds without a causal form), a GTrXL for memory kinds
    (``none``: a plain window of 4 steps)."""
    v = make_variant(slot, kind, 12)
    cfg = dict(v.config)
    if slot == "memory":
        model = GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=cfg, window=4 if kind == "none" else 0))
        policy = GTrXLPolicy(model, obs_mean=np.zeros(3), obs_std=np.ones(3), action_low=-np.ones(2),
                             action_high=np.ones(2))
    else:
        cfg["causal"] = v.causal_ok
        model = DecisionTransformer(DTConfig(obs_dim=3, act_dim=2, context_len=4, max_ep_len=50, embed_dropout=0.0,
                                             mode="causal" if v.causal_ok else "last_action", backbone=cfg))
        policy = DTPolicy(model, np.zeros(3), np.ones(3), 1.0, -np.ones(2), 2 * np.ones(2), default_target=1.0)
    return acting_spec(policy, None)


def outcome(slot: str, kind: str, fmt: str, out: Path, known_refusals: bool = True) -> str | None:
    """None when ``slot: kind`` exports to ``fmt``, else the refusal's message."""
    family, model, model_cfg, acting = _model(slot, kind)
    try:
        export_model(family, model, model_cfg, acting, fmt, out, known_refusals=known_refusals)
    except ExportRefused as exc:
        return str(exc)
    return None


def _table(rows: dict[tuple[str, str], dict[str, str | None]]) -> str:
    lines = ["| slot | kind | torchscript | onnx |", "|---|---|---|---|"]
    for (slot, kind), res in rows.items():
        cells = ["yes" if res[f] is None else "no: " + res[f].split(f"exported to {f}: ", 1)[1] for f in FORMATS]
        lines.append(f"| {slot} | `{kind}` | {' | '.join(cells)} |")
    return "\n".join(lines)


def _doc_rows() -> dict[tuple[str, str], str]:
    text = DOC.read_text()
    body = text[text.index(START) + len(START):text.index(END)]
    return {(m.group(1), m.group(2)): m.group(0) for m in re.finditer(r"^\| (\w+) \| `(\w+)` \|.*$", body, re.M)}


def _check(kinds: list[tuple[str, str]], tmp_path: Path) -> None:
    rows = {}
    for slot, kind in kinds:
        rows[(slot, kind)] = {}
        for fmt in FORMATS:
            msg = outcome(slot, kind, fmt, tmp_path / f"{slot}-{kind}")
            if msg is not None:  # one line naming the kind and the format
                assert "\n" not in msg and f"backbone.{slot}.kind={kind}" in msg and f"to {fmt}:" in msg, msg
            rows[(slot, kind)][fmt] = msg
    found = _table(rows)
    if os.environ.get("RL_TFORMERS_WRITE_EXPORT_TABLE"):
        text = DOC.read_text()
        DOC.write_text(text[:text.index(START) + len(START)] + "\n" + found + "\n" + text[text.index(END):])
    doc = _doc_rows()
    want = {k: line for k, line in zip(rows, found.splitlines()[2:])}
    assert {k: doc.get(k) for k in want} == want, "docs/deployment.md's export table differs from export:\n" + found
    assert set(doc) == set(want), "docs/deployment.md lists kinds that are not registered"


def test_every_registered_kind_exports_as_docs_deployment_says(tmp_path: Path) -> None:
    """Every kind of every slot, both formats (about 25 s on one busy core)."""
    _check(ALL, tmp_path)


def test_a_refused_kind_is_named_with_the_format_before_anything_is_written(tmp_path: Path) -> None:
    msg = outcome("attention", "lsh", "onnx", tmp_path / "out")
    assert msg == ("backbone.attention.kind=lsh cannot be exported to onnx: its bucket sort uses aten::cummax, "
                   "which has no ONNX operator at opset 17")
    assert not (tmp_path / "out").exists()
    assert outcome("attention", "lsh", "torchscript", tmp_path / "ts") is None


@pytest.mark.parametrize("slot, kind, fmt", [("attention", "lsh", "onnx"), ("attention", "bigbird", "torchscript"),
                                             ("memory", "compressive", "torchscript")])
def test_a_known_refusal_still_fails_when_tried(tmp_path: Path, slot: str, kind: str, fmt: str) -> None:
    """REFUSED is not stale: tried anyway, the export fails its verification or its exporter."""
    assert fmt in REFUSED[(slot, kind)]
    msg = outcome(slot, kind, fmt, tmp_path / "out", known_refusals=False)
    assert msg is not None and f"backbone.{slot}.kind={kind}" in msg
    assert not (tmp_path / "out" / ("policy.pt" if fmt == "torchscript" else "policy.onnx")).exists()
