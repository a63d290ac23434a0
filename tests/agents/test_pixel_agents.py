"""Pixel observations through every agent: a tiny uint8 (2, 36, 36) dataset made here trains 2
updates of the DT, BC and GTrXL BC with each image encoder and evaluates 1 episode on the pixel
task of tests/pixel_env.py; PPO-GTrXL acts in it with uint8 rollouts; an encoder that does not
fit the observations is refused in one line (exit code 2); the flat path keeps its parameters."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from rl_tformers.agents.common.offline import DatasetInfo
from rl_tformers.agents.decision_transformer.agent import to_model_batch
from rl_tformers.agents.gtrxl.ppo_update import PIXEL_KEY, ppo_loss
from rl_tformers.envs.loaders import load_dataset
from typer.testing import CliRunner

from rl_tformers.cli import app
from rl_tformers.runtime.agent_registry import build_agent
from rl_tformers.runtime.evaluation import evaluate
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train
from tests.bitwise import same_bits
from tests.datafiles import write_d4rl_h5
from tests.pixel_env import FULL_ID, pixel_dataset_arrays

COMMON = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.progress=false", "device=cpu",
          "eval.every=0", "eval.at_end=true", "eval.episodes=1", "eval.n_envs=1"]
#: each agent's tiny overrides (config file, overrides)
AGENTS = {
    "dt": ("dt/cartpole_demo", ["backbone.d_model=16", "backbone.n_heads=1", "backbone.n_layers=1",
                                "agent.context_len=4", "agent.max_ep_len=16", "agent.targets=[6]",
                                "agent.eval_figure=false"]),
    "bc": (None, ["agent.kind=bc", "agent.hidden=[8]"]),
    "gtrxl": ("gtrxl/recall_bc", ["backbone.d_model=16", "backbone.n_layers=1", "agent.seq_len=4",
                                  "agent.burn_in=2", "agent.prev_action=true", "agent.env_id=null",
                                  "agent.env_kwargs=null"]),
}
PPO = [f"agent.env_id={FULL_ID}", "agent.n_envs=2", "agent.n_steps=8", "agent.n_minibatches=2", "agent.n_epochs=1",
       "backbone.d_model=16", "backbone.n_layers=1", "backbone.memory.mem_len=4", "agent.prev_action=true",
       "train.steps=4", "train.progress=false", "device=cpu", "eval.every=0", "eval.at_end=true",
       "eval.episodes=1", "eval.n_envs=1"]


@pytest.fixture(scope="module")
def pixel_h5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 episodes of 8 steps of PixelSide-v0: uint8 (2, 36, 36) observations, discrete actions."""
    arr = pixel_dataset_arrays()
    return write_d4rl_h5(tmp_path_factory.mktemp("pixels") / "px.hdf5", n=len(arr["actions"]), env_id=FULL_ID,
                         **arr)


def _config(agent: str, h5: Path, *extra: str):
    name, overrides = AGENTS[agent]
    return compose(name, [*overrides, *COMMON, f"dataset.path={h5}", *extra])


@pytest.mark.parametrize("encoder", ["nature_cnn", "impala_cnn"])
@pytest.mark.parametrize("agent", ["dt", "bc", "gtrxl"])
def test_each_agent_trains_two_updates_on_pixels_and_evaluates_an_episode(pixel_h5: Path, tmp_path: Path,
                                                                           agent: str, encoder: str) -> None:
    run = tmp_path / "run"
    train(_config(agent, pixel_h5, f"agent.encoder.kind={encoder}"), run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)
    returns = [r["eval/return_mean"] for r in rows if "eval/return_mean" in r]
    assert len(returns) == 1 and 0.0 <= returns[0] <= 8.0 and returns[0] == int(returns[0])
    loaded = load_run(run)  # the checkpoint rebuilds the CNN from its record (no dataset read)
    enc = loaded.agent.model.encoder.encode_obs if agent == "gtrxl" else loaded.agent.model.encode_obs
    assert type(enc).__name__ == {"nature_cnn": "NatureCNN", "impala_cnn": "ImpalaCNN"}[encoder]
    assert enc.obs_shape == (2, 36, 36)


