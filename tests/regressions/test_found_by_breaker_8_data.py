"""Defects found by the eighth breaker pass over the data layer and the Decision Transformer:

1. start-aligned training windows of episodes shorter than K laid out unlike the evaluation
   context (left- vs right-padded: different slots for absolute positions and index-aligned
   attention patterns);
2. a resume that trained on a changed dataset with the checkpoint's stale statistics;
3. ``dataset.env_id`` ignored (with an error telling the user to set it) for a file whose own
   ``action_space`` attribute is unbounded, and the unbounded-actions error not saying why the
   named task gave no bounds;
4. in-memory ``EpisodeDataset`` of uint8 observations failing in gymnasium, boolean columns
   passing or failing without naming the field;
5. a discarded filler episode of the vector evaluation stopping a DT evaluation at max_ep_len;
6. D4RL reference scores taken from a parent folder's name (a Pendulum file under hopper_*/);
7. a Discrete evaluation environment with fewer actions than the data accepted.

Every test builds its own tiny data in ``tmp_path`` (never the repository's ``data/``) and
trains for at most a few updates of a 16-wide model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()

TINY = ["train.batch_size=4", "backbone.d_model=16", "backbone.n_layers=1", "agent.context_len=4",
        "eval.every=0", "eval.at_end=false", "train.progress=false", "train.warmup_steps=1", "--device", "cpu"]


# ------------------------------------------------- 1. short episodes: training layout = acting layout
K, L = 6, 3  # an episode shorter than the window


def _short_episode():
    from rl_tformers.envs.dataset import EpisodeDataset

    rng = np.random.default_rng(0)
    obs = rng.normal(size=(L + 1, 2)).astype(np.float32)
    act = rng.uniform(-1, 1, (L, 1)).astype(np.float32)
    ds = EpisodeDataset.from_episodes([{
        "observations": obs, "actions": act, "rewards": np.array([1.0, 2.0, 3.0]),
        "terminations": np.array([False, False, True]), "truncations": np.zeros(L, bool),
    }], action_space=gym.spaces.Box(-1.0, 1.0, (1,), np.float32))
    return ds, obs, act


def test_start_aligned_window_of_a_short_episode_starts_at_slot_0() -> None:
    """The sampler put an episode shorter than K in the *last* slots (left padding), while the
    policy acting with ``align="start"`` writes step t at slot t: a model trained on such windows
    never saw, at training time, the slots it acts with."""
    from rl_tformers.envs.samplers import WindowSampler

    ds, obs, _ = _short_episode()
    b = WindowSampler(ds, K).sample(2, np.random.default_rng(0))
    assert b["mask"].tolist() == [[True] * 3 + [False] * 3] * 2
    assert b["timesteps"].tolist() == [[0, 1, 2, 0, 0, 0]] * 2
    assert b["returns_to_go"].tolist() == [[6.0, 5.0, 3.0, 0.0, 0.0, 0.0]] * 2
    np.testing.assert_array_equal(b["observations"][0, :3], obs[:3])
    assert (b["observations"][:, 3:] == 0).all()
    # end-aligned windows keep their layout: the window ends at slot K - 1, padding on the left
    e = WindowSampler(ds, K, align="end").sample(64, np.random.default_rng(1))
    assert e["mask"][:, -1].all() and not e["mask"][:, 0].any()


@pytest.mark.parametrize("backbone", [
    {"position": {"kind": "learned"}},
    {"position": {"kind": "sinusoidal"}},
    {"attention": {"kind": "fixed", "stride": 4, "summary": 1}},
], ids=["learned-positions", "sinusoidal-positions", "fixed-attention"])
def test_policy_actions_equal_the_model_on_training_windows_of_a_short_episode(backbone) -> None:
    """With absolute positions or a pattern laid over token indices, the action the policy took at
    step t of a short episode differed from the model's prediction at step t of the training
    window of that episode (e.g. 0.0254 vs 0.02364 with learned positions, 0.0351 vs 0.06656 with
    fixed attention): the docs' "same context layout as training" did not hold below K steps."""
    from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
    from rl_tformers.agents.decision_transformer.policy import DTPolicy
    from rl_tformers.envs.samplers import WindowSampler

    torch.manual_seed(0)
    bb = {"d_model": 16, "n_layers": 2, "n_heads": 2, "dropout": 0.0, "attn_dropout": 0.0, "causal": True,
          **backbone}
    cfg = DTConfig(obs_dim=2, act_dim=1, context_len=K, max_ep_len=50, embed_dropout=0.0, backbone=bb)
    model = DecisionTransformer(cfg).eval()
    ds, obs, act = _short_episode()
    b = {k: torch.as_tensor(v) for k, v in WindowSampler(ds, K).sample(1, np.random.default_rng(0)).items()}
    with torch.no_grad():
        train = model(b["observations"], b["actions"], b["returns_to_go"], b["timesteps"], b["mask"]).action
    train = train[0, b["mask"][0], 0].numpy()  # (L,) prediction at each real step, training layout

    pol = DTPolicy(model, np.zeros(2), np.ones(2), 1.0, np.array([-1.0]), np.array([1.0]))
    state = pol.initial_state(1, 6.0)  # the episode's return: the training window's RTG at step 0
    acted = []
    for t in range(L):
        a, state = pol.act(obs[t:t + 1], state, np.array([t == 0]), None if t == 0 else np.array([float(t)]))
        state.actions[0, t] = torch.as_tensor(act[t])  # the dataset's action, as in the training window
        acted.append(float(a[0, 0]))
    np.testing.assert_allclose(acted, train, rtol=0, atol=1e-6)


