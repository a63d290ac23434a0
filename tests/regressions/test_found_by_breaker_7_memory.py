"""Defects found by breaker 7 in the memory / adaptive-computation features as the agents use
them (agent options, early-exit thresholds, the MLP BC's backbone); each test failed before its fix.
Nothing here reads a dataset: every refusal comes before one is loaded."""

from __future__ import annotations

import pytest
import typer
from rl_tformers.agents.bc.agent import BCAgent
from rl_tformers.agents.decision_transformer.model import DTConfig
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.cli.evaluate import _check_early_exit
from rl_tformers.runtime.run_config import ConfigError, compose


# -- 1: agent options of the wrong type were coerced silently ------------------------------------------
@pytest.mark.parametrize(("config", "override", "message"), [
    ("gtrxl/recall_bc", "agent.burn_in=1.5", "agent.burn_in must be an integer >= 0, got 1.5 (float)"),
    ("gtrxl/recall_bc", "agent.window=true", "agent.window must be an integer >= 0, got True (bool)"),
    ("gtrxl/recall_bc", "agent.seq_len=abc", "agent.seq_len must be an integer >= 1, got 'abc' (str)"),
    ("gtrxl/recall_bc", "agent.prev_action=maybe", "agent.prev_action must be true or false, got 'maybe' (str)"),
    ("gtrxl/recall_bc", "agent.deterministic=2", "agent.deterministic must be true or false, got 2 (int)"),
    ("gtrxl/recall_bc", "agent.gamma=.nan", "agent.gamma must be a number in [0, 1], got nan (float)"),
    ("dt/cartpole_demo", "agent.knn.lam=abc", "agent.knn.lam must be a number in [0, 1], got 'abc' (str)"),
    ("dt/cartpole_demo", "agent.early_exit.windows=1.5",
     "agent.early_exit.windows must be an integer >= 1, got 1.5 (float)"),
    ("dt/cartpole_demo", "agent.early_exit=5", "agent.early_exit must be a mapping of options"),
])
def test_agent_options_of_the_wrong_type_are_refused_naming_the_option(config, override, message):
    with pytest.raises(ConfigError) as exc:
        compose(config, [override])
    assert str(exc.value).startswith(message)


def test_agent_options_of_the_right_type_still_compose():
    cfg = compose("gtrxl/recall_bc", ["agent.gamma=1", "agent.burn_in=0", "agent.prev_action=true"])
    assert cfg.agent.gamma == 1 and cfg.agent.burn_in == 0 and cfg.agent.prev_action is True


# -- 2: DT agent.early_exit.* / agent.knn.* were checked only at evaluation, or never ---------------------
@pytest.mark.parametrize(("override", "message"), [
    # a reshape error in calibration, after training
    ("agent.early_exit.windows=0", "agent.early_exit.windows must be an integer >= 1, got 0"),
    # every second episode held out instead (max(2, round(1 / 0.7)))
    ("agent.early_exit.heldout_frac=0.7", "agent.early_exit.heldout_frac must be a number in [0, 0.5], got 0.7"),
    ("agent.early_exit.delta=-1", "agent.early_exit.delta must be a number in (0, 1), got -1"),
    ("agent.early_exit.tol=-0.1", "agent.early_exit.tol must be a number >= 0, got -0.1"),
    ("agent.early_exit.threshold=-0.5", "agent.early_exit.threshold must be a number >= 0 or one of 'calibrate', "
                                        "'none', 'off' or null, got -0.5"),
    ("agent.early_exit.threshold=abc", "agent.early_exit.threshold must be a number >= 0 or one of 'calibrate', "
                                       "'none', 'off' or null, got 'abc'"),
    ("agent.knn.lam=2", "agent.knn.lam must be a number in [0, 1], got 2"),  # not "lambda must lie in [0, 1]" at eval
    ("agent.knn.temperature=0", "agent.knn.temperature must be a number > 0, got 0"),  # every weight would be 0
    ("agent.knn.k=0", "agent.knn.k must be an integer >= 1, got 0"),
    ("agent.knn.metric=cosine", "agent.knn.metric must be one of 'l2', 'ip', got 'cosine'"),
])
def test_dt_inference_options_are_checked_when_the_agent_is_built(tmp_path, override, message):
    with pytest.raises(ConfigError) as exc:
        compose("dt/cartpole_demo", [f"dataset.path={tmp_path / 'never_read.hdf5'}", override])
    assert str(exc.value) == message


