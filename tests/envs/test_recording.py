"""EpisodeRecorder writes the Minari dataset minari.DataCollector writes (same arrays, dtypes,
attributes and metadata), without jax."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from rl_tformers.envs.loaders import load_minari, minari_root
from rl_tformers.envs.pomdp import ObservationMaskWrapper
from rl_tformers.envs.recording import EpisodeRecorder, stack_steps


class DictObs(gym.ObservationWrapper):
    """CartPole with Dict observations {"vel": (2,), "pos": (2,)} (keys out of sorted order)."""

    def __init__(self, env):
        super().__init__(env)
        self.observation_space = gym.spaces.Dict({
            "vel": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
            "pos": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)})

    def observation(self, o):
        return {"vel": o[2:].astype(np.float32), "pos": o[:2].astype(np.float32)}


def _drive(env, episodes: int, max_steps: int | None = None) -> None:
    """Random actions from a seeded action space; every episode reset with seed 100 + e."""
    env.action_space.seed(5)
    for e in range(episodes):
        env.reset(seed=100 + e)
        for t in range(10_000):
            *_, term, trunc, _ = env.step(env.action_space.sample())
            if term or trunc or (max_steps is not None and t + 1 == max_steps):
                break  # an episode cut by max_steps ends at the next reset, marked truncated


def _walk(node, out: dict, prefix: str = "") -> dict:
    for k, v in node.attrs.items():
        out[f"{prefix}@{k}"] = v
    if isinstance(node, h5py.Dataset):
        out[prefix] = (node.dtype, node[()])
        return out
    for k in node:
        _walk(node[k], out, f"{prefix}/{k}")
    return out


def _contents(data_dir: Path) -> tuple[dict, dict]:
    meta = json.loads((data_dir / "metadata.json").read_text())
    meta.pop("dataset_size")  # MB of main_data.hdf5: one write or one per episode lay the file out differently
    with h5py.File(data_dir / "main_data.hdf5") as f:
        return meta, _walk(f, {})


def _write(tmp_path, name, make_env, wrap, episodes=3, max_steps=None, **create):
    root = tmp_path / name
    with minari_root(root), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        env = wrap(make_env())
        _drive(env, episodes, max_steps)
        env.create_dataset(f"test/{name}-v0", algorithm_name="random", author="a", description="d", **create)
        env.close()
    return root / "test" / f"{name}-v0" / "data"


CASES = {
    "box-discrete": (lambda: gym.make("CartPole-v1"), {}, None),
    "box-continuous": (lambda: gym.make("Pendulum-v1", max_episode_steps=7), {}, None),
    "cut-by-reset": (lambda: gym.make("CartPole-v1"), {}, 4),
    "dict": (lambda: DictObs(gym.make("CartPole-v1")), {}, None),
    "masked": (lambda: gym.make("CartPole-v1"), {"indices": [0, 2]}, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recorder_writes_what_minaris_data_collector_writes(tmp_path, case):
    minari = pytest.importorskip("minari")
    pytest.importorskip("jax")  # DataCollector, the reference, needs it
    make_env, mask, max_steps = CASES[case]

    def collector(env):
        if not mask:
            return minari.DataCollector(env, record_infos=False)
        idx = np.asarray(mask["indices"])

        class Masked(minari.StepDataCallback):
            def __call__(self, env, **kwargs):
                data = super().__call__(env, **kwargs)
                data["observation"] = np.asarray(data["observation"])[idx]
                return data

        space = ObservationMaskWrapper(make_env(), mask["indices"]).observation_space
        return minari.DataCollector(env, step_data_callback=Masked, observation_space=space, record_infos=False)

    def recorder(env):
        if not mask:
            return EpisodeRecorder(env)
        space = ObservationMaskWrapper(make_env(), mask["indices"]).observation_space
        return EpisodeRecorder(env, observation=lambda o: np.asarray(o)[mask["indices"]], observation_space=space)

    create = {"eval_env": "CartPole-v1", "ref_min_score": 1.0, "ref_max_score": 500.0,
              "num_episodes_average_score": 0} if case == "box-discrete" else {}
    ref_meta, ref = _contents(_write(tmp_path, "ref", make_env, collector, max_steps=max_steps, **create))
    meta, ours = _contents(_write(tmp_path, "ours", make_env, recorder, max_steps=max_steps, **create))
    ref_meta["dataset_id"] = meta["dataset_id"]
    assert meta == ref_meta
    assert ours.keys() == ref.keys()
    for key, value in ref.items():
        if isinstance(value, tuple):
            assert ours[key][0] == value[0], key
            np.testing.assert_array_equal(ours[key][1], value[1], err_msg=key)
        else:
            assert np.array_equal(ours[key], value), key
    assert ours["/episode_1@seed"] == 101 and "/episode_0/infos" not in ours  # an empty group: no attrs, no data


def test_recorded_arrays_are_the_steps_taken(tmp_path):
    env = EpisodeRecorder(gym.make("CartPole-v1"))
    env.action_space.seed(1)
    seen_obs, seen_act, seen_rew = [], [], []
    obs, _ = env.reset(seed=3)
    seen_obs.append(obs)
    for _ in range(6):
        a = env.action_space.sample()
        obs, r, *_ = env.step(a)
        seen_obs.append(obs)
        seen_act.append(a)
        seen_rew.append(r)
    env.reset(seed=4)  # the first episode ends here, cut after 6 steps
    ep = env.episodes[0]
    np.testing.assert_array_equal(ep.observations, np.stack(seen_obs))
    assert ep.actions.tolist() == seen_act and ep.rewards.tolist() == seen_rew
    assert ep.truncations.tolist() == [False] * 5 + [True] and not ep.terminations.any()
    assert (ep.seed, ep.id, len(env.episodes)) == (3, 0, 1)
    with minari_root(tmp_path), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        env.step(0)
        env.create_dataset("test/steps-v0", algorithm_name="x", author="a", description="d")
    ds = load_minari(tmp_path / "test" / "steps-v0")
    assert ds.lengths.tolist() == [6, 1] and ds.truncations[[5, 6]].tolist() == [True, True]
    np.testing.assert_array_equal(ds.observations[:6], np.stack(seen_obs[:6]))



class OneBuffer(gym.Env):
    """Hands out one observation buffer, written in place each step (t at step t), with a Dict
    observation {"pos": that buffer}; episodes end after 3 steps."""

    def __init__(self):
        self.observation_space = gym.spaces.Dict({"pos": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)})
        self.action_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.buf, self.t = np.zeros(2, np.float32), 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.buf[:] = 0
        return {"pos": self.buf}, {}

    def step(self, action):
        self.t += 1
        self.buf[:] = self.t
        return {"pos": self.buf}, 1.0, self.t == 3, False, {}


def test_recorder_keeps_each_step_when_the_env_and_policy_reuse_their_arrays():
    env = EpisodeRecorder(OneBuffer())
    action = np.zeros(2, np.float32)
    env.reset(seed=0)
    for t in range(3):
        action[:] = t / 4  # the policy writes each action into the same array
        env.step(action)
    ep = env.episodes[0]
    assert ep.observations["pos"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ep.actions[:, 1].tolist() == [0.0, 0.25, 0.5]

def test_recorder_step_before_reset_is_refused():
    env = EpisodeRecorder(gym.make("CartPole-v1"))
    with pytest.raises(RuntimeError, match="step before reset"):
        env.step(0)


def test_stack_steps_keeps_dict_and_tuple_structure_with_sorted_keys():
    out = stack_steps([{"b": 1, "a": (np.zeros(2), 3)}, {"b": 2, "a": (np.ones(2), 4)}])
    assert list(out) == ["a", "b"]
    assert out["b"].tolist() == [1, 2] and out["a"][1].tolist() == [3, 4]
    assert out["a"][0].tolist() == [[0, 0], [1, 1]]


def test_recording_imports_no_jax(tmp_path):
    import subprocess

    code = ("import sys, warnings, gymnasium as gym\n"
            "from rl_tformers.envs.loaders import minari_root\n"
            "from rl_tformers.envs.recording import EpisodeRecorder\n"
            f"with minari_root({str(tmp_path)!r}), warnings.catch_warnings():\n"
            "    warnings.simplefilter('ignore')\n"
            "    env = EpisodeRecorder(gym.make('CartPole-v1'))\n"
            "    env.reset(seed=0)\n"
            "    env.step(0)\n"
            "    env.create_dataset('test/nojax-v0', algorithm_name='x', author='a', description='d')\n"
            "print('jax' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_observation_of_another_shape_within_an_episode_is_named_by_episode_and_step():
    calls = []

    def grow_once(o):
        calls.append(1)
        return np.zeros(5, np.float32) if len(calls) == 3 else o

    env = EpisodeRecorder(gym.make("CartPole-v1"), observation=grow_once)
    env.reset(seed=0)
    env.step(0)
    env.step(0)
    with pytest.raises(ValueError, match=r"^EpisodeRecorder: episode 0: the observation of step 2 has layout \(5,\), "
                                         r"the episode's first \(4,\); every observation of an episode must have one "
                                         r"shape$"):
        env.reset(seed=1)
