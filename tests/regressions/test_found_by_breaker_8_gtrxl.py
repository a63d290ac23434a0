"""Defects found by the eighth breaker pass over the offline GTrXL agent (``agent.kind=gtrxl``):

1. ``--resume`` of a GTrXL run went on training on a dataset that had changed since the
   checkpoint, with the checkpoint's statistics (the Decision Transformer refuses it);
2. a discrete a_{t-1} input at an episode start was the one-hot of action 0, not zeros: the
   first step of every episode looked like "the previous action was 0", in training and acting;
3. ``agent.burn_in`` of at least the dataset's length minus one trained nothing, silently
   (every gradient window was padding: loss 0, gradient 0 at every update);
4. ``agent.window=W`` with ``agent.seq_len < W`` acted over more earlier steps than training
   ever attended to, silently (the opposite direction already warned).

Every test builds its own tiny data in ``tmp_path`` or in memory (never the repository's
``data/``) and trains for at most a few updates of a 16-wide model.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from rl_tformers.agents.gtrxl.agent import GTRXL_DEFAULTS, GTrXLAgent
from rl_tformers.agents.gtrxl.model import GTrXLConfig, GTrXLModel, gtrxl_backbone
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.memory_tasks import scripted_dataset
from rl_tformers.envs.samplers import SegmentSampler
from rl_tformers.envs.trajectory import ObsStats
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()

TINY = ["agent.seq_len=4", "agent.burn_in=2", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2",
        "backbone.memory.mem_len=4", "train.batch_size=4", "train.warmup_steps=1", "eval.every=0",
        "eval.at_end=false", "train.progress=false", "--device", "cpu"]


def _cfg(**agent) -> OmegaConf:
    return OmegaConf.create({
        "seed": 0,
        "agent": {**GTRXL_DEFAULTS["agent"], "seq_len": 4, "burn_in": 0, **agent},
        "backbone": gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4),
        "dataset": {"scripted": {"task": "recall", "episodes": 4, "delay": 2}},
        "train": {"batch_size": 2, "steps": 1},
        "eval": {"episodes": 1, "n_envs": 1},
    })


# ------------------------------------------------- 1. resume on changed data
def test_resume_refuses_a_dataset_that_changed_since_the_checkpoint(tmp_path: Path) -> None:
    """The recall file behind dataset.path was rewritten between two parts of a GTrXL run (other
    episodes, 30 instead of 20): ``--resume`` trained on it with the checkpoint's observation
    statistics, reward scale and default target and said nothing (exit 0); the DT refused."""
    h5 = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=2, seed=0), h5)
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "gtrxl/recall_bc", f"dataset.path={h5}", "train.steps=2",
                            "train.checkpoint_every=2", *TINY, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3"])  # the same data: resumes
    assert r.exit_code == 0, r.output

    save_d4rl_hdf5(scripted_dataset("recall", 30, delay=2, seed=1), h5)
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the dataset {h5} is not the data this run was trained on: its statistics differ "
                           f"from the checkpoint's (obs_mean: ["), line
    assert "; dataset_return_max: " in line and "; dataset_return_mean: " in line, line
    assert line.endswith("checkpoint -> now); resume with the original data, or start a new run on this dataset"), line
    assert "Traceback" not in r.output

    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=2, seed=0), h5)  # the original data back
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 0, r.output


def test_load_extra_state_refuses_changed_statistics_and_keeps_the_checkpoints_when_equal() -> None:
    """The same refusal in Python (the trainer's resume path), and an equal dataset still takes the
    checkpoint's extra state (reward multiplier and model config included)."""
    agent = GTrXLAgent(_cfg(), None, "cpu")
    saved = {**agent.extra_state(), "reward_mult": 0.25}
    agent.load_extra_state(saved)
    assert agent.extra["reward_mult"] == 0.25
    other = GTrXLAgent(_cfg(), None, "cpu", dataset=scripted_dataset("recall", 6, delay=2, seed=3))
    with pytest.raises(ValueError, match=r"^the dataset built by dataset\.scripted=\{'task': 'recall', 'episodes': 4, 'delay': 2\} is not the data this run "
                                         r"was trained on: its statistics differ from the checkpoint's \("):
        other.load_extra_state(saved)


# ------------------------------------------------- 2. discrete a_{t-1} at an episode start
def _start_segment(agent: GTrXLAgent, episode: int):
    """The training segment whose gradient window starts at the first step of ``episode``."""
    ds, info = agent.dataset, agent.info
    first = int(ds.starts[episode])

    class FixedStart:  # the sampler's first (leading) step: the one before the episode's first
        def integers(self, lo, hi, size):
            return np.full(size, first - 1)

    shape = ds.observation_shape
    sampler = SegmentSampler(ds, agent.seq_len, burn_in=agent.burn_in + 1, reward_scale=info.reward_scale,
                             obs_stats=ObsStats(info.obs_mean.reshape(shape), info.obs_std.reshape(shape)))
    raw = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sampler.sample(1, FixedStart()).items()}
    return agent.to_segments(raw)


