"""Per-layer stacks (``backbone.layers``) in the agents: the shipped example configs train, act
and reload in the Decision Transformer and GTrXL, and each agent refuses a layer it cannot
use, naming the layer's entry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
from rl_tformers.agents.gtrxl.agent import GTrXLAgent
from rl_tformers.agents.gtrxl.model import build_backbone, gtrxl_backbone
from rl_tformers.envs.loaders import save_d4rl_hdf5
from rl_tformers.envs.memory_tasks import scripted_dataset

from rl_tformers.backbone import IncompatibleConfig
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import train
from tests.datafiles import write_d4rl_h5

QUICK = ["train.steps=2", "train.batch_size=2", "train.progress=false", "train.log_every=1", "train.warmup_steps=1",
         "train.checkpoint_every=0", "device=cpu"]


def _kinds(model) -> list[tuple[str, str]]:
    return [(type(b.attn).__name__, type(b.attn.position).__name__) for b in model.backbone.blocks]


@pytest.fixture(scope="module")
def hopper_file(tmp_path_factory) -> Path:
    """Hopper-shaped D4RL file (11-dim observations, 3-dim actions), 3 episodes of 10 steps."""
    actions = np.random.default_rng(0).uniform(-1, 1, (30, 3)).astype(np.float32)
    return write_d4rl_h5(tmp_path_factory.mktemp("data") / "hopper.h5", obs_dim=11, env_id="Hopper-v5",
                         discrete=False, actions=actions)


@pytest.fixture(scope="module")
def recall_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "recall-d8.hdf5"
    save_d4rl_hdf5(scripted_dataset("recall", 6, delay=8, seed=0), path)
    return path


@pytest.mark.parametrize(("name", "kinds"), [
    ("dt/hopper_medium_sparse_interleaved", ["StridedAttention", "FixedAttention"] * 2),
    ("dt/hopper_medium_longformer_windows", ["SlidingWindowAttention"] * 3),
])
def test_dt_trains_and_acts_with_the_shipped_per_layer_stacks(tmp_path, hopper_file, name, kinds):
    cfg = compose(name, [f"dataset.path={hopper_file}", "eval.at_end=false", "eval.every=0", *QUICK])
    train(cfg, tmp_path / "run")
    run = load_run(tmp_path / "run")
    model = run.agent.model
    assert [k for k, _ in _kinds(model)] == kinds
    if "windows" in name:
        assert [b.attn.window for b in model.backbone.blocks] == [6, 12, 24]
    policy = run.agent.policy()
    state = policy.initial_state(2, 100.0)
    for t in range(3):
        start = np.full(2, t == 0)
        action, state = policy.act(np.zeros((2, 11), np.float32), state, start, None if t == 0 else np.zeros(2))
        assert action.shape == (2, 3) and np.isfinite(action).all()


def test_dt_per_layer_windows_equal_the_kind_s_own_per_layer_tuple():
    """backbone.layers merging one field per layer builds what sliding_window's own per-layer
    ``window`` tuple builds: the same parameters give the same actions, exactly."""
    bb = {"d_model": 32, "n_layers": 3, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0}
    stacks = [{"attention": {"kind": "sliding_window", "window": 6},
               "layers": [{}, {"attention": {"window": 12}}, {"attention": {"window": 24}}]},
              {"attention": {"kind": "sliding_window", "window": [6, 12, 24]}}]
    outs = []
    for stack in stacks:
        torch.manual_seed(0)
        model = DecisionTransformer(DTConfig(obs_dim=4, act_dim=2, context_len=10, embed_dropout=0.0,
                                             backbone={**bb, **stack})).eval()
        g = torch.Generator().manual_seed(1)
        obs, act, rtg = torch.randn(2, 10, 4, generator=g), torch.rand(2, 10, 2, generator=g), torch.randn(2, 10, generator=g)
        outs.append(model(obs, act, rtg, torch.arange(10).repeat(2, 1), torch.ones(2, 10, dtype=torch.bool)).action)
    assert torch.equal(outs[0], outs[1])


def test_dt_refuses_a_window_longer_than_one_layer_s_kernel_takes():
    with pytest.raises(ValueError, match=r"more than attention kind 'sinkhorn' takes: "
                                         r"backbone\.layers\[1\]\.attention\.max_len=16; lower agent\.context_len "
                                         r"or raise backbone\.layers\[1\]\.attention\.max_len"):
        DTConfig(obs_dim=4, act_dim=2, context_len=20, backbone={
            "n_layers": 2, "layers": [{}, {"attention": {"kind": "sinkhorn", "max_len": 16, "block_size": 4}}]})


@pytest.mark.parametrize(("name", "kinds"), [
    ("gtrxl/recall_routing_top2", [("Local1DAttention", "XLRelativePosition")] * 2
     + [("RoutingAttention", "RotaryPosition")] * 2),
    ("gtrxl/recall_local_dense_top", [("Local1DAttention", "XLRelativePosition")] * 2
     + [("DenseAttention", "XLRelativePosition")]),
])
def test_gtrxl_trains_acts_with_memory_and_reloads_with_the_shipped_per_layer_stacks(tmp_path, recall_file, name, kinds):
    cfg = compose(name, [f"dataset.path={recall_file}", "backbone.d_model=16", "agent.seq_len=8", "agent.burn_in=4",
                         "eval.at_end=true", "eval.episodes=1", "eval.n_envs=1", *QUICK])
    result = train(cfg, tmp_path / "run")
    assert 0.0 <= result.last_eval["eval/return_mean"] <= 32.0  # acted step by step with the XL memory
    run = load_run(tmp_path / "run")
    assert _kinds(run.agent.model.encoder) == kinds
    fresh = GTrXLAgent(run.cfg, None, "cpu")
    fresh.model.load_state_dict(run.agent.model.state_dict())
    actions = []
    for agent in (run.agent, fresh):
        policy, env = agent.policy(), agent.make_env()()
        obs, _ = env.reset(seed=3)
        state, start, last_r, acts = policy.initial_state(1), np.array([True]), None, []
        for _ in range(12):
            a, state = policy.act(obs[None], state, start, last_r)
            obs, r, term, trunc, _ = env.step(a[0])
            acts.append(int(a[0]))
            start, last_r = np.array([term or trunc]), np.array([r])
        actions.append(acts)
    assert actions[0] == actions[1]


def test_gtrxl_refuses_a_layer_without_memory_keys_or_causal_form_naming_it():
    bb = gtrxl_backbone(d_model=16, n_layers=3, n_heads=2, mem_len=4)
    with pytest.raises(IncompatibleConfig, match=r"^gtrxl: backbone\.layers\[2\]\.attention\.kind='sinkhorn' "
                                                 r"\(layer 2\) takes no memory keys"):
        build_backbone({**bb, "position": {"kind": "rotary"},
                        "layers": [{}, {}, {"attention": {"kind": "sinkhorn", "block_size": 4}}]})
    with pytest.raises(IncompatibleConfig, match=r"^gtrxl: backbone\.layers\[1\]\.attention\.kind='longformer' "
                                                 r"\(layer 1\) has no causal form"):
        build_backbone({**bb, "layers": [{}, {"attention": {"kind": "longformer"}}, {}]})