def test_a_negative_early_exit_threshold_is_refused_at_evaluation():
    # `rl-tformers eval RUN --early-exit -1` ran (every step exited after layer 1), while
    # backbone.depth.threshold refuses a negative value
    from rl_tformers.agents.decision_transformer.config import exit_threshold

    with pytest.raises(typer.Exit):
        _check_early_exit("-1")
    _check_early_exit("0")  # the smallest threshold
    _check_early_exit("calibrate")
    with pytest.raises(ValueError, match=r"^--early-exit must be a number >= 0 or one of 'calibrate', 'none', 'off' "
                                         r"or null, got -0\.5$"):
        exit_threshold(-0.5, "--early-exit")
    assert exit_threshold("0.7", "x") == 0.7 and exit_threshold("None", "x") is None
    assert exit_threshold(" Calibrate ", "x") == "calibrate" and exit_threshold(0, "x") == 0.0


# -- 3: backbone.depth.threshold in an agent's config -------------------------------------------------------
def test_dt_refuses_a_backbone_exit_threshold():
    # with it, every training forward exited at layer 1 (exit/loss_layer1 == ..._layer3, the layers
    # above never trained) and `rl-tformers eval --early-exit none` ("the full model") still
    # exited at layer 1 (exit_mean_layer 1.0), as did the reference of the calibration
    bb = {"d_model": 16, "n_layers": 3, "n_heads": 1, "depth": {"kind": "early_exit", "threshold": 0.0}}
    with pytest.raises(ValueError, match=r"^backbone\.depth\.threshold=0\.0: the Decision Transformer trains every exit"):
        DTConfig(obs_dim=3, act_dim=2, backbone=bb)
    bb["depth"] = {"kind": "early_exit"}
    assert DTConfig(obs_dim=3, act_dim=2, backbone=bb).backbone.depth.threshold is None


def test_gtrxl_refuses_a_backbone_exit_threshold():
    # GTrXL passes no exit head: threshold 0 trained and acted at layer 1 only (the doc: "full
    # depth"); confidence softmax with a threshold died at the first update with a traceback
    for depth in ({"kind": "early_exit", "confidence": "classifier", "threshold": 0.0},
                  {"kind": "early_exit", "confidence": "softmax", "threshold": 0.5}):
        bb = {**gtrxl_backbone(d_model=16, n_layers=2, n_heads=2, mem_len=4), "depth": depth}
        with pytest.raises(IncompatibleConfig, match=r"^gtrxl: backbone\.depth\.threshold=0\.[05]: GTrXL trains and acts at full"):
            GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))
    bb = {**gtrxl_backbone(d_model=16, n_layers=2, n_heads=2, mem_len=4), "depth": {"kind": "early_exit"}}
    GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))  # full depth: accepted


def test_gtrxl_refuses_negative_head_widths():
    # a negative width silently built a linear head (as 0 does)
    with pytest.raises(ValueError, match=r"^agent\.head_hidden must be >= 0 \(0: a linear head\), got -3$"):
        GTrXLConfig(obs_dim=3, act_dim=2, head_hidden=-3)
    with pytest.raises(ValueError, match=r"^agent\.critic_hidden must be >= 0 \(0: a linear head\), got -1$"):
        GTrXLConfig(obs_dim=3, act_dim=2, critic="iql", critic_hidden=-1)


# -- 4: the MLP BC ignored backbone settings ---------------------------------------------------------------
@pytest.mark.parametrize(("override", "named"), [("backbone.memory.kind=xl", "backbone.memory"),
                                                 ("backbone.depth.kind=universal", "backbone.depth")])
def test_mlp_bc_refuses_backbone_settings(tmp_path, override, named):
    # it trained an MLP and said nothing: a "BC with XL memory" run was a plain MLP
    cfg = compose("gtrxl/recall_mlp_bc", [f"dataset.path={tmp_path / 'never_read.hdf5'}", override])
    with pytest.raises(ValueError, match=rf"^agent\.kind=bc is an MLP .* but the config sets {named}; drop them"):
        BCAgent(cfg, None, "cpu")


def test_gtrxl_window_shorter_than_the_training_segment_warns(tmp_path) -> None:
    """agent.window=W with agent.seq_len > W trained each step on more context than it acts on,
    silently (the breaker's note; the docs say to train with seq_len=W)."""
    import warnings

    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import Trainer

    # its own small file: a clean clone has no data/memory/ (CI failed on the default path)
    data = tmp_path / "recall-d8.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=8, seed=0), data)
    base = ["backbone.memory={kind: none}", "agent.burn_in=0", "train.steps=1", "device=cpu",
            "train.progress=false", "eval.at_end=false", f"dataset.path={data}"]
    with pytest.warns(UserWarning, match=r"agent.seq_len=8 > agent.window=3: .* up to 7 earlier steps .* only the 2 "):
        Trainer(compose("gtrxl/recall_bc", [*base, "agent.window=3", "agent.seq_len=8"]), tmp_path / "a")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(compose("gtrxl/recall_bc", [*base, "agent.window=8", "agent.seq_len=8"]), tmp_path / "b")
    assert not [w for w in caught if "agent.seq_len" in str(w.message)]