def test_discrete_previous_action_is_zeros_at_an_episode_start_in_training_and_acting() -> None:
    """The recall data (4 actions) with agent.prev_action: the a_{t-1} columns of the first token of
    an episode were [1, 0, 0, 0] (action 0) in the training segment and in GTrXLPolicy.act; the
    docs say zeros. Now both are zeros, and a step after action 0 still gets [1, 0, 0, 0]."""
    agent = GTrXLAgent(_cfg(prev_action=True, prev_reward=True), None, "cpu")
    enc = agent.model.encoder
    o = agent.info.obs_dim
    seg = _start_segment(agent, 2)
    assert bool(seg.episode_start[0, 0])
    x = enc.inputs(seg.obs, seg.rtg, seg.prev_action, seg.prev_reward)  # (1, T, O + 4 + 1)
    assert x[0, 0, o:o + 4].tolist() == [0.0, 0.0, 0.0, 0.0]  # was [1, 0, 0, 0]
    data_a = agent.dataset.episode(2).actions
    for t in range(1, agent.seq_len):  # later steps: the one-hot of the data's previous action
        assert x[0, t, o:o + 4].tolist() == np.eye(4)[int(data_a[t - 1])].tolist()

    seen = []
    hook = enc.embed.register_forward_hook(lambda _m, args, _out: seen.append(args[0].detach().clone()))
    try:
        pol = agent.policy()
        state = pol.initial_state(2)
        obs = agent.dataset.episode(2).observations[:2]  # two environments
        _, state = pol.act(obs, state, np.array([True, True]))
        state.prev_action = torch.tensor([0, 2])  # the actions taken
        _, state = pol.act(obs, state, np.array([False, True]), np.array([1.0, 1.0]))
    finally:
        hook.remove()
    assert seen[0][:, 0, o:o + 4].tolist() == [[0.0] * 4, [0.0] * 4]  # both start: zeros (was action 0)
    assert seen[1][0, 0, o:o + 4].tolist() == [1.0, 0.0, 0.0, 0.0]  # after action 0: its one-hot
    assert seen[1][1, 0, o:o + 4].tolist() == [0.0, 0.0, 0.0, 0.0]  # env 1 started again (action 2 forgotten)


def test_models_without_the_field_keep_the_one_hot_of_action_zero() -> None:
    """Checkpoints written before the fix (no ``prev_action_zero_at_start`` in their model config)
    and PPO (whose rollouts feed action 0 at a start) keep the encoding they were trained with."""
    cfg = GTrXLConfig(obs_dim=2, act_dim=3, discrete=True, prev_action_input=True,
                      backbone=gtrxl_backbone(d_model=16, n_layers=1, n_heads=2, mem_len=4))
    assert cfg.prev_action_zero_at_start is False
    enc = GTrXLModel(cfg).encoder
    x = enc.inputs(torch.zeros(1, 2, 2), prev_action=torch.tensor([[-1, 0]]))
    assert x[0, :, 2:].tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    new = GTrXLModel(GTrXLConfig(**{**cfg.__dict__, "prev_action_zero_at_start": True})).encoder
    x = new.inputs(torch.zeros(1, 2, 2), prev_action=torch.tensor([[-1, 0]]))
    assert x[0, :, 2:].tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    agent = GTrXLAgent(_cfg(prev_action=True), None, "cpu")
    assert agent.model_cfg.prev_action_zero_at_start is True and agent.extra["model"]["prev_action_zero_at_start"]


