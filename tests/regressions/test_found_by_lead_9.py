"""Defects found by the lead in session 9:

1. ``backbone.max_position`` (learned positions) or the DT's ``agent.max_ep_len`` far beyond
   any data (1e12) died in the CPU allocator with a bare ``RuntimeError`` (a traceback from
   ``rl-tformers train``) instead of an error naming the option;
2. an offline GTrXL with learned positions whose table covers the dataset's episodes but not the
   evaluation environment's time limit trained to the end and then stopped in the middle of
   its first evaluation; it now warns before training (as the DT does for ``max_ep_len``);
3. a resume from another folder of a run on a relative ``dataset.path`` said only "no such HDF5
   file"; it now names the relative path, the folder it was read from and the override to use.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.gtrxl.agent import GTRXL_DEFAULTS, GTrXLAgent
from rl_tformers.agents.gtrxl.model import gtrxl_backbone

from rl_tformers.backbone import Backbone
from rl_tformers.backbone_config import BackboneConfig

HUGE = 10**12


def test_huge_max_position_names_the_option() -> None:
    cfg = BackboneConfig.from_dict({"d_model": 16, "n_layers": 1, "n_heads": 2, "max_position": HUGE,
                                    "position": {"kind": "learned"}})
    with pytest.raises(ValueError, match=r"\(1000000000000, 16\) float32 table sized by backbone\.max_position"):
        Backbone(cfg)


def test_huge_max_ep_len_names_the_option() -> None:
    cfg = DTConfig(obs_dim=3, act_dim=2, context_len=4, max_ep_len=HUGE, backbone={"d_model": 16, "n_layers": 1})
    with pytest.raises(ValueError, match=r"sized by agent\.max_ep_len .* lower agent\.max_ep_len"):
        DecisionTransformer(cfg)


def test_huge_max_position_is_a_clean_train_error(tmp_path: Path, cartpole_h5) -> None:
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    h5 = cartpole_h5(tmp_path / "cp.hdf5")
    res = CliRunner().invoke(app, [
        "train", "-c", "dt/hopper_medium", f"dataset.path={h5}", "backbone.position.kind=learned",
        f"backbone.max_position={HUGE}", "train.steps=1", "--run-dir", str(tmp_path / "run")])
    assert res.exit_code == 2, res.output
    assert "error: the (1000000000000, 128) float32 table sized by backbone.max_position" in res.output
    assert not (tmp_path / "run").exists()


def _gtrxl_cfg(h5: Path, max_position: int):
    bb = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4)
    bb["position"] = {"kind": "learned"}
    bb["max_position"] = max_position
    return OmegaConf.create({
        "seed": 0, "agent": {**GTRXL_DEFAULTS["agent"], "seq_len": 4, "burn_in": 0}, "backbone": bb,
        "dataset": {"path": str(h5)}, "train": {"batch_size": 2, "steps": 1}, "eval": {"episodes": 1, "n_envs": 1},
    })


@pytest.mark.parametrize("max_position, warns", [(20, True), (500, False)])
def test_gtrxl_learned_positions_shorter_than_the_time_limit_warn(tmp_path: Path, cartpole_h5, caplog,
                                                                   max_position: int, warns: bool) -> None:
    """The fixture's episodes have 10 steps; CartPole-v1's time limit is 500 (positions 0..499)."""
    h5 = cartpole_h5(tmp_path / "cp.hdf5")
    with caplog.at_level(logging.WARNING, logger="rl_tformers.agents.gtrxl.agent"):
        GTrXLAgent(_gtrxl_cfg(h5, max_position), None, "cpu")
    msgs = [r.getMessage() for r in caplog.records if "backbone.max_position" in r.getMessage()]
    if warns:
        assert msgs == [
            "the evaluation environment CartPole-v1 runs episodes of up to 500 steps but backbone.max_position=20 "
            "(GTrXL's positions are episode steps, backbone.position.kind=learned): an evaluation episode that "
            "reaches step 20 will stop the evaluation; set backbone.max_position >= 500 or use a relative "
            "position kind (xl_relative)"]
    else:
        assert msgs == []


def test_resume_from_another_folder_names_the_relative_dataset_path(tmp_path: Path, cartpole_h5,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A run started on a relative dataset.path and resumed from another folder failed with only
    "no such HDF5 file: cp.hdf5"; the error now says the path is relative, read from which folder,
    and how to pass the absolute one (dataset.path may change on resume)."""
    from typer.testing import CliRunner

    from rl_tformers.cli import app

    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    cartpole_h5(work / "cp.hdf5")
    monkeypatch.chdir(work)
    runner = CliRunner()
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", "dataset.path=cp.hdf5", "train.steps=1",
                            "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=3",
                            "eval.at_end=false", "train.progress=false", "--run-dir", str(work / "run")])
    assert r.exit_code == 0, r.output
    monkeypatch.chdir(other)
    r = runner.invoke(app, ["train", "--resume", str(work / "run"), "train.steps=2"])
    assert r.exit_code == 2, r.output
    assert (f"error: no such HDF5 file: cp.hdf5 (the run's dataset.path=cp.hdf5 is relative and is read from the "
            f"current folder {other}: resume from the folder the run was started in, or pass the absolute path") in r.output
    r = runner.invoke(app, ["train", "--resume", str(work / "run"), "train.steps=2", f"dataset.path={work / 'cp.hdf5'}"])
    assert r.exit_code == 0, r.output