# ------------------------------------------------- 2. resume on changed data
TINY_BC = ["train.batch_size=4", "agent.hidden=[16]", "eval.every=0", "eval.at_end=false", "train.progress=false",
           "train.warmup_steps=1", "--device", "cpu"]


@pytest.mark.parametrize(("config", "tiny"), [("dt/cartpole_demo", TINY), ("bc/hopper_medium", TINY_BC)], ids=["dt", "bc"])
def test_resume_refuses_a_dataset_that_changed_since_the_checkpoint(tmp_path: Path, cartpole_h5, config, tiny) -> None:
    """The data behind dataset.path was rewritten between two parts of a run (rewards x 100, other
    observations): ``--resume`` went on training on it with the checkpoint's reward scale, observation
    statistics and default target (10, the old best return) and said nothing (the DT first; BC
    kept doing so after the DT refused it)."""
    h5 = cartpole_h5(tmp_path / "d.hdf5")
    keep = tmp_path / "original.hdf5"
    shutil.copy(h5, keep)
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", config, f"dataset.path={h5}", "train.steps=2",
                            "train.checkpoint_every=2", *tiny, "--run-dir", str(run)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=3"])  # the same data: resumes
    assert r.exit_code == 0, r.output

    cartpole_h5(h5, n=50, seed=1, reward=100.0)
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: the dataset {h5} is not the data this run was trained on: its statistics differ "
                           f"from the checkpoint's (obs_mean: ["), line
    assert ("reward_scale: 10 -> 1000; dataset_return_max: 10 -> 1000; dataset_return_mean: 10 -> 1000; "
            "dataset_return_min: 10 -> 1000; num_steps: 30 -> 50; action_mean: [") in line
    assert line.endswith("checkpoint -> now); resume with the original data, or start a new run on this dataset")
    assert "Traceback" not in r.output

    shutil.copy(keep, h5)  # the original data back: the run continues
    r = runner.invoke(app, ["train", "--resume", str(run), "train.steps=4"])
    assert r.exit_code == 0, r.output


def test_data_differences_of_equal_statistics_is_empty(tmp_path: Path, cartpole_h5) -> None:
    from rl_tformers.agents.common.offline import DatasetInfo, load_offline_dataset

    spec = {"path": str(cartpole_h5(tmp_path / "d.hdf5"))}
    a = DatasetInfo.from_dataset(load_offline_dataset(spec))
    b = DatasetInfo.from_dataset(load_offline_dataset({**spec, "lazy": True}))
    assert a.data_differences(DatasetInfo.from_extra(a.to_extra())) == []
    assert a.data_differences(b) == []  # the lazy reading of the same file: equal up to rounding


