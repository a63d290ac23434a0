"""Defects found by breaker 6 in the offline agents' Box actions (and the encoder-decoder's
cross-attention check); each test failed before its fix.

1. A Box action space of more than one axis (``Box(low, high, shape=(2, 2))``): the samplers
   hand the agents ``(B, K, 2, 2)`` actions, which DT, BC and offline GTrXL mapped to [-1, 1]
   with the flat (4,) bounds (the first update died with "The size of tensor a (2) must match
   the size of tensor b (4)"), and their policies would have handed the vector environment
   flat ``(N, 4)`` actions: :class:`DatasetInfo` did not record the action shape.
2. ``cross_attention.kind=sinkhorn`` (queries must be its keys) was refused only at the first
   forward pass, with a message about "prefix keys (memory)" that did not name the option.
"""

from __future__ import annotations

import json
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rl_tformers.backbone_config import IncompatibleConfig
from rl_tformers.cli import app
from rl_tformers.runtime.run_config import compose
from rl_tformers.runtime.trainer import resume, train

runner = CliRunner()
STEPS = 4  # episode length of ShapedActionEnv


class ShapedActionEnv(gym.Env):
    """Box(3) observations; a Box action of ``shape`` whose components all have other bounds
    (component j of the C-order flattening: ``[-2 + j / 4, -2 + j / 4 + j + 1]``); 4 steps.

    Every action received is checked (shape and bounds) and its shape recorded in
    :attr:`received` (class level: the evaluation's vector envs are synchronous)."""

    received: list[tuple[int, ...]] = []

    def __init__(self, shape: tuple[int, ...] = (2, 2)) -> None:
        n = math.prod(shape)
        low = (-2.0 + np.arange(n) / 4).reshape(shape).astype(np.float32)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
        self.action_space = gym.spaces.Box(low, low + np.arange(1, n + 1, dtype=np.float32).reshape(shape))
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        a = np.asarray(action)
        ShapedActionEnv.received.append(tuple(a.shape))
        if a.shape != self.action_space.shape or not self.action_space.contains(a.astype(np.float32)):
            raise AssertionError(f"ShapedActionEnv{self.action_space.shape} got the action {a!r}")
        self.t += 1
        flat = a.reshape(-1)
        return np.array([self.t, flat[0], flat[-1]], np.float32), float(flat[0]), False, self.t >= STEPS, {}


MATRIX_ENV, VECTOR_ENV = "breaker6actions/Matrix-v0", "breaker6actions/Vector-v0"
for _id, _shape in ((MATRIX_ENV, (2, 2)), (VECTOR_ENV, (3,))):
    if _id not in gym.registry:
        gym.register(_id, entry_point=ShapedActionEnv, kwargs={"shape": _shape})

FAST = ["train.steps=2", "train.batch_size=4", "train.warmup_steps=1", "train.progress=false", "device=cpu",
        "eval.every=0", "eval.episodes=2", "eval.n_envs=2"]
TINY = {
    "dt": ["agent.kind=dt", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=3",
           "agent.max_ep_len=20", "agent.eval_figure=false"],
    "bc": ["agent.kind=bc", "agent.hidden=[8]"],
    "gtrxl": ["agent.kind=gtrxl", "backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1",
              "agent.seq_len=3", "agent.burn_in=1", "agent.prev_action=true"],
}


def _dataset(env_id: str, episodes: int = 4):
    """Episodes of ShapedActionEnv with actions drawn uniformly in its box, in the box's shape."""
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset

    space = gym.make(env_id).action_space
    rng = np.random.default_rng(0)
    eps = [{"observations": rng.normal(size=(STEPS + 1, 3)).astype(np.float32),
            "actions": rng.uniform(space.low, space.high, (STEPS, *space.shape)).astype(np.float32),
            "rewards": rng.normal(size=STEPS), "terminations": np.zeros(STEPS, bool),
            "truncations": np.r_[np.zeros(STEPS - 1, bool), True]} for _ in range(episodes)]
    return EpisodeDataset.from_episodes(eps, observation_space=gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                                        action_space=space, metadata=DatasetMetadata(env_id=env_id))


