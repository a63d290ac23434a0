"""Memory and depth kinds in the agents (issue 8): DT and GTrXL train through the shared
trainer and evaluate with every memory kind (xl, compressive, knn, a plain window) and depth kind
(universal, early_exit); early exit at evaluation (threshold, calibration, mean exit layer); the
kNN-LM action datastore at evaluation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import typer
from omegaconf import OmegaConf
from rl_tformers.agents.bc.agent import BCAgent
from rl_tformers.agents.common.scripted import collect_delayed_expert
from rl_tformers.agents.decision_transformer.agent import DTAgent
from rl_tformers.agents.decision_transformer.model import DTConfig
from rl_tformers.agents.gtrxl.agent import GTRXL_DEFAULTS, GTrXLAgent, GTrXLPolicy
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from rl_tformers.envs.loaders import save_d4rl_hdf5
from typer.testing import CliRunner

from rl_tformers.backbone import IncompatibleConfig
from rl_tformers.cli import app
from rl_tformers.cli.evaluate import _check_early_exit
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.run_config import ConfigError, compose
from rl_tformers.runtime.trainer import train
from tests.threads import one_thread

FAST = ["train.steps=4", "train.batch_size=8", "train.warmup_steps=2", "train.progress=false", "train.log_every=2",
        "train.checkpoint_every=4", "device=cpu", "eval.every=0", "eval.at_end=false"]
DT_TINY = ["backbone.d_model=16", "backbone.n_heads=1", "agent.context_len=5",
           "agent.env_kwargs={max_episode_steps: 25}"]


_one_thread = one_thread  # autouse, module scope: one torch thread


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _eval(run_dir, *args):
    res = CliRunner().invoke(app, ["eval", str(run_dir), "--episodes", "2", "--envs", "2", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


# -- Decision Transformer ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cartpole_path(tmp_path_factory):
    ds = collect_delayed_expert(20, seed=0, n_envs=10)
    return ds, save_d4rl_hdf5(ds, tmp_path_factory.mktemp("data") / "cartpole.hdf5")


@pytest.fixture(scope="module")
def dt_early_exit_run(cartpole_path, tmp_path_factory):
    _, path = cartpole_path
    run_dir = tmp_path_factory.mktemp("runs") / "dt_ee"
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *DT_TINY, *FAST, "backbone.n_layers=3",
                                       "backbone.depth={kind: early_exit, confidence: classifier}",
                                       "agent.targets=[100]", "agent.early_exit.windows=200"])
    train(cfg, run_dir)
    return run_dir


def test_dt_early_exit_trains_every_exit_and_the_classifier(dt_early_exit_run):
    rec = [r for r in _metrics(dt_early_exit_run) if "train/loss" in r]
    keys = {k for r in rec for k in r}
    assert {f"exit/loss_layer{n}" for n in (1, 2, 3)} <= keys
    assert {f"exit/agree_layer{n}" for n in (1, 2, 3)} <= keys
    assert "exit/classifier_loss" in keys
    assert all(r["exit/agree_layer3"] == 1.0 for r in rec if "exit/agree_layer3" in r)  # last = itself
    assert all(r["exit/classifier_loss"] > 0 for r in rec if "exit/classifier_loss" in r)


def test_dt_early_exit_threshold_zero_exits_at_layer_one_and_above_one_is_the_full_model(dt_early_exit_run):
    full = _eval(dt_early_exit_run)
    assert full["extra"]["exit_mean_layer"] == 3.0 and full["extra"]["exit_early_frac"] == 0.0
    assert full["extra"]["act_ms_per_step"] > 0 and full["extra"]["forward_ms_per_step"] > 0
    zero = _eval(dt_early_exit_run, "--early-exit", "0")
    assert zero["extra"]["exit_mean_layer"] == 1.0 and zero["extra"]["exit_early_frac"] == 1.0
    assert zero["extra"]["early_exit"] == {"threshold": 0.0}
    never = _eval(dt_early_exit_run, "--early-exit", "1.5")  # above any confidence in [0, 1]
    assert never["extra"]["exit_mean_layer"] == 3.0
    assert [r["returns"] for r in never["results"]] == [r["returns"] for r in full["results"]]


def test_dt_early_exit_calibration_meets_delta_on_the_held_out_episodes(dt_early_exit_run):
    out = _eval(dt_early_exit_run, "--early-exit", "calibrate")
    cal = out["extra"]["early_exit"]
    assert cal["n"] == 200 and cal["delta"] == 0.1 and cal["heldout_episodes"] == 1  # 20 episodes, every 20th
    risks = {float(t): r for t, r in cal["risks"].items()}
    assert risks[1.0] == 0.0  # a threshold of 1 exits (almost) never: consistent
    if cal["threshold"] is not None:  # every candidate down to the chosen one was accepted
        assert all(r < cal["delta"] for t, r in risks.items() if t >= cal["threshold"])
        assert 1.0 <= out["extra"]["exit_mean_layer"] <= 3.0
    else:
        assert out["extra"]["exit_mean_layer"] == 3.0


def test_dt_early_exit_forward_timing_reports_layers_and_consistency(dt_early_exit_run):
    from rl_tformers.agents.decision_transformer.early_exit_bench import forward_timing

    from rl_tformers.runtime.timing import interleaved_timing

    run = load_run(dt_early_exit_run)
    run.agent.inference.set_exit_threshold(0.0)
    res = forward_timing(run.agent, [1, 4], repeats=3)
    assert res["threshold"] == 0.0 and set(res["batches"]) == {"1", "4"}
    for b in res["batches"].values():
        assert b["exit_mean_layer"] == 1.0 and b["layers_run"] == 1.0  # every decision exits after layer 1
        assert 0.0 <= b["consistent"] <= 1.0 and b["full_ms"] > 0 and b["early_ms"] > 0
    calls = []
    t = interleaved_timing({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"] and set(t["a"]) == {"median_ms", "mean_ms", "p10_ms", "p90_ms"}


def test_dt_early_exit_options_are_refused_without_the_depth_kind(cartpole_path, tmp_path):
    _, path = cartpole_path
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *DT_TINY, *FAST, "backbone.n_layers=1"])
    train(cfg, tmp_path / "plain")
    res = CliRunner().invoke(app, ["eval", str(tmp_path / "plain"), "--episodes", "1", "--early-exit", "0.5"])
    assert res.exit_code == 2 and "backbone.depth.kind=early_exit" in res.output


@pytest.mark.parametrize("confidence", ["softmax", "saturation", "geometric", "multinomial", "sequence"])
@pytest.mark.parametrize("scheme", ["sampled", "weighted"])
def test_dt_loss_trains_with_every_exit_confidence(cartpole_path, confidence, scheme):
    ds, path = cartpole_path
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *DT_TINY, *FAST, "backbone.n_layers=2",
                                       f"backbone.depth={{kind: early_exit, confidence: {confidence}}}",
                                       f"agent.early_exit.scheme={scheme}"])
    agent = DTAgent(cfg, None, "cpu", dataset=ds)
    loss, metrics = agent.loss(agent.batches(0)[0])
    loss.backward()
    assert torch.isfinite(loss)
    clf = agent.model.backbone.depth.exit_classifier
    if confidence in ("softmax", "saturation"):
        assert clf is None and float(metrics["exit/classifier_loss"]) == 0.0
    else:
        assert float(metrics["exit/classifier_loss"]) > 0 and next(clf.parameters()).grad.abs().sum() > 0


def test_dt_universal_trains_with_ponder_cost_and_evaluates(cartpole_path, tmp_path):
    _, path = cartpole_path
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *DT_TINY, *FAST,
                                       "backbone.depth={kind: universal, act: true, max_steps: 3}"])
    train(cfg, tmp_path / "ut")
    rec = [r for r in _metrics(tmp_path / "ut") if "train/loss" in r]
    assert rec and all(r["aux/ponder"] > 0 for r in rec)
    assert all(1.0 <= r["backbone/act/ponder_steps"] <= 3.0 for r in rec)
    out = _eval(tmp_path / "ut", "--targets", "100")
    assert len(out["results"][0]["returns"]) == 2 and out["extra"]["act_ms_per_step"] > 0


@pytest.fixture(scope="module")
def dt_plain_run(cartpole_path, tmp_path_factory):
    _, path = cartpole_path
    run_dir = tmp_path_factory.mktemp("runs") / "dt_plain"
    train(compose("dt/cartpole_demo", [f"dataset.path={path}", *DT_TINY, *FAST, "backbone.n_layers=1",
                                       "agent.targets=[100]"]), run_dir)
    return run_dir


def test_dt_knn_lambda_zero_acts_exactly_like_the_model(dt_plain_run, cartpole_path):
    ds, _ = cartpole_path
    plain = _eval(dt_plain_run)
    knn0 = _eval(dt_plain_run, "--knn-lambda", "0")
    assert knn0["extra"]["knn"]["entries"] == ds.num_steps and knn0["extra"]["knn"]["lam"] == 0.0
    assert knn0["extra"]["knn_hit_frac"] == 1.0
    assert [r["returns"] for r in knn0["results"]] == [r["returns"] for r in plain["results"]]
    capped = _eval(dt_plain_run, "--knn-lambda", "0.5", "--knn-k", "4", "--knn-max-entries", "300")
    assert capped["extra"]["knn"]["entries"] == 300 and capped["extra"]["knn"]["k"] == 4


def test_dt_knn_lambda_one_with_one_neighbour_replays_the_dataset_action(dt_plain_run, cartpole_path):
    ds, _ = cartpole_path
    run = load_run(dt_plain_run)
    info = run.agent.inference_setup(knn_lambda=1.0, knn_k=1)
    assert info["knn"]["entries"] == ds.num_steps
    pol = run.agent.policy()
    eps = [ds.episode(i) for i in range(6)]
    same = []
    for ep in eps:  # step 0 of a dataset episode conditioned on its own return: the key of that step
        state = pol.initial_state(1, float(ep.rewards.sum()))
        a, _ = pol.act(ep.observations[:1], state, np.array([True]))
        same.append(int(a[0]) == int(ep.actions[0]))
    assert all(same)


@pytest.mark.parametrize("layout", [["agent.align=end"], ["agent.mode=last_action", "backbone.causal=false"]])
def test_dt_knn_datastore_keys_are_the_policys_contexts_for_end_aligned_windows(cartpole_path, layout):
    ds, path = cartpole_path
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *DT_TINY, *FAST, "backbone.n_layers=1", *layout])
    agent = DTAgent(cfg, None, "cpu", dataset=ds)
    assert agent.inference.build_knn_memory(lam=1.0, k=1)["entries"] == ds.num_steps
    pol = agent.policy()
    for i in range(3):  # replaying an episode with its own return: every context is a stored key
        ep = ds.episode(i)
        state = pol.initial_state(1, float(ep.rewards.sum()))
        for t in range(8):
            r = None if t == 0 else ep.rewards[t - 1 : t]
            a, state = pol.act(ep.observations[t : t + 1], state, np.array([t == 0]), r)
            assert int(a[0]) == int(ep.actions[t])


def test_dt_early_exit_in_last_action_mode(cartpole_path):
    ds, path = cartpole_path
    cfg = compose("dt/cartpole_demo", [f"dataset.path={path}", *DT_TINY, *FAST, "backbone.n_layers=2",
                                       "agent.mode=last_action", "backbone.causal=false",
                                       "backbone.depth={kind: early_exit, confidence: softmax}"])
    agent = DTAgent(cfg, None, "cpu", dataset=ds)
    loss, metrics = agent.loss(agent.batches(0)[0])
    assert torch.isfinite(loss) and set(k for k in metrics if k.startswith("exit/loss")) == {
        "exit/loss_layer1", "exit/loss_layer2"}
    agent.inference.set_exit_threshold(0.0)
    pol = agent.policy()
    state = pol.initial_state(2, 100.0)
    for t in range(4):
        _, state = pol.act(ds.observations[t : t + 2], state, np.array([t == 0, t == 0]), None if t == 0 else np.ones(2))
    assert pol.stats()["exit_mean_layer"] == 1.0 and pol.stats()["steps"] == 4.0


# -- GTrXL ------------------------------------------------------------------------------------------
GTRXL_TINY = ["backbone.d_model=16", "backbone.n_layers=2", "backbone.n_heads=2", "agent.seq_len=8",
              "agent.burn_in=4", "dataset.scripted={task: recall, episodes: 30, delay: 2}", "dataset.path=null",
              "eval.episodes=2", "eval.n_envs=2"]


@pytest.mark.parametrize(
    ("name", "overrides", "aux_keys"),
    [
        ("xl", ["backbone.memory={kind: xl, mem_len: 4}"], set()),
        ("compressive", ["backbone.memory={kind: compressive, mem_len: 4, compressed_len: 2, rate: 2}"],
         {"aux/compressive/attention_reconstruction"}),
        ("knn", ["backbone.memory={kind: knn, layer: -1, mem_len: 4, store_size: 16, top_k: 4, search: torch}"], set()),
        ("window", ["backbone.memory={kind: none}", "agent.window=8", "agent.burn_in=0"], set()),
        ("universal", ["backbone.memory={kind: none}", "agent.window=8", "agent.burn_in=0",
                       "backbone.depth={kind: universal, act: true, max_steps: 3}"], {"aux/ponder"}),
        ("early_exit", ["backbone.memory={kind: xl, mem_len: 4}", "backbone.depth={kind: early_exit}"], set()),
    ],
)
def test_gtrxl_trains_and_evaluates_with_each_memory_and_depth_kind(tmp_path, name, overrides, aux_keys):
    cfg = compose("memory/recall32_xl", [*GTRXL_TINY, *FAST, *overrides])
    train(cfg, tmp_path / name)
    rec = [r for r in _metrics(tmp_path / name) if "train/loss" in r]
    assert len(rec) == 2
    aux = {k for k in rec[-1] if k.startswith("aux/")}
    assert aux == aux_keys
    assert all(np.isfinite(r[k]) and r[k] > 0 for r in rec for k in aux_keys)
    if name == "knn":
        assert 0.0 < rec[-1]["backbone/layer1/knn/gate"] < 1.0
    if name == "compressive":
        assert rec[-1]["backbone/memory/temporal_range"] == (4 + 2 * 2) * 2
    out = _eval(tmp_path / name)
    assert len(out["results"][0]["returns"]) == 2 and all(0 <= r <= 32 for r in out["results"][0]["returns"])
    assert out["extra"]["act_calls"] == 34 and out["extra"]["act_ms_per_step"] > 0  # Recall-d2: 2 + 32 steps


def _window_model(window: int, depth: dict | None = None) -> GTrXLModel:
    bb = gtrxl_backbone(d_model=16, n_layers=2, n_heads=2)
    bb["memory"] = {"kind": "none"}
    if depth:
        bb["depth"] = depth
    torch.manual_seed(0)
    return GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb, window=window)).eval()


@pytest.mark.parametrize("depth", [None, {"kind": "universal", "act": True, "max_steps": 3}])
def test_gtrxl_window_policy_re_encodes_exactly_the_last_w_steps(depth):
    w = 4
    model = _window_model(w, depth)
    pol = GTrXLPolicy(model, obs_mean=np.zeros(3), obs_std=np.ones(3), action_low=-np.ones(2), action_high=np.ones(2))
    rng = np.random.default_rng(0)
    obs = rng.normal(size=(9, 2, 3)).astype(np.float32)
    obs_b = obs.copy()
    obs_b[:2] = rng.normal(size=(2, 2, 3))  # steps 0, 1 differ: outside the window from step 1 + W on
    acts = []
    for o in (obs, obs_b):
        state, seq = pol.initial_state(2), []
        for t in range(9):
            a, state = pol.act(o[t], state, np.array([t == 0, t == 0]))
            seq.append(a)
        acts.append(np.stack(seq))
    assert not np.array_equal(acts[0][4], acts[1][4])  # step 4 still sees step 1 (window 1..4)...
    np.testing.assert_array_equal(acts[0][5:], acts[1][5:])  # ...step 5 no longer does
    with torch.no_grad():  # step t = the encoder on the last W inputs at their episode steps
        x = torch.as_tensor(obs[5 - w + 1 : 6]).transpose(0, 1)  # (2, W, 3)
        pos = torch.arange(5 - w + 1, 6).expand(2, w)
        h = model.encoder(model.encoder.inputs(x), pos).features[:, -1]
        ref = model.actor.mode(h).clamp(-1, 1).numpy()
    np.testing.assert_allclose(acts[0][5], ref, atol=1e-6)


def test_gtrxl_window_options_are_checked():
    bb = gtrxl_backbone(d_model=16, n_layers=1, n_heads=2)
    with pytest.raises(IncompatibleConfig, match=r"agent\.window=4 .*memory\.kind='xl'"):
        GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb, window=4))
    bb["memory"] = {"kind": "none"}
    with pytest.raises(IncompatibleConfig, match=r"agent\.window=W"):
        GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))
    bb["depth"] = {"kind": "universal"}
    bb["memory"] = {"kind": "xl", "mem_len": 4}
    with pytest.raises(IncompatibleConfig, match="universal"):
        GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))
    cfg = OmegaConf.create({
        "seed": 0, "agent": {**GTRXL_DEFAULTS["agent"], "window": 4, "seq_len": 4, "burn_in": 2},
        "backbone": {**gtrxl_backbone(d_model=16, n_layers=1, n_heads=2), "memory": {"kind": "none"}},
        "dataset": {"scripted": {"task": "recall", "episodes": 4, "delay": 2}}, "train": {"batch_size": 2, "steps": 1},
        "eval": {"episodes": 1, "n_envs": 1},
    })
    with pytest.raises(ValueError, match=r"agent\.burn_in=0"):
        GTrXLAgent(cfg, None, "cpu")


def test_changing_a_slot_kind_in_a_config_layer_drops_the_old_kinds_fields():
    cfg = compose("memory/recall32_xl", ["backbone.memory={kind: compressive, rate: 4}"])
    assert OmegaConf.to_container(cfg.backbone.memory) == {"kind": "compressive", "rate": 4}  # no xl 'detach'
    cfg = compose("memory/recall32_compressive", ["backbone.memory.rate=2"])
    assert cfg.backbone.memory.kind == "compressive" and cfg.backbone.memory.compressed_len == 8  # same kind: merged


def test_dt_early_exit_threshold_is_printed_in_the_text_report(dt_early_exit_run):
    res = CliRunner().invoke(app, ["eval", str(dt_early_exit_run), "--episodes", "1", "--early-exit", "calibrate"])
    assert res.exit_code == 0, res.output
    assert "early-exit threshold" in res.output and "calibrated (delta 0.1" in res.output
    res = CliRunner().invoke(app, ["eval", str(dt_early_exit_run), "--episodes", "1", "--early-exit", "0.25"])
    assert res.exit_code == 0 and "early-exit threshold 0.25 (given)" in res.output


# -- agent options of the wrong type were coerced silently ------------------------------------------
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


# -- DT agent.early_exit.* / agent.knn.* were checked only at evaluation, or never ---------------------
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


# -- backbone.depth.threshold in an agent's config -------------------------------------------------------
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
    # a stored threshold would exit in training too; the acting threshold is agent.early_exit.threshold
    for depth in ({"kind": "early_exit", "confidence": "classifier", "threshold": 0.0},
                  {"kind": "early_exit", "confidence": "softmax", "threshold": 0.5}):
        bb = {**gtrxl_backbone(d_model=16, n_layers=2, n_heads=2, mem_len=4), "depth": depth}
        with pytest.raises(IncompatibleConfig, match=r"^gtrxl: backbone\.depth\.threshold=0\.[05]: GTrXL trains at full depth; the acting threshold is agent\.early_exit\.threshold"):
            GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))
    bb = {**gtrxl_backbone(d_model=16, n_layers=2, n_heads=2, mem_len=4), "depth": {"kind": "early_exit"}}
    GTrXLModel(GTrXLConfig(obs_dim=3, act_dim=2, backbone=bb))  # full depth: accepted


def test_gtrxl_refuses_negative_head_widths():
    # a negative width silently built a linear head (as 0 does)
    with pytest.raises(ValueError, match=r"^agent\.head_hidden must be >= 0 \(0: a linear head\), got -3$"):
        GTrXLConfig(obs_dim=3, act_dim=2, head_hidden=-3)
    with pytest.raises(ValueError, match=r"^agent\.critic_hidden must be >= 0 \(0: a linear head\), got -1$"):
        GTrXLConfig(obs_dim=3, act_dim=2, critic="iql", critic_hidden=-1)


# -- the MLP BC ignored backbone settings ---------------------------------------------------------------
@pytest.mark.parametrize(("override", "named"), [("backbone.memory.kind=xl", "backbone.memory"),
                                                 ("backbone.depth.kind=universal", "backbone.depth")])
def test_mlp_bc_refuses_backbone_settings(tmp_path, override, named):
    # it trained an MLP and said nothing: a "BC with XL memory" run was a plain MLP
    cfg = compose("gtrxl/recall_mlp_bc", [f"dataset.path={tmp_path / 'never_read.hdf5'}", override])
    with pytest.raises(ValueError, match=rf"^agent\.kind=bc is an MLP .* but the config sets {named}; drop them"):
        BCAgent(cfg, None, "cpu")


def test_gtrxl_window_shorter_than_the_training_segment_warns(tmp_path) -> None:
    """agent.window=W with agent.seq_len > W trains each step on more context than it acts on:
    warned (the docs say to train with seq_len=W)."""
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