# ------------------------------------------------- 3. dataset.env_id and the file's action_space attribute
def _unbounded_file(tmp_path: Path, env_id: str | None, act_dim: int = 1) -> Path:
    """A file written by save_d4rl_hdf5 from data without bounds: its action_space attribute is
    Box(-inf, inf)."""
    from rl_tformers.envs.dataset import DatasetMetadata, EpisodeDataset
    from rl_tformers.envs.loaders import save_d4rl_hdf5

    n = 12
    rng = np.random.default_rng(0)
    ds = EpisodeDataset.from_flags(
        rng.normal(size=(n, 3)).astype(np.float32), rng.uniform(-1, 1, (n, act_dim)).astype(np.float32),
        np.ones(n), np.eye(1, n, n - 1)[0], metadata=DatasetMetadata(env_id=env_id))
    assert not np.isfinite(ds.action_space.high).any()
    return save_d4rl_hdf5(ds, tmp_path / "unbounded.hdf5")


def test_dataset_env_id_bounds_the_actions_of_a_file_with_an_unbounded_action_space_attribute(tmp_path) -> None:
    """``dataset.env_id=Pendulum-v1`` (documented: the task whose action space bounds the actions)
    was ignored: the file's own unbounded action_space attribute came first, and training was
    refused with "... set dataset.env_id=<gymnasium id>", the option already set."""
    from rl_tformers.agents.common.offline import DatasetInfo, load_offline_dataset

    h5 = _unbounded_file(tmp_path, "Pendulum-v1")
    ds = load_offline_dataset({"path": str(h5), "env_id": "Pendulum-v1"})
    assert ds.action_space == gym.spaces.Box(-2.0, 2.0, (1,), np.float32)
    info = DatasetInfo.from_dataset(ds)
    assert info.action_low.tolist() == [-2.0] and info.action_high.tolist() == [2.0]

    without = load_offline_dataset({"path": str(h5)})  # the file's attribute: unbounded, and said so
    with pytest.raises(ValueError) as e:
        DatasetInfo.from_dataset(without)
    assert ("; the file's own action_space attribute (Box(-inf, inf, (1,), float32)) was read before the action "
            "space Box(-2.0, 2.0, (1,), float32) of its env_id attribute 'Pendulum-v1': set "
            "dataset.env_id=Pendulum-v1 to take that task's bounds; set dataset.env_id=") in str(e.value)


@pytest.mark.parametrize(("env_id", "act_dim", "why"), [
    ("NotRegistered-v3", 1, "; env_id 'NotRegistered-v3' gives no bounds: gym.make('NotRegistered-v3') fails here "
                            "(NameNotFound: Environment `NotRegistered` doesn't exist.)"),
    ("CartPole-v1", 1, "; env_id 'CartPole-v1' gives no bounds: its action space Discrete(2) is not a Box"),
    ("Pendulum-v1", 2, "; env_id 'Pendulum-v1' gives no bounds: its action space Box(-2.0, 2.0, (1,), float32) has "
                       "another shape than the file's actions, (2,) per step"),
])
def test_unbounded_actions_error_says_why_the_named_task_gave_no_bounds(tmp_path, env_id, act_dim, why) -> None:
    """The loader silently fell back to an unbounded Box when dataset.env_id's environment could
    not be made or did not fit, and training then asked the user to "set dataset.env_id" (set
    already) without saying why it gave no bounds."""
    from rl_tformers.agents.common.offline import DatasetInfo, load_offline_dataset

    h5 = _unbounded_file(tmp_path, None, act_dim)
    with pytest.raises(ValueError) as e:
        DatasetInfo.from_dataset(load_offline_dataset({"path": str(h5), "env_id": env_id}))
    msg = str(e.value)
    assert msg.startswith(f"continuous actions need a bounded Box action space, got Box(-inf, inf, ({act_dim},), "
                          f"float32); {h5}: the action bounds come from the task the data came from (env_id "
                          f"{env_id!r}), "), msg
    assert why + "; set dataset.env_id=<gymnasium id>" in msg, msg