@pytest.fixture(scope="module")
def matrix_h5(tmp_path_factory):
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    return save_d4rl_hdf5(_dataset(MATRIX_ENV), tmp_path_factory.mktemp("data") / "matrix.hdf5")


# ------------------------------------------------- 1. the data layer and DatasetInfo
def test_loaded_actions_keep_the_box_shape_and_dataset_info_records_it(matrix_h5) -> None:
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset

    for lazy in (False, True):
        ds = load_dataset(str(matrix_h5), lazy=lazy)
        assert ds.actions.shape == (4 * STEPS, 2, 2) and ds.action_space.shape == (2, 2)
    info = DatasetInfo.from_dataset(ds)
    assert (info.act_dim, info.action_shape, info.discrete) == (4, (2, 2), False)
    space = gym.make(MATRIX_ENV).action_space
    np.testing.assert_array_equal(info.action_low, space.low.reshape(-1))
    np.testing.assert_array_equal(info.action_high, space.high.reshape(-1))
    extra = info.to_extra()
    assert extra["action_shape"] == [2, 2]
    assert DatasetInfo.from_extra(extra).action_shape == (2, 2)


def test_checkpoints_without_the_field_read_as_flat_box_or_scalar_discrete(matrix_h5) -> None:
    """Extra state written before ``action_shape`` existed (only 1-D Boxes could be trained)."""
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset

    box = DatasetInfo.from_dataset(_dataset(VECTOR_ENV)).to_extra()
    assert box.pop("action_shape") == [3]
    assert DatasetInfo.from_extra(box).action_shape == (3,)
    from rl_tformers.envs.memory_tasks import scripted_dataset

    disc = DatasetInfo.from_dataset(scripted_dataset("recall", 4, delay=2, seed=0)).to_extra()
    assert disc.pop("action_shape") == []
    assert DatasetInfo.from_extra(disc).action_shape == ()
    good = DatasetInfo.from_dataset(load_dataset(str(matrix_h5))).to_extra()
    with pytest.raises(ValueError, match=r"action_shape=\(3, 2\) does not hold act_dim=4"):
        DatasetInfo.from_extra({**good, "action_shape": [3, 2]})
    with pytest.raises(ValueError, match=r"action_shape=\(2,\) for discrete actions"):
        DatasetInfo.from_extra({**disc, "action_shape": [2]})


def test_a_file_of_flat_actions_for_a_matrix_box_is_refused_naming_both_shapes(tmp_path) -> None:
    """(N, 4) actions for an environment whose actions are Box(2, 2): the loader dropped the
    environment's space silently (then: "continuous actions need a bounded Box ... set
    dataset.env_id", though it was set); never reshaped silently either."""
    import h5py
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_d4rl_hdf5

    ds = _dataset(MATRIX_ENV, episodes=2)
    path = tmp_path / "flat.hdf5"
    with h5py.File(path, "w") as f:
        f["observations"] = ds.observations
        f["actions"] = ds.actions.reshape(len(ds.actions), 4)
        f["rewards"] = ds.rewards
        f["terminals"] = ds.terminations
        f["timeouts"] = ds.truncations
        f.attrs["env_id"] = MATRIX_ENV
    with pytest.raises(DatasetError, match=r"stores actions of shape \(4,\) per step.*\(N, 2, 2\)") as err:
        load_d4rl_hdf5(path)
    assert err.value.field == "actions"