# ------------------------------------------------- 3. burn-in as long as the dataset
def test_burn_in_that_leaves_no_real_step_in_any_window_is_refused() -> None:
    """2 recall episodes = 68 steps, agent.burn_in=67: the sampler's leading step plus 67 burn-in
    steps reach the end of the data from any first step, so every window was padding and the run
    trained on loss 0 with gradient 0, silently."""
    ds = scripted_dataset("recall", 2, delay=2, seed=0)
    assert ds.num_steps == 68
    with pytest.raises(ValueError, match=r"^agent\.burn_in=67: a training segment's gradient window starts 68 steps "
                                         r"after the segment's first step \(one step for a_\{t-1\}, then the burn-in\), "
                                         r"which is drawn uniformly over the dataset's 68 steps: no gradient window "
                                         r"would hold a real step .* use agent\.burn_in below 67"):
        GTrXLAgent(_cfg(burn_in=67), None, "cpu", dataset=ds)
    with pytest.warns(UserWarning, match=r"agent\.burn_in=66: 67 of the dataset's 68 steps .* 99% of the sampled "
                                         r"segments have no real step in their gradient window"):
        agent = GTrXLAgent(_cfg(burn_in=66), None, "cpu", dataset=ds)
    assert agent.burn_in == 66
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GTrXLAgent(_cfg(burn_in=8), None, "cpu", dataset=ds)  # 9 / 68 = 13% of the segments: no warning


# ------------------------------------------------- 4. window longer than the training segment
def test_gtrxl_window_longer_than_the_training_segment_warns() -> None:
    """agent.window=8 with agent.seq_len=4: when acting each step attends to its 7 earlier steps,
    in training to at most 3 (relative distances never trained), silently."""
    bb = {**gtrxl_backbone(d_model=16, n_layers=1, n_heads=2), "memory": {"kind": "none"}}
    cfg = _cfg(window=8, seq_len=4)
    cfg.backbone = bb
    with pytest.warns(UserWarning, match=r"agent\.seq_len=4 < agent\.window=8: when acting a step attends to its 7 "
                                         r"earlier steps, in training to at most 3; set agent\.seq_len=8"):
        GTrXLAgent(cfg, None, "cpu")
    cfg = _cfg(window=8, seq_len=8)
    cfg.backbone = bb
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GTrXLAgent(cfg, None, "cpu")


def test_ppo_fine_tuning_feeds_no_previous_action_at_episode_starts_as_the_offline_encoder_learned(tmp_path) -> None:
    """The offline agent now encodes a discrete a_{t-1} at an episode start as zeros
    (prev_action_zero_at_start); PPO fine-tuned from it fed the one-hot of action 0 there, off
    the distribution its encoder was trained on. PPO from scratch keeps action 0's one-hot."""
    import torch
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=1, seed=0), data)
    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", "agent.prev_action=true", f"dataset.path={data}",
        "train.steps=1", "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false",
        "device=cpu", *tiny,
    ]), tmp_path / "offline")
    ppo_over = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d1-v0", "agent.n_envs=2", "agent.n_steps=6",
                "agent.n_minibatches=1", "device=cpu"]
    torch.manual_seed(0)
    tuned = GTrXLPPO(compose(overrides=[*ppo_over, f"agent.init_checkpoint={tmp_path / 'offline'}"]), None, "cpu")
    assert tuned.model_cfg.prev_action_zero_at_start
    ro = tuned.collect()
    n_act = tuned.model_cfg.act_dim
    prev_a = ro["x"][..., -n_act:]  # inputs [obs ; one-hot a_{t-1}]
    assert torch.equal(prev_a[0], torch.zeros(2, n_act))  # the first step of each episode: no previous action
    assert torch.equal(prev_a[1:].sum(-1), torch.ones(5, 2))  # later steps: the one-hot of the action taken
    scratch = GTrXLPPO(compose(overrides=[*ppo_over, "agent.prev_action=true", *tiny]), None, "cpu")
    assert not scratch.model_cfg.prev_action_zero_at_start
    assert torch.equal(scratch.collect()["x"][0, :, -n_act:], torch.nn.functional.one_hot(torch.zeros(2, dtype=torch.long), n_act).float())