# ------------------------------------------------- 4. in-memory datasets of integer observations
@pytest.mark.parametrize("build", ["from_flags", "from_episodes"])
def test_in_memory_uint8_observations_get_their_dtype_range(build) -> None:
    """``EpisodeDataset.from_flags(uint8 images, ...)`` without an observation space (the docs'
    recipe for concatenating datasets) raised gymnasium's "Box unsigned int dtype don't support
    `-np.inf`", naming no field: the loaders' Box over the dtype's range was not used in memory."""
    from rl_tformers.envs.dataset import EpisodeDataset

    n = 6
    obs = np.arange(n * 4, dtype=np.uint8).reshape(n, 2, 2)
    act, rew, term = np.arange(n) % 2, np.ones(n), np.eye(1, n, n - 1, dtype=bool)[0]
    if build == "from_flags":
        ds = EpisodeDataset.from_flags(obs, act, rew, term)
    else:
        ds = EpisodeDataset.from_episodes([{"observations": np.concatenate([obs, obs[:1]]), "actions": act,
                                            "rewards": rew, "terminations": term, "truncations": np.zeros(n, bool)}])
    assert ds.observation_space == gym.spaces.Box(0, 255, (2, 2), np.uint8)
    assert ds.action_space == gym.spaces.Discrete(2)


@pytest.mark.parametrize("field", ["observations", "actions", "rewards"])
def test_in_memory_boolean_columns_are_refused_naming_the_field(field) -> None:
    """Boolean observations hit the same gymnasium error; boolean rewards were silently read as
    0/1 (the HDF5 and Minari loaders refuse both as not numeric)."""
    from rl_tformers.envs.dataset import DatasetError, EpisodeDataset

    n = 6
    cols = {"observations": np.zeros((n, 2), np.float32), "actions": np.zeros((n, 1), np.float32),
            "rewards": np.ones(n)}
    cols[field] = cols[field].astype(bool)
    with pytest.raises(DatasetError, match=rf"^{field}: dtype bool is not numeric \(integer or floating point\)$") as e:
        EpisodeDataset.from_flags(cols["observations"], cols["actions"], cols["rewards"], np.eye(1, n, n - 1)[0],
                                  action_space=gym.spaces.Box(-1.0, 1.0, (1,), np.float32))
    assert e.value.field == field


# ------------------------------------------------- 5. vector evaluation: discarded filler episodes
class _SeedLengthEnv(gym.Env):
    """Episode length set by the reset seed (``lengths[seed]``), 100 steps when reset unseeded."""

    def __init__(self, lengths: dict[int, int]):
        self.lengths = lengths
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.length, self.t = 100, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.length, self.t = self.lengths.get(seed, 100), 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.full(2, self.t, np.float32), 1.0, self.t >= self.length, False, {}


def test_a_discarded_filler_episode_does_not_stop_a_dt_evaluation_at_max_ep_len() -> None:
    """4 episodes on 3 environments: environments 1 and 2 finish their quota after 2 steps and run
    unseeded filler episodes (results discarded) while environment 0 runs its two 10-step
    episodes; the DT policy (max_ep_len=15, timestep_overflow=error) counted the fillers' steps on
    and stopped the evaluation at step 15 of a filler ("evaluate on episodes of at most 15
    steps"), though no counted episode is longer than 10."""
    from rl_tformers.runtime.evaluation import evaluate
    from rl_tformers.agents.decision_transformer.model import DecisionTransformer, DTConfig
    from rl_tformers.agents.decision_transformer.policy import DTPolicy

    torch.manual_seed(0)
    cfg = DTConfig(obs_dim=2, act_dim=1, context_len=4, max_ep_len=15, embed_dropout=0.0,
                   backbone={"d_model": 16, "n_layers": 1, "n_heads": 1, "dropout": 0.0, "attn_dropout": 0.0})
    pol = DTPolicy(DecisionTransformer(cfg), np.zeros(2), np.ones(2), 1.0, np.array([-1.0]), np.array([1.0]))
    rep = evaluate(pol, lambda: _SeedLengthEnv({0: 10, 1: 2, 2: 2, 3: 10}), [10.0], episodes=4, n_envs=3, seed=0)
    assert rep.results[0].lengths == [10, 2, 2, 10] and rep.results[0].returns == [10.0, 2.0, 2.0, 10.0]
    assert rep.results[0].seeds == [0, 1, 2, 3]
    # a counted episode past max_ep_len is still refused
    with pytest.raises(ValueError, match=r"episode step 15 >= agent.max_ep_len=15"):
        evaluate(pol, lambda: _SeedLengthEnv({0: 16, 1: 2, 2: 2, 3: 10}), [10.0], episodes=4, n_envs=3, seed=0)