def test_training_batches_flatten_the_box_in_c_order_like_the_bounds(matrix_h5) -> None:
    """The models see (.., A=4) in [-1, 1]: component (i, j) goes to 2 i + j, normalised with its own bounds."""
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.agents.decision_transformer.agent import to_model_batch
    from rl_tformers.agents.gtrxl.agent import segment_batch
    from rl_tformers.envs.loaders import load_dataset

    info = DatasetInfo.from_dataset(load_dataset(str(matrix_h5)))
    low, high = gym.make(MATRIX_ENV).action_space.low, gym.make(MATRIX_ENV).action_space.high
    act = torch.as_tensor(np.stack([low, high, (low + high) / 2]))  # (3, 2, 2): -1, 1, 0 in model units
    want = torch.tensor([-1.0, 1.0, 0.0])[:, None].expand(3, 4)
    b = to_model_batch({"actions": act[None], "observations": torch.zeros(1, 3, 3),
                        "returns_to_go": torch.zeros(1, 3), "timesteps": torch.zeros(1, 3, dtype=torch.long),
                        "mask": torch.ones(1, 3, dtype=torch.bool)}, info)
    assert torch.equal(b["actions"][0], want)
    seg = segment_batch({"actions": act[None], "observations": torch.zeros(1, 3, 3), "rewards": torch.zeros(1, 3),
                         "returns_to_go": torch.zeros(1, 3), "timesteps": torch.zeros(1, 3, dtype=torch.long),
                         "mask": torch.ones(1, 3, dtype=torch.bool), "episode_start": torch.zeros(1, 3, dtype=torch.bool),
                         "terminations": torch.zeros(1, 3, dtype=torch.bool)},
                        burn_in=0, discrete=False, action_low=torch.as_tensor(info.action_low),
                        action_high=torch.as_tensor(info.action_high))
    assert torch.equal(seg.actions[0], want[1:]) and torch.equal(seg.prev_action[0], want[:2])


