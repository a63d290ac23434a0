"""rl-tformers train (rl_tformers.cli.train): options and data checked before training, clean one-line errors, warnings."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from rl_tformers.backbone_config import BackboneConfig
from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_d4rl_h5
from tests.runs import TINY_DT, assert_clean_exit, train_dt

runner = CliRunner()


SMALL = ["train.steps=2", "train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "eval.every=0",
         "eval.at_end=false", "train.progress=false", "train.warmup_steps=1", "device=cpu"]


# ------------------------------------------------------------------- Discrete(n, start != 0)
def _discrete_start_h5(path: Path, start: int, n: int = 3) -> Path:
    """Four 8-step episodes whose actions lie in ``Discrete(n, start=start)`` (saved with the space)."""
    from rl_tformers.envs.dataset import EpisodeDataset
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    rng = np.random.default_rng(0)
    episodes = [{"observations": rng.normal(size=(9, 4)).astype(np.float32),
                 "actions": rng.integers(start, start + n, 8), "rewards": np.ones(8),
                 "terminations": [False] * 7 + [True], "truncations": [False] * 8} for _ in range(4)]
    episodes[0]["actions"][:n] = np.arange(start, start + n)  # every action occurs, the largest included
    ds = EpisodeDataset.from_episodes(episodes, observation_space=gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
                                      action_space=gym.spaces.Discrete(n, start=start))
    return save_d4rl_hdf5(ds, path)


@pytest.mark.parametrize("kind, start", [("dt", 1), ("dt", -1), ("bc", 1), ("gtrxl", 1)])
def test_discrete_actions_with_a_start_train_and_act_inside_the_space(tmp_path: Path, kind: str, start: int) -> None:
    from rl_tformers.runtime.loading import load_run
    from rl_tformers.runtime.trainer import train

    h5 = _discrete_start_h5(tmp_path / "d.hdf5", start)
    extra = {"dt": ["agent.context_len=4"], "bc": ["agent.hidden=[8]"],
             "gtrxl": ["agent.seq_len=4", "agent.burn_in=2", "backbone.n_heads=1", "agent.prev_action=true"]}[kind]
    cfg = compose(None, [f"agent.kind={kind}", f"dataset.path={h5}", *SMALL, *extra])
    assert train(cfg, tmp_path / "run").complete  # before: IndexError (start -1 or action n), or shifted labels
    run = load_run(tmp_path / "run")
    assert run.agent.info.action_start == start  # kept in the checkpoint
    pol = run.agent.policy()
    n_envs = 16
    obs = np.random.default_rng(1).normal(size=(n_envs, 4)).astype(np.float32) * 3
    state = pol.initial_state(n_envs, 1.0) if kind == "dt" else pol.initial_state(n_envs)
    seen = []
    for t in range(3):
        act, state = pol.act(obs + t, state, np.full(n_envs, t == 0), np.ones(n_envs))
        seen.append(np.asarray(act))
    seen = np.concatenate(seen)
    assert seen.dtype == np.int64 and seen.min() >= start and seen.max() <= start + 2, seen


def test_discrete_start_is_subtracted_from_the_training_labels(tmp_path: Path) -> None:
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.agents.decision_transformer.agent import to_model_batch
    from rl_tformers.agents.gtrxl.agent import segment_batch
    from rl_tformers.envs.loaders import load_dataset

    ds = load_dataset(_discrete_start_h5(tmp_path / "d.hdf5", 1))
    assert ds.action_space == gym.spaces.Discrete(3, start=1)
    info = DatasetInfo.from_dataset(ds)
    assert info.action_start == 1 and DatasetInfo.from_extra(info.to_extra()).action_start == 1
    raw = torch.tensor([[0, 1, 3], [2, 3, 1]])  # row 0 slot 0 is padding (value 0)
    mask = torch.tensor([[False, True, True], [True, True, True]])
    batch = {"observations": torch.zeros(2, 3, 4), "actions": raw, "returns_to_go": torch.zeros(2, 3),
             "timesteps": torch.zeros(2, 3, dtype=torch.long), "mask": mask}
    assert to_model_batch(batch, info)["actions"].tolist() == [[0, 0, 2], [1, 2, 0]]
    seg = segment_batch({**batch, "rewards": torch.zeros(2, 3), "episode_start": torch.zeros(2, 3, dtype=torch.bool),
                         "terminations": torch.zeros(2, 3, dtype=torch.bool)},
                        burn_in=0, discrete=True, action_start=info.action_start)
    assert seg.actions.tolist() == [[0, 2], [2, 0]]
    # an evaluation environment whose Discrete space starts elsewhere would get shifted actions
    with pytest.raises(ValueError, match=r"^actions: .* has actions in Discrete\(3, start=1\), but the evaluation "
                                         r"environment CartPole-v1 \(agent.env_id\) has action space Discrete\(2\)"):
        DatasetInfo.from_dataset(ds, env_id="CartPole-v1")


# ------------------------------------------------------------------- 2, 10: DT options checked before the data
@pytest.mark.parametrize("override, expected", [
    ("agent.timestep_overflow=wrap", "agent.timestep_overflow must be one of 'error', 'clamp', got 'wrap'"),
    ("agent.reward_scale=big", "agent.reward_scale must be 'auto' or a number > 0, got 'big'"),
    ("agent.reward_scale=0", "agent.reward_scale must be 'auto' or a number > 0, got 0"),
])
def test_dt_options_are_checked_before_the_dataset_is_read(tmp_path: Path, override: str, expected: str) -> None:
    r = train_dt(f"dataset.path={tmp_path / 'not_read_yet.hdf5'}", override, "--run-dir", str(tmp_path / "run"))
    assert_clean_exit(r, 2)
    assert f"error: {expected}" in r.output and "not_read_yet" not in r.output
    assert not (tmp_path / "run").exists()


def test_backbone_d_ff_default_and_dt_embed_dropout() -> None:
    from rl_tformers.agents.decision_transformer.model import DTConfig

    assert BackboneConfig(d_model=16).ff_dim == 64 and BackboneConfig(d_model=16, d_ff=8).ff_dim == 8
    with pytest.raises(ValueError, match=r"^agent.embed_dropout must be in \[0, 1\), got 3.0$"):
        DTConfig(obs_dim=3, act_dim=2, embed_dropout=3.0)


# ------------------------------------------------------------------- agent options of the wrong type
@pytest.mark.parametrize("args, expected", [
    (["agent.kind=bc", "agent.hidden=32"], "agent.hidden must be a list of integers >= 1, got 32 (int)"),
    (["agent.kind=bc", "agent.env_kwargs=5"], "agent.env_kwargs must be a mapping or null, got 5 (int)"),
    (["agent.kind=dt", "agent.env_kwargs=[1]"], "agent.env_kwargs must be a mapping or null, got [1] (list)"),
])
def test_wrongly_typed_agent_options_are_named(tmp_path: Path, args: list[str], expected: str) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = runner.invoke(app, ["train", *args, f"dataset.path={h5}", *SMALL, "--run-dir", str(tmp_path / "run")])
    assert_clean_exit(r, 2)
    assert f"error: {expected}" in r.output


# ------------------------------------------------------------------- DT windows vs a fixed-length attention
def test_dt_window_longer_than_linformer_max_len_is_refused_at_build() -> None:
    from rl_tformers.agents.decision_transformer.model import DTConfig

    def cfg(max_len: int, projection: str = "linear") -> DTConfig:
        return DTConfig(obs_dim=3, act_dim=2, context_len=4, mode="last_action", backbone={
            "d_model": 16, "n_layers": 1, "causal": False,
            "attention": {"kind": "linformer", "k": 4, "max_len": max_len, "projection": projection}})

    with pytest.raises(ValueError, match=r"^agent.context_len=4 makes windows of 11 tokens \(3K-1 in "
                                         r"agent.mode=last_action\), more than attention kind 'linformer' takes: "
                                         r"backbone.attention.max_len=8;"):
        cfg(8)
    assert cfg(11).n_tokens == 11
    assert cfg(8, "pool").n_tokens == 11  # segment pooling has no fixed length


# ------------------------------------------------------------------- GTrXL window options
@pytest.mark.parametrize("override, expected", [
    ("agent.seq_len=0", "agent.seq_len must be an integer >= 1, got 0"),
    ("agent.burn_in=-3", "agent.burn_in must be an integer >= 0, got -3"),
])
def test_gtrxl_seq_len_and_burn_in_are_named_with_the_typed_value(tmp_path: Path, override: str,
                                                                  expected: str) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = runner.invoke(app, ["train", "agent.kind=gtrxl", f"dataset.path={h5}", override, *SMALL,
                            "--run-dir", str(tmp_path / "run")])
    assert_clean_exit(r, 2)
    assert f"error: {expected}" in r.output


# ------------------------------------------------------------------- agent.head typos
def test_unknown_dt_head_is_refused_for_discrete_actions_too() -> None:
    from rl_tformers.agents.decision_transformer.model import DTConfig

    with pytest.raises(ValueError, match=r"^agent.head='gauss'; use deterministic \(categorical\) for discrete"):
        DTConfig(obs_dim=3, act_dim=2, discrete=True, head="gauss")
    with pytest.raises(ValueError, match=r"^agent.head='gauss'; use deterministic or gaussian for continuous"):
        DTConfig(obs_dim=3, act_dim=2, head="gauss")
    with pytest.raises(ValueError, match="agent.head=gaussian needs continuous actions"):
        DTConfig(obs_dim=3, act_dim=2, discrete=True, head="gaussian")
    for head in ("deterministic", "categorical"):  # valid values work as before
        assert DTConfig(obs_dim=3, act_dim=2, discrete=True, head=head).head == "categorical"
    assert DTConfig(obs_dim=3, act_dim=2, head="gaussian").head == "gaussian"


# ------------------------------------------------------------------------------------------ CLI
def test_train_bad_dataset_is_a_clean_error(tmp_path: Path) -> None:
    obs = (np.random.default_rng(0).normal(size=(30, 4)) * 0.05).astype(np.float32)
    obs[12, 1] = np.nan
    h5 = write_d4rl_h5(tmp_path / "nan.hdf5", observations=obs)
    r = train_dt(f"dataset.path={h5}", "--run-dir", str(tmp_path / "run"))
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2
    assert f"error: {h5}: observations: episode 1, step 2" in r.output


def test_train_missing_dataset_is_a_clean_error(tmp_path: Path) -> None:
    r = train_dt(f"dataset.path={tmp_path / 'nope.hdf5'}", "--run-dir", str(tmp_path / "run"))
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and "nope.hdf5" in r.output


def test_train_bad_agent_option_is_a_clean_error(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = train_dt(f"dataset.path={h5}", "agent.max_ep_len=5", "--run-dir", str(tmp_path / "run"))
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and "agent.max_ep_len" in r.output


def test_gtrxl_memoryless_is_a_clean_error(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = runner.invoke(app, ["train", "-c", "gtrxl/cartpole_positions_bc", f"dataset.path={h5}",
                            "backbone.memory.kind=none", "train.steps=2", "train.batch_size=4",
                            "backbone.d_model=16", "backbone.n_layers=1", "eval.every=0", "eval.at_end=false",
                            "train.progress=false", "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and "backbone.memory.kind" in r.output


def test_eval_failure_at_end_keeps_the_trained_checkpoint(tmp_path: Path, monkeypatch) -> None:
    from rl_tformers.runtime import toy
    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    def boom(self, step):
        raise RuntimeError("evaluation environment broke")

    monkeypatch.setattr(toy.ToyAgent, "evaluate", boom)
    cfg = compose(None, ["agent.kind=toy", "train.steps=4", "train.batch_size=4", "backbone.n_layers=1",
                         "train.checkpoint_every=100", "train.log_every=100", "eval.every=0", "eval.at_end=true",
                         "train.progress=false", "device=cpu"])
    with pytest.raises(RuntimeError, match="evaluation environment broke"):
        train(cfg, tmp_path / "run")
    assert (tmp_path / "run" / "checkpoints" / "step_000000004.pt").is_file()


def test_eval_failure_mid_run_saves_that_step_and_resumes_exactly(tmp_path: Path, monkeypatch) -> None:
    import torch

    from rl_tformers.runtime import toy
    from rl_tformers.runtime.checkpoint import load_checkpoint
    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import resume, train

    over = ["agent.kind=toy", "train.steps=6", "train.batch_size=4", "backbone.n_layers=1",
            "train.checkpoint_every=100", "train.log_every=100", "eval.every=3", "eval.at_end=false",
            "train.progress=false", "device=cpu"]
    train(compose(None, over), tmp_path / "straight")
    real = toy.ToyAgent.evaluate

    def boom(self, step):
        raise RuntimeError("evaluation environment broke")

    monkeypatch.setattr(toy.ToyAgent, "evaluate", boom)
    with pytest.raises(RuntimeError, match="evaluation environment broke") as info:
        train(compose(None, over), tmp_path / "broken")
    assert any("--resume" in n for n in getattr(info.value, "__notes__", []))
    assert (tmp_path / "broken" / "checkpoints" / "step_000000003.pt").is_file()  # not a scheduled checkpoint
    monkeypatch.setattr(toy.ToyAgent, "evaluate", real)
    assert resume(tmp_path / "broken").complete
    a = load_checkpoint(tmp_path / "straight" / "checkpoints" / "step_000000006.pt")["model"]
    b = load_checkpoint(tmp_path / "broken" / "checkpoints" / "step_000000006.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_env_id_refused_before_training(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "ok.hdf5")
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.env_id=NoSuchEnv-v9",
                            *[a for a in TINY_DT if not a.startswith("eval.")], "eval.every=0", "eval.at_end=true",
                            "eval.episodes=1", "eval.n_envs=1", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2 and "agent.env_id" in r.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_dataset_env_observation_mismatch_is_named(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "obs3.hdf5", obs_dim=3)  # CartPole observations have 4 entries
    run = tmp_path / "run"
    r = train_dt(f"dataset.path={h5}", "--run-dir", str(run))
    if r.exit_code == 0:  # not refused at train time: eval must refuse
        r = runner.invoke(app, ["eval", str(run), "--episodes", "2", "--envs", "2"])
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code == 2 and "observation" in r.output


def test_non_finite_targets_refused() -> None:
    from rl_tformers.runtime.evaluation import parse_targets

    for text in ("nan", "inf", "100,-inf"):
        with pytest.raises(ValueError, match="--targets"):
            parse_targets(text)


@pytest.mark.parametrize("name", ["gtrxl/hopper_positions_bc", "gtrxl/hopper_positions_mlp_bc"])
def test_packaged_configs_honour_the_data_root_env(name: str) -> None:
    from rl_tformers.runtime.run_config import compose

    cfg = compose(name, [])
    assert cfg.dataset.get("root") in (None, "")


def test_dataset_key_typo_is_refused() -> None:
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", "dataset.path=x.hdf5", "dataset.lazzy=true",
                            "--print-config"])
    assert r.exit_code == 2 and "dataset.lazzy" in r.output


def test_dict_observations_can_be_flattened_from_the_run_config(tmp_path: Path, monkeypatch) -> None:
    import gymnasium as gym
    from rl_tformers.agents.common.offline import load_offline_dataset
    from rl_tformers.envs.recording import EpisodeRecorder

    class DictObs(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Dict({
                "pos": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
                "vel": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)})

        def observation(self, o):
            return {"pos": o[:2].astype(np.float32), "vel": o[2:].astype(np.float32)}

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    env = EpisodeRecorder(DictObs(gym.make("CartPole-v1")))
    env.reset(seed=0)
    done = False
    while not done:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        done = term or trunc
    env.create_dataset(dataset_id="test/cartdict-v0", algorithm_name="random")
    ds = load_offline_dataset({"path": "test/cartdict-v0", "root": str(tmp_path), "flatten_observations": True})
    assert ds.observation_shape == (4,)


def test_demo_prints_training_progress_without_a_terminal(tmp_path: Path) -> None:
    from rl_tformers.agents.common.demo import run_demo

    lines: list[str] = []
    run_demo(tmp_path / "demo", steps=20, n_episodes=10, eval_episodes=1, targets=[20.0],
             extra_overrides=["backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4",
                              "train.batch_size=4", "train.warmup_steps=1", "train.log_every=2",
                              "agent.env_kwargs={max_episode_steps: 10}"], echo=lines.append)
    progress = [s for s in lines if s.startswith("[2/4] ... update")]
    assert [s.split()[3].rstrip(",") for s in progress] == [f"{k}/20" for k in range(2, 20, 2)]
    assert all(", loss " in s for s in progress)


DROPOUT_ADVICE = ("attention kind 'performer' forms no attention probabilities, so attn_dropout=0.1 is not applied "
                  "to it (residual and feed-forward dropout still are); set attn_dropout=0 to say so and silence "
                  "this warning")


def _advice(caught) -> list[str]:
    return [str(w.message) for w in caught if "forms no attention probabilities" in str(w.message)]


@pytest.fixture(scope="module")
def performer_run(tmp_path_factory):
    """A 2-update DT with Performer attention (the DT's default attn_dropout=0.1) on Recall-d2
    (every episode 34 steps), and the warnings its training gave."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    root = tmp_path_factory.mktemp("lead8")
    data = save_d4rl_hdf5(scripted_dataset("recall", 20, delay=2, seed=0), root / "recall-d2.hdf5")
    cfg = compose(overrides=[
        "agent.kind=dt", f"dataset.path={data}", "agent.max_ep_len=40", "agent.context_len=4", "agent.targets=[1]",
        "backbone.d_model=16", "backbone.n_layers=1", "backbone.attention.kind=performer", "train.steps=2",
        "train.batch_size=4", "train.warmup_steps=1", "train.progress=false", "eval.at_end=false", "device=cpu",
    ])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(cfg, root / "run")
    return root / "run", _advice(caught)


# -- `eval --json` wrote the counts of `extra` as floats (act_calls 34.0, steps 34.0) -------------
def test_eval_json_writes_every_count_as_an_integer(performer_run):
    run_dir, _ = performer_run
    r = runner.invoke(app, ["eval", str(run_dir), "--episodes", "3", "--envs", "3", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    x = out["extra"]
    # one act call (one DT forward pass) per step of the 3 environments, all episodes 34 steps
    assert (x["act_calls"], x["steps"], x["step"]) == (34, 34, 2)
    assert '"act_calls": 34,' in r.stdout and '"steps": 34,' in r.stdout
    assert all(type(v) is int for v in (x["act_calls"], x["steps"], x["step"], out["episodes"], out["n_envs"],
                                         out["seed"]))
    res = out["results"][0]
    assert res["lengths"] == [34, 34, 34] and res["seeds"] == [0, 1, 2]
    assert all(type(v) is int for v in res["lengths"] + res["seeds"])
    assert all(type(v) is float for v in [*res["returns"], res["return_mean"], res["return_std"],
                                           x["act_ms_per_step"], x["forward_ms_per_step"]])


# -- the Performer attn_dropout advice came again at every eval / plot of the trained run ---------
def test_the_attention_dropout_advice_is_given_in_training_not_when_the_run_is_loaded(performer_run):
    from rl_tformers.runtime.agent_registry import build_agent
    from rl_tformers.runtime.loading import load_run

    run_dir, trained = performer_run
    assert trained == [DROPOUT_ADVICE]  # training says it, once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = load_run(run_dir)
        r = runner.invoke(app, ["eval", str(run_dir), "--episodes", "1", "--envs", "1"])
    assert r.exit_code == 0, r.output
    assert run.cfg.backbone.attention.kind == "performer"
    assert _advice(caught) == [] and "attn_dropout" not in r.output
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = compose(start=yaml.safe_load((run_dir / "config.yaml").read_text()))
        build_agent(resumed, run_dir, "cpu")  # building for training (as a resume does) still advises
    assert _advice(caught) == [DROPOUT_ADVICE]
    # a UserWarning of its own category, the one load_run silences
    from rl_tformers.backbone_config import ConfigAdviceWarning

    assert [w.category for w in caught if str(w.message) == DROPOUT_ADVICE] == [ConfigAdviceWarning]
    assert issubclass(ConfigAdviceWarning, UserWarning)


# -- --print-config showed `memory: {kind: compressive}`, not what compressive is built with -------
def test_print_config_shows_each_slot_with_its_kinds_defaults(tmp_path):
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", "backbone.memory.kind=compressive", "--print-config"])
    assert r.exit_code == 0, r.output
    bb = yaml.safe_load(r.stdout)["backbone"]
    assert bb["memory"] == {"kind": "compressive", "mem_len": 32, "compressed_len": 32, "rate": 3,
                            "compression": "conv", "loss": "attention", "loss_weight": 1.0}
    assert bb["attention"] == {"kind": "sdpa"} and bb["depth"] == {"kind": "fixed"}
    assert bb["block"] == {"kind": "gated", "gate": "gru", "gate_bias": 2.0, "relu": True}
    assert bb["position"] == {"kind": "xl_relative", "base": 10000.0}
    assert (bb["d_model"], bb["max_position"], bb["d_ff"]) == (64, 4096, None)
    # bc builds no backbone: its section is shown as it is
    r = runner.invoke(app, ["train", "-c", "bc/hopper_medium", "--print-config"])
    assert r.exit_code == 0 and yaml.safe_load(r.stdout)["backbone"] == {}


def test_config_yaml_keeps_the_fields_set_and_resume_prints_the_built_backbone(tmp_path):
    run = tmp_path / "run"
    args = ["-c", "toy", "train.steps=2", "train.warmup_steps=1", "train.progress=false", "eval.every=0",
            "device=cpu"]
    r = runner.invoke(app, ["train", *args, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    saved = yaml.safe_load((run / "config.yaml").read_text())["backbone"]
    assert saved == {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.1, "attn_dropout": 0.1,
                     "position": {"kind": "learned"}, "max_position": 64}  # what was set, as before
    r = runner.invoke(app, ["train", "--resume", str(run), "--print-config"])
    assert r.exit_code == 0, r.output
    shown = yaml.safe_load(r.stdout)["backbone"]
    assert shown["position"] == {"kind": "learned", "per_layer": False}
    assert shown["attention"] == {"kind": "sdpa"} and shown["memory"] == {"kind": "none"}
    # the run resumes (config.yaml and the checkpoint's config compare equal, as before)
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3", "train.progress=false"])
    assert r.exit_code == 0 and "done: 3 steps" in r.output, r.output


def test_a_recipe_dataset_not_built_yet_gets_its_recipe_not_a_typo_hint(tmp_path, monkeypatch) -> None:
    """Training on the not-yet-built position-only Hopper set names its recipe and a collect
    command that works from a clone, not a typo hint ("did you mean 'rlt/hopper-v5/medium-v1'?"
    would point at the full-observation set, the wrong one)."""
    from rl_tformers.envs.loaders import load_minari
    from rl_tformers.envs.recipes import all_recipes

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari_home"))
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "no_policies_here"))
    built = tmp_path / "root" / "rlt/hopper-v5/medium-v1" / "data"
    built.mkdir(parents=True)
    (built / "metadata.json").write_text("{}")
    recipe = next(r for r in all_recipes().values() if r.dataset_id == "rlt/hopper-v5/medium-positions-v1")
    with pytest.raises(FileNotFoundError) as exc:
        load_minari(recipe.dataset_id, root=tmp_path / "root")
    msg = str(exc.value)
    assert "did you mean" not in msg
    assert f"`rl-tformers collect --recipe {recipe.name} --policies DIR (the folder of the pretrained SB3 agents)`" in msg
    (tmp_path / "policies").mkdir()
    monkeypatch.setenv("RL_TFORMERS_POLICIES", str(tmp_path / "policies"))  # found: no --policies hint
    with pytest.raises(FileNotFoundError, match=rf"build it \(`rl-tformers collect --recipe {recipe.name}`\)"):
        load_minari(recipe.dataset_id, root=tmp_path / "root")


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_training_on_a_damaged_file_is_one_error_line_and_exit_2(tmp_path: Path, lazy: bool) -> None:
    from tests.datafiles import flip_object_header

    path = flip_object_header(write_d4rl_h5(tmp_path / "d.hdf5", n=300), "observations")
    res = train_dt(f"dataset.path={path}", f"dataset.lazy={str(lazy).lower()}", "--run-dir", str(tmp_path / "run"))
    assert_clean_exit(res, 2)
    assert res.output.strip().splitlines()[-1] == (
        f"error: {path}: cannot read 'observations': the file is damaged (KeyError: Unable to synchronously open "
        f"object (bad object header version number)); re-create or re-download it")
    assert not (tmp_path / "run").exists()


def test_a_chunk_damaged_while_training_lazily_is_one_error_line_and_exit_2(tmp_path: Path, monkeypatch) -> None:
    """The file passes its checks when loaded and its compressed chunks are damaged when training
    starts (a disk or network file system going bad): the lazy read of the first batch fails in
    one line, exit 2, after the run was started."""
    from rl_tformers.envs.torch_data import StepBatchDataset

    from tests.datafiles import corrupt_chunk, write_cartpole_h5, write_compressed_copy

    path = write_compressed_copy(write_cartpole_h5(tmp_path / "p.hdf5", n=3000), tmp_path / "gz.hdf5", chunk_rows=100)
    real = StepBatchDataset.__getitem__

    def damage_then_read(self, step: int):
        if step == 0:
            for i in range(30):
                corrupt_chunk(path, "observations", i)
        return real(self, step)

    monkeypatch.setattr(StepBatchDataset, "__getitem__", damage_then_read)
    res = train_dt(f"dataset.path={path}", "dataset.lazy=true", "--run-dir", str(tmp_path / "run"))
    assert_clean_exit(res, 2)
    assert res.output.strip().splitlines()[-1] == (
        f"error: {path}: cannot read 'observations': the file is damaged (OSError: Can't synchronously read data "
        f"(filter returned failure during read)); re-create or re-download it")
    assert (tmp_path / "run" / "config.yaml").is_file()  # the run had started


def test_package_log_warnings_read_as_captured_python_warnings() -> None:
    """The CLI's one-line log format: INFO as it is, a warning of the package's loggers prefixed
    ``warning: `` once, as a Python warning is."""
    import logging

    from rl_tformers.cli.train import _LogFormatter

    def line(level: int, msg: str) -> str:
        return _LogFormatter().format(logging.LogRecord("rl_tformers.x", level, __file__, 1, msg, None, None))

    assert line(logging.INFO, "step 10") == "step 10"
    assert line(logging.WARNING, "no time limit") == "warning: no time limit"
    assert line(logging.WARNING, "warning: said once") == "warning: said once"
    assert line(logging.ERROR, "broken") == "error: broken"
    try:
        raise RuntimeError("inside")
    except RuntimeError:
        import sys

        record = logging.LogRecord("rl_tformers.x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    text = _LogFormatter().format(record)
    assert text.startswith("error: failed\nTraceback (most recent call last):") and text.endswith("RuntimeError: inside")