# ------------------------------------------------- 6. normalised scores from a parent folder's name
def test_a_parent_folder_named_like_a_d4rl_task_gives_no_reference_scores(tmp_path: Path) -> None:
    """A Pendulum-v1 file stored under ``hopper_experiments/`` got Hopper's D4RL references (every
    component of the file's path was matched against the task families): ``dataset info`` and
    every evaluation reported a "normalised score" of a Pendulum agent on Hopper's scale."""
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset
    from rl_tformers.envs.scores import reference_scores

    folder = tmp_path / "hopper_experiments"
    folder.mkdir()
    n = 12
    with h5py.File(folder / "pendulum.hdf5", "w") as f:
        f["observations"] = np.zeros((n, 3), np.float32)
        f["actions"] = np.zeros((n, 1), np.float32)
        f["rewards"] = -np.ones(n)
        f["terminals"] = np.eye(1, n, n - 1, dtype=bool)[0]
        f.attrs["env_id"] = "Pendulum-v1"
    ds = load_dataset(folder / "pendulum.hdf5")
    assert reference_scores(ds) is None
    s = ds.summary()
    assert (s["ref_min_score"], s["ref_max_score"], s["normalized_return_mean"]) == (None, None, None)
    info = DatasetInfo.from_dataset(ds)
    assert (info.ref_min, info.ref_max) == (None, None)

    # the file's own name still names its task (no env_id: recognised from the name, as before)
    shutil.copy(folder / "pendulum.hdf5", folder / "hopper-medium-v2.hdf5")
    with h5py.File(folder / "hopper-medium-v2.hdf5", "a") as f:
        del f.attrs["env_id"]
    assert reference_scores(load_dataset(folder / "hopper-medium-v2.hdf5")) == (-20.272305, 3234.3)


# ------------------------------------------------- 7. a Discrete evaluation env with fewer actions
def test_an_evaluation_env_with_fewer_discrete_actions_than_the_data_is_refused_before_training(tmp_path) -> None:
    """A DT trained on 3 discrete actions with agent.env_id=CartPole-v1 (2 actions) was accepted
    (only the kind and ``start`` of the space were compared); the first time the model chose
    action 2 the environment failed with an AssertionError, after training."""
    n = 30
    h5 = tmp_path / "three.hdf5"
    with h5py.File(h5, "w") as f:  # no env_id: the loader infers Discrete(3) from the actions
        f["observations"] = (np.random.default_rng(0).normal(size=(n, 4)) * 0.05).astype(np.float32)
        f["actions"] = np.arange(n) % 3
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"] = np.isin(np.arange(n), [9, 19, 29])
    run = tmp_path / "run"
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.env_id=CartPole-v1",
                            "train.steps=1", *TINY, "--run-dir", str(run)])
    assert r.exit_code == 2, r.output
    assert (f"error: actions: the dataset {h5} has actions in Discrete(3), but the evaluation environment "
            f"CartPole-v1 (agent.env_id) has action space Discrete(2); set agent.env_id to the environment the data "
            f"came from") in r.stderr
    assert not run.exists()

    # fewer actions in the data than in the environment (one the behaviour policy never took) is fine
    from rl_tformers.agents.common.offline import DatasetInfo
    from rl_tformers.envs.loaders import load_dataset

    two = tmp_path / "two.hdf5"
    with h5py.File(two, "w") as f:  # MountainCar-shaped: 2-D observations, actions 0 and 1 of its 3
        f["observations"] = np.zeros((n, 2), np.float32)
        f["actions"] = np.arange(n) % 2
        f["rewards"] = -np.ones(n, np.float32)
        f["terminals"] = np.isin(np.arange(n), [9, 19, 29])
    ds = load_dataset(two)
    assert ds.action_space == gym.spaces.Discrete(2)
    assert DatasetInfo.from_dataset(ds, env_id="MountainCar-v0").act_dim == 2
