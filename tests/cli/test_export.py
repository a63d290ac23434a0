"""``rl-tformers export``: a run to a policy folder, both formats into one folder; a kind that cannot
be exported is refused in one line naming the kind and the format."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_cartpole_h5
from tests.runs import TINY_DT_OVERRIDES

runner = CliRunner()


def test_export_writes_both_graphs_into_one_policy_folder(tiny_dt_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "policy"
    for fmt in ("torchscript", "onnx"):
        r = runner.invoke(app, ["export", str(tiny_dt_run), "--format", fmt, "--out", str(out)])
        assert r.exit_code == 0, r.output
    spec = json.loads((out / "policy.json").read_text())
    assert spec["graphs"] == {"onnx": "policy.onnx", "torchscript": "policy.pt"}
    assert (spec["agent"], spec["family"], spec["acting"]["context_len"]) == ("dt", "dt", 5)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "policy.json", "policy.onnx", "policy.pt"]


def test_export_refuses_a_kind_that_cannot_be_exported_naming_kind_and_format(tmp_path: Path) -> None:
    h5 = write_cartpole_h5(tmp_path / "cp.hdf5")
    train(compose("dt/cartpole_demo", [f"dataset.path={h5}", *TINY_DT_OVERRIDES, "backbone.depth.kind=early_exit"]),
          tmp_path / "run")
    r = runner.invoke(app, ["export", str(tmp_path / "run"), "--format", "onnx", "--out", str(tmp_path / "policy")])
    assert r.exit_code == 2
    assert r.stderr == ("error: backbone.depth.kind=early_exit cannot be exported to onnx: its layer loop stops once "
                        "the deciding tokens are confident (data-dependent), which a traced graph cannot follow\n")
    assert not (tmp_path / "policy").exists()


def test_export_refuses_an_out_that_is_a_file(tiny_dt_run: Path, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    r = runner.invoke(app, ["export", str(tiny_dt_run), "--format", "torchscript", "--out", str(tmp_path / "f")])
    assert r.exit_code == 2 and r.stderr == f"error: --out {tmp_path / 'f'}: is a file, not a folder\n"