# ------------------------------------------------- 2. train, resume, evaluate: the env gets (2, 2) actions
@pytest.mark.parametrize("kind", ["dt", "bc", "gtrxl"])
def test_offline_agents_train_resume_and_evaluate_with_box_actions_in_the_envs_shape(matrix_h5, tmp_path,
                                                                                     kind) -> None:
    from rl_tformers.runtime.loading import load_run

    run_dir = tmp_path / "run"
    cfg = compose(None, [*TINY[kind], f"dataset.path={matrix_h5}", *FAST, "eval.at_end=true"])
    train(cfg, run_dir, stop_at=1)  # checkpoint at step 1, no evaluation yet
    ShapedActionEnv.received.clear()
    resume(run_dir)  # the extra state comes back from the checkpoint; evaluates at the end (2 episodes)
    assert len(ShapedActionEnv.received) >= 2 * STEPS and set(ShapedActionEnv.received) == {(2, 2)}
    run = load_run(run_dir)
    assert run.extra["action_shape"] == [2, 2] and run.agent.info.action_shape == (2, 2)
    policy = run.agent.policy()
    actions, _ = policy.act(np.zeros((3, 3), np.float32), policy.initial_state(3), np.ones(3, bool))
    assert actions.shape == (3, 2, 2) and actions.dtype == np.float32
    ShapedActionEnv.received.clear()
    r = runner.invoke(app, ["eval", str(run_dir), "--episodes", "2", "--envs", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["results"][0]["lengths"] == [STEPS, STEPS]
    assert len(ShapedActionEnv.received) >= 2 * STEPS and set(ShapedActionEnv.received) == {(2, 2)}


@pytest.mark.parametrize("kind", ["dt", "bc", "gtrxl"])
def test_eval_of_a_checkpoint_from_before_the_field_acts_with_flat_box_actions(tmp_path, kind) -> None:
    """A run saved before ``action_shape`` was recorded (1-D Box actions then): `rl-tformers eval RUN`
    reads it as the flat shape and acts exactly as before."""
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    from rl_tformers.runtime.checkpoint import find_latest_valid, load_checkpoint, save_checkpoint

    h5 = save_d4rl_hdf5(_dataset(VECTOR_ENV, episodes=2), tmp_path / "vector.hdf5")
    run_dir = tmp_path / "run"
    train(compose(None, [*TINY[kind], f"dataset.path={h5}", *FAST, "train.steps=1", "eval.at_end=false"]), run_dir)
    found = find_latest_valid(run_dir)
    state = load_checkpoint(found.path)
    assert state["extra"].pop("action_shape") == [3]
    save_checkpoint(run_dir, state)
    assert "action_shape" not in load_checkpoint(find_latest_valid(run_dir).path)["extra"]
    ShapedActionEnv.received.clear()
    r = runner.invoke(app, ["eval", str(run_dir), "--episodes", "2", "--envs", "2"])
    assert r.exit_code == 0, r.output
    assert len(ShapedActionEnv.received) >= 2 * STEPS and set(ShapedActionEnv.received) == {(3,)}


def test_policies_return_the_flat_actions_in_the_envs_shape(matrix_h5) -> None:
    """Each policy's (N, 2, 2) action is its flat (N, 4) action (the policy without the shape),
    reshaped in C order; a shape that does not hold A values is refused."""
    from rl_tformers.agents.decision_transformer.policy import DTPolicy
    from rl_tformers.agents.gtrxl.agent import GTrXLPolicy

    cfgs = {k: compose(None, [*TINY[k], f"dataset.path={matrix_h5}", *FAST]) for k in ("dt", "gtrxl")}
    from rl_tformers.agents.decision_transformer.agent import DTAgent
    from rl_tformers.agents.gtrxl.agent import GTrXLAgent

    torch.manual_seed(0)
    obs = np.random.default_rng(1).normal(size=(3, 3)).astype(np.float32)
    start = np.ones(3, bool)
    dt = DTAgent(cfgs["dt"], None, "cpu")
    shaped = dt.policy()
    flat = DTPolicy(dt.model, dt.info.obs_mean, dt.info.obs_std, dt.info.reward_scale, dt.info.action_low,
                    dt.info.action_high, default_target=shaped.default_target)
    a, _ = shaped.act(obs, shaped.initial_state(3), start)
    b, _ = flat.act(obs, flat.initial_state(3), start)
    assert a.shape == (3, 2, 2) and b.shape == (3, 4) and np.array_equal(a.reshape(3, 4), b)
    with pytest.raises(ValueError, match=r"DTPolicy: action_shape=\(3,\) does not hold the model's 4"):
        DTPolicy(dt.model, dt.info.obs_mean, dt.info.obs_std, 1.0, dt.info.action_low, dt.info.action_high,
                 action_shape=(3,))
    g = GTrXLAgent(cfgs["gtrxl"], None, "cpu")
    shaped_g = g.policy()
    flat_g = GTrXLPolicy(g.model, obs_mean=g.info.obs_mean, obs_std=g.info.obs_std, action_low=g.info.action_low,
                         action_high=g.info.action_high, rtg_scale=g.info.reward_scale)
    a, _ = shaped_g.act(obs, shaped_g.initial_state(3), start)
    b, _ = flat_g.act(obs, flat_g.initial_state(3), start)
    assert a.shape == (3, 2, 2) and b.shape == (3, 4) and np.array_equal(a.reshape(3, 4), b)


# ------------------------------------------------- 3. encoder-decoder: cross-attention kinds that need S == T
def test_sinkhorn_cross_attention_is_refused_at_construction_naming_the_option() -> None:
    from rl_tformers.encoder_decoder import EncoderDecoderConfig

    with pytest.raises(IncompatibleConfig, match=r"cross_attention\.kind='sinkhorn' .*its queries must be its keys"):
        EncoderDecoderConfig.from_dict({"cross_attention": {"kind": "sinkhorn", "block_size": 2, "max_len": 16}})


def test_cross_attention_capability_is_truthful_for_every_attention_kind() -> None:
    """Kinds declaring ``cross_attention`` run with S > T and S < T source keys; the others are
    refused when the config is built."""
    from rl_tformers.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
    from rl_tformers.registry import ATTENTION

    small = {"d_model": 16, "n_layers": 1, "n_heads": 2, "attn_dropout": 0.0, "dropout": 0.0}
    src = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(0))
    tgt = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    for e in ATTENTION:
        spec = {"encoder": small, "decoder": small, "cross_attention": {"kind": e.kind}}
        if not (e.capabilities.cross_attention and e.capabilities.bidirectional):
            with pytest.raises(IncompatibleConfig, match=rf"cross_attention\.kind='{e.kind}'"):
                EncoderDecoderConfig.from_dict(spec)
            continue
        torch.manual_seed(0)
        model = EncoderDecoder(spec).eval()
        for s, t in ((src, tgt), (src[:, :4], tgt)):
            out = model(s, t).hidden
            assert out.shape == t.shape and torch.isfinite(out).all(), e.kind