def test_ppo_fine_tuning_says_which_backbone_settings_it_ignores(tmp_path) -> None:
    """Fresh user: `train -c gtrxl/ppo_cartpole_finetune backbone.block.gate=highway` ran the
    checkpoint's GRU-gated backbone silently (a gate sweep gave identical runs) while config.yaml
    recorded gate: highway."""
    import warnings

    import pytest
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO, fine_tune_backbone_changes
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose, to_container
    from rl_tformers.runtime.trainer import train

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=1, seed=0), data)
    tiny = ["backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=2", "backbone.memory.mem_len=4"]
    train(compose(overrides=[
        "agent.kind=gtrxl", "agent.seq_len=2", "agent.burn_in=0", f"dataset.path={data}", "train.steps=1",
        "train.batch_size=2", "train.warmup_steps=0", "train.progress=false", "eval.at_end=false", "device=cpu",
        "backbone.dropout=0.1", *tiny,
    ]), tmp_path / "offline")
    over = ["agent.kind=gtrxl_ppo", "agent.env_id=rl_tformers/Recall-d1-v0", f"agent.init_checkpoint={tmp_path / 'offline'}",
            "agent.n_envs=2", "agent.n_steps=6", "agent.n_minibatches=1", "device=cpu", *tiny,
            "agent.head_hidden=0"]  # the offline run's (another one is warned about, fresh_user_9)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="gtrxl_ppo trains without dropout")
        GTrXLPPO(compose(overrides=over), None, "cpu")  # the same backbone (dropout aside): nothing ignored
    cfg = compose(overrides=[*over, "backbone.block.gate=highway", "backbone.n_layers=3"])
    ignored = fine_tune_backbone_changes(to_container(cfg)["backbone"], to_container(compose(overrides=over))["backbone"], "x")
    assert ignored == ["backbone.block.gate='highway' (the checkpoint's: 'gru')", "backbone.n_layers=3 (the checkpoint's: 1)"]
    with pytest.warns(UserWarning, match=r"ignores the config's backbone\.block\.gate='highway' \(the checkpoint's: 'gru'\); "
                                         r"backbone\.n_layers=3 \(the checkpoint's: 1\) \(config\.yaml still records them\)"):
        ppo = GTrXLPPO(cfg, None, "cpu")
    assert ppo.model_cfg.backbone["block"]["gate"] == "gru" and len(ppo.model.encoder.backbone.blocks) == 1


@pytest.mark.parametrize(("overrides", "first"), [
    (["agent.window=16"], "keeps no memory to rebuild, so agent.burn_in=16 has nothing to warm up"),
    (["agent.window=16", "agent.burn_in=0", "agent.seq_len=16"], "carries memory; use agent.window=0"),
    (["backbone.depth={kind: universal}"], "backbone.depth.kind='universal' keeps no state between calls"),
])
def test_window_mode_errors_give_the_whole_recipe(tmp_path, overrides, first) -> None:
    """Fresh user: window mode took two failed attempts (each error named one missing setting), and
    universal depth failed with a generic error that did not point at the window mode."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5
    from rl_tformers.envs.memory_tasks import scripted_dataset

    from rl_tformers.runtime.run_config import compose
    from rl_tformers.runtime.trainer import Trainer

    data = tmp_path / "recall.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 20, delay=8, seed=0), data)
    with pytest.raises(Exception) as exc:
        Trainer(compose("gtrxl/recall_bc", [f"dataset.path={data}", "device=cpu", "train.progress=false", *overrides]),
                tmp_path / "run")
    msg = str(exc.value)
    assert first in msg
    assert "backbone.memory.kind=none agent.burn_in=0 agent.seq_len=" in msg


def test_fine_tuning_from_a_run_not_trained_yet_names_the_option_and_the_command(tmp_path) -> None:
    """Fresh user: `train -c gtrxl/ppo_cartpole_finetune` before the offline run said only
    "runs/gtrxl/cartpole_gtrxl_bc: cannot be loaded (FileNotFoundError ...)"."""
    from rl_tformers.agents.gtrxl.ppo import GTrXLPPO

    from rl_tformers.runtime.run_config import compose

    missing = tmp_path / "not_trained"
    cfg = compose("gtrxl/ppo_cartpole_finetune", [f"agent.init_checkpoint={missing}", "device=cpu"])
    with pytest.raises(ValueError, match=rf"^agent\.init_checkpoint={missing}: no such run directory or checkpoint "
                                         rf"file; train the offline gtrxl run there first .*`rl-tformers train -c "
                                         rf"gtrxl/cartpole_positions_bc run_dir={missing}`"):
        GTrXLPPO(cfg, None, "cpu")