def test_image_observations_are_never_standardised(pixel_h5: Path) -> None:
    ds = load_dataset(str(pixel_h5))
    info = DatasetInfo.from_dataset(ds, normalize_obs=True)
    assert info.image_obs and info.obs_shape == (2, 36, 36) and info.obs_dim == 2 * 36 * 36
    assert np.array_equal(info.obs_mean, np.zeros(2592, np.float32))
    assert np.array_equal(info.obs_std, np.ones(2592, np.float32))
    back = DatasetInfo.from_extra(info.to_extra())
    assert back.image_obs and back.obs_shape == (2, 36, 36)
    old = {k: v for k, v in info.to_extra().items() if k not in ("obs_shape", "image_obs")}  # an older checkpoint
    assert DatasetInfo.from_extra(old).obs_shape == (2592,) and not DatasetInfo.from_extra(old).image_obs


def test_the_dt_hands_pixels_to_its_encoder_as_the_sampler_gives_them(pixel_h5: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    agent = build_agent(_config("dt", pixel_h5, "agent.encoder.kind=nature_cnn"), tmp_path, torch.device("cpu"))
    batch = {k: torch.as_tensor(v) for k, v in next(iter(agent.batches(0))).items()}
    obs = batch["observations"]
    assert tuple(obs.shape) == (4, 4, 2, 36, 36) and float(obs.max()) > 200  # raw pixel units, not standardised
    assert to_model_batch(batch, agent.info)["obs"] is obs  # no reshape, no cast, no copy


@pytest.mark.parametrize("agent", ["dt", "bc", "gtrxl"])
def test_a_flat_encoder_on_pixels_exits_2_naming_the_option(pixel_h5: Path, tmp_path: Path, agent: str) -> None:
    name, overrides = AGENTS[agent]
    args = ["train", *(["-c", name] if name else []), *overrides, *COMMON, f"dataset.path={pixel_h5}",
            "--run-dir", str(tmp_path / "run")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == (
        f"error: agent.encoder.kind=linear takes flat observations, but the dataset {pixel_h5} has image "
        f"observations of shape (2, 36, 36) uint8 (uint8 (C, H, W)); use an image encoder: "
        f"agent.encoder.kind=impala_cnn or minatar_cnn or nature_cnn")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_cnn_on_vector_observations_exits_2_naming_the_option(tmp_path: Path) -> None:
    h5 = write_d4rl_h5(tmp_path / "cp.hdf5")
    r = CliRunner().invoke(app, ["train", "-c", "dt/cartpole_demo", *AGENTS["dt"][1], *COMMON, f"dataset.path={h5}",
                                 "agent.encoder.kind=nature_cnn", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == (
        f"error: agent.encoder.kind=nature_cnn takes image observations (uint8 (C, H, W)), but the dataset {h5} has "
        f"observations of shape (4,) float32; use a flat encoder: agent.encoder.kind=linear or mlp")
    r = CliRunner().invoke(app, ["train", "-c", "gtrxl/ppo_cartpole", *PPO[1:], "agent.encoder.kind=impala_cnn",
                                 "--run-dir", str(tmp_path / "ppo")])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1].startswith(
        "error: agent.encoder.kind=impala_cnn takes image observations (uint8 (C, H, W)), but the environment "
        "rl_tformers/PositionOnlyCartPole-v1 has observations of shape (2,) float32")


def test_an_unknown_encoder_kind_is_refused_at_compose(pixel_h5: Path) -> None:
    r = CliRunner().invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={pixel_h5}",
                                 "agent.encoder.kind=resnet", "--print-config"])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines()[-1] == (
        "error: agent.encoder: unknown encoder kind 'resnet'; registered kinds: impala_cnn, linear, minatar_cnn, mlp, nature_cnn")


@pytest.mark.parametrize("encoder", ["nature_cnn", "impala_cnn"])
def test_ppo_gtrxl_keeps_uint8_pixels_in_its_rollout_and_trains_the_cnn(tmp_path: Path, encoder: str) -> None:
    torch.manual_seed(0)
    cfg = compose("gtrxl/ppo_cartpole", [*PPO, f"agent.encoder.kind={encoder}"])
    agent = build_agent(cfg, tmp_path, torch.device("cpu"))
    assert not agent.collector.normalize_obs and not agent.collector.update_obs_stats
    ro = agent.collector.collect()
    assert ro[PIXEL_KEY].dtype == torch.uint8 and tuple(ro[PIXEL_KEY].shape) == (8, 2, 2, 36, 36)
    assert tuple(ro["x"].shape) == (8, 2, 2)  # a_{t-1} one-hot beside the pixels, not the features
    mb = {k: v.flatten(0, 1) for k, v in ro.items() if isinstance(v, torch.Tensor)}
    loss, _ = ppo_loss(agent.model, mb, clip_coef=0.2, ent_coef=0.01, vf_coef=0.5, norm_adv=True)
    loss.backward()
    cnn = agent.model.encoder.encode_obs
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in cnn.parameters())
    run = tmp_path / "run"
    train(cfg, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/return_mean"] for r in rows if "eval/return_mean" in r][0] in range(9)


def test_a_pixel_ppo_run_stopped_inside_a_rollout_resumes_bit_identically(tmp_path: Path) -> None:
    """The checkpoint of a stop inside a rollout holds the rollout's uint8 frames; the resumed run
    ends with the uninterrupted run's weights (2 updates per rollout, stopped after update 3)."""
    cfg = compose("gtrxl/ppo_cartpole", [*PPO, "agent.encoder.kind=nature_cnn", "eval.at_end=false"])
    full, split = tmp_path / "full", tmp_path / "split"
    train(cfg, full)
    assert train(cfg, split, stop_at=3).step == 3
    saved = torch.load(split / "checkpoints" / "step_000000003.pt", weights_only=True)
    frames = saved["trainer"]["process_ranks"][0]["rollout"]["tensors"][PIXEL_KEY]
    assert frames.dtype == torch.uint8 and tuple(frames.shape) == (8, 2, 2, 36, 36)
    assert resume(split).step == 4
    a, b = (torch.load(r / "checkpoints" / "step_000000004.pt", weights_only=True) for r in (full, split))
    assert same_bits(a["model"], b["model"]) and same_bits(a["optimizer"], b["optimizer"])


def test_the_flat_path_adds_no_parameter_or_state_key(tmp_path: Path) -> None:
    """``agent.encoder.kind=linear`` (the default) reads the flat observation with the agents' own
    embeddings: no parameter of its own, so checkpoints keep their keys and seeded runs their values."""
    h5 = write_d4rl_h5(tmp_path / "cp.hdf5")
    for agent in ("dt", "bc", "gtrxl"):
        cfg = _config(agent, h5, "agent.env_id=CartPole-v1" if agent == "gtrxl" else "eval.at_end=false")
        model = build_agent(cfg, tmp_path, torch.device("cpu")).model
        assert not [k for k in model.state_dict() if "encode_obs" in k], agent
    dt = build_agent(_config("dt", h5), tmp_path, torch.device("cpu")).model
    assert dt.embed_state.in_features == 4


def test_a_pixel_dt_clamps_the_timestep_of_an_evaluation_episode_past_max_ep_len(pixel_h5: Path,
                                                                                tmp_path: Path) -> None:
    """agent.max_ep_len=8 (the data's longest episode) and 20-step evaluation episodes: with
    timestep_overflow=clamp every step is acted on (steps 8.. reuse timestep 7); with error the
    evaluation stops at step 8 naming agent.max_ep_len."""
    cfg = _config("dt", pixel_h5, "agent.encoder.kind=nature_cnn", "agent.max_ep_len=8",
                  "agent.timestep_overflow=clamp")
    torch.manual_seed(0)
    agent = build_agent(cfg, tmp_path, torch.device("cpu"))
    fed = []
    agent.model.register_forward_hook(lambda m, inp, out: fed.append(int(inp[3][0][inp[4][0]].max())))
    long_episodes = lambda: gym.make(FULL_ID, max_episode_steps=20)  # noqa: E731
    rep = evaluate(agent.policy(), long_episodes, [6.0], episodes=2, n_envs=2, seed=0)
    assert rep.results[0].lengths == [20, 20]
    assert fed == [*range(8), *[7] * 12]
    with pytest.raises(ValueError, match=r"episode step 8 >= agent.max_ep_len=8"):
        evaluate(agent.policy(timestep_overflow="error"), long_episodes, [6.0], episodes=1, n_envs=1)
