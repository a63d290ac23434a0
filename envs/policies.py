"""Behaviour policies for building datasets: random, saved SB3 agents, noisy versions, on-the-spot training.

A behaviour policy is a callable ``policy(obs) -> action`` on single (unbatched) observations of
the *full* environment observation, with ``reset()`` called at the start of every episode
(recurrent SB3 policies keep their LSTM state between calls).

Saved agents: any Stable-Baselines3 or sb3-contrib save file (``model.zip``). The algorithm is
read from the file's policy class (or given explicitly); spaces come from the environment and
schedules are replaced by constants through ``custom_objects``, so zips pickled with the old
``gym`` package load on gymnasium. An ``obs_norm.npz`` next to the zip (arrays ``mean``, ``var``,
``clip_obs``, ``epsilon``, as saved by SB3's ``VecNormalize``) is applied as
``clip((obs - mean) / sqrt(var + epsilon), -clip_obs, clip_obs)``.

SB3 save files contain pickled Python objects: load only files you trust.
"""

from __future__ import annotations

import ast
import copy
import importlib
import json
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from rl_tformers.envs.environments import make_task
from rl_tformers.envs.stopping import check_stop

#: algorithm name -> (module, class) for SB3 and sb3-contrib.
ALGORITHMS: dict[str, tuple[str, str]] = {
    "a2c": ("stable_baselines3", "A2C"),
    "ddpg": ("stable_baselines3", "DDPG"),
    "dqn": ("stable_baselines3", "DQN"),
    "ppo": ("stable_baselines3", "PPO"),
    "sac": ("stable_baselines3", "SAC"),
    "td3": ("stable_baselines3", "TD3"),
    "ars": ("sb3_contrib", "ARS"),
    "crossq": ("sb3_contrib", "CrossQ"),
    "qrdqn": ("sb3_contrib", "QRDQN"),
    "tqc": ("sb3_contrib", "TQC"),
    "trpo": ("sb3_contrib", "TRPO"),
    "maskableppo": ("sb3_contrib", "MaskablePPO"),
    "recurrentppo": ("sb3_contrib", "RecurrentPPO"),
}
#: policy-class module folder -> algorithm (``stable_baselines3.sac.policies`` -> sac).
_MODULE_TO_ALGO = {"sac": "sac", "td3": "td3", "dqn": "dqn", "ars": "ars", "crossq": "crossq",
                   "qrdqn": "qrdqn", "tqc": "tqc", "ppo_mask": "maskableppo", "ppo_recurrent": "recurrentppo"}
#: entries of the saved ``data`` replaced by constants when loading (training-only schedules).
_SCHEDULE_KEYS = ("learning_rate", "lr_schedule", "clip_range", "clip_range_vf", "exploration_schedule",
                  "delta_std_schedule")


def algorithm_class(name: str):
    """The SB3 / sb3-contrib class of an algorithm name (case-insensitive)."""

    key = name.lower().replace("-", "").replace("_", "")
    if key not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}")
    module, cls = ALGORITHMS[key]
    return getattr(importlib.import_module(module), cls)


def _saved_data(path: Path) -> dict:
    """The JSON ``data`` member of an SB3 save file.

    Raises:
        ValueError: ``path`` is not a zip file, or has no readable JSON ``data`` member (not an
            SB3 save file).
    """
    try:
        with zipfile.ZipFile(path) as z:
            data = json.loads(z.read("data"))
    except (zipfile.BadZipFile, KeyError, ValueError, OSError) as exc:
        raise ValueError(f"{path}: not a Stable-Baselines3 save file (a zip with a JSON 'data' member): "
                         f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a Stable-Baselines3 save file ('data' is not a JSON object)")
    return data


def detect_algorithm(path: str | Path) -> str:
    """Algorithm of an SB3 save file, from its policy class (and, for the shared actor-critic
    policy, from the hyper-parameters it saved: ``cg_max_steps`` -> trpo, ``clip_range`` -> ppo,
    else a2c; all three load the same policy for inference).

    Raises:
        ValueError: the file's policy class does not identify an algorithm (pass ``algo``).
    """
    path = Path(path)
    data = _saved_data(path)
    module = str(data.get("policy_class", {}).get("__module__", ""))
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in _MODULE_TO_ALGO:
        return _MODULE_TO_ALGO[parts[1]]
    if module == "stable_baselines3.common.policies":
        if "cg_max_steps" in data:
            return "trpo"
        return "ppo" if "clip_range" in data else "a2c"
    if len(parts) >= 2 and parts[1] in ALGORITHMS:
        return parts[1]
    raise ValueError(f"{path}: cannot tell the algorithm from policy module {module!r}; pass algo=... (CLI: --algo)")


class RandomPolicy:
    """Uniform random actions from a copy of the action space, seeded for reproducibility."""

    def __init__(self, action_space: gym.Space, seed: int = 0):
        self.space = copy.deepcopy(action_space)
        self.space.seed(int(seed))
        self.name = "random"

    def reset(self) -> None:
        """Nothing to reset (memoryless)."""

    def __call__(self, obs: np.ndarray) -> Any:
        """One ``space.sample()``; ``obs`` is ignored."""
        return self.space.sample()


class SB3Policy:
    """Actions of a loaded SB3 model, with optional observation normalisation.

    Args:
        model: a loaded SB3 / sb3-contrib ``BaseAlgorithm``.
        obs_norm: ``{"mean", "var", "clip_obs", "epsilon"}`` or ``None``.
        name: label stored in dataset metadata.
        deterministic: take the mode of the policy's action distribution (``True``) or sample
            from it (SAC's squashed Gaussian, PPO's Gaussian; ARS has no distribution and
            acts the same either way).
        seed: with ``deterministic=False``, seed of the policy's own torch random stream (kept
            apart from the global one, so a rollout draws the same actions whatever else runs).
    """

    def __init__(self, model, obs_norm: dict | None = None, name: str = "sb3", *, deterministic: bool = True,
                 seed: int = 0):
        self.model = model
        self.obs_norm = obs_norm
        self.name = name
        self.deterministic = bool(deterministic)
        self._rng_state = None
        if not self.deterministic:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(seed))
                self._rng_state = torch.get_rng_state()
        self._state = None
        self._start = True

    def reset(self) -> None:
        """Start a new episode: clear the recurrent state (recurrent SB3 policies)."""
        self._state = None
        self._start = True

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        """``clip((obs - mean) / sqrt(var + epsilon), -clip_obs, clip_obs)`` (SB3's VecNormalize),
        or ``obs`` unchanged without ``obs_norm``."""
        if self.obs_norm is None:
            return obs
        n = self.obs_norm
        return np.clip((obs - n["mean"]) / np.sqrt(n["var"] + n["epsilon"]), -n["clip_obs"], n["clip_obs"])

    def __call__(self, obs: np.ndarray) -> Any:
        """The model's action for one raw observation (normalised here): the mode, or a sample
        from the policy's own random stream."""
        if self.deterministic:
            return self._predict(obs)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng_state)
            action = self._predict(obs)
            self._rng_state = torch.get_rng_state()
        return action

    def _predict(self, obs: np.ndarray) -> Any:
        action, self._state = self.model.predict(self.normalize(np.asarray(obs)), state=self._state,
                                                 episode_start=np.array([self._start]),
                                                 deterministic=self.deterministic)
        self._start = False
        return action


def load_obs_norm(path: str | Path) -> dict:
    """Read an ``obs_norm.npz`` (arrays ``mean``, ``var``, ``clip_obs``, ``epsilon``)."""
    with np.load(path) as z:
        missing = {"mean", "var", "clip_obs", "epsilon"} - set(z.files)
        if missing:
            raise ValueError(f"{path}: missing arrays {sorted(missing)}")
        return {k: np.asarray(z[k], dtype=np.float64) for k in ("mean", "var", "clip_obs", "epsilon")}


def load_sb3_policy(
    path: str | Path,
    env: gym.Env,
    *,
    algo: str | None = None,
    obs_norm: str | Path | bool | None = "auto",
    device: str = "cpu",
    deterministic: bool = True,
    seed: int = 0,
) -> SB3Policy:
    """Load an SB3 / sb3-contrib save file as a behaviour policy for ``env``.

    Args:
        path: the ``model.zip`` (a folder holding one is accepted).
        env: the (full-observation) environment; its spaces replace the pickled ones.
        algo: algorithm name (see :data:`ALGORITHMS`); detected from the file when ``None``.
        obs_norm: ``"auto"`` uses ``obs_norm.npz`` next to the zip when present; a path uses
            that file; ``None``/``False`` disables normalisation.
        device: torch device for the policy network.
        deterministic, seed: act by the mode or by sampling, from a stream seeded with ``seed``
            (:class:`SB3Policy`).

    Raises:
        FileNotFoundError: no such file. ValueError: unknown algorithm, a file that is not an
            SB3 save file (not a zip, no JSON ``data`` member), or one trained with observation or
            action shapes other than ``env``'s.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "model.zip"
    if not path.is_file():
        raise FileNotFoundError(f"no SB3 save file at {path}")
    name = algo or detect_algorithm(path)
    cls = algorithm_class(name)
    data = _saved_data(path)
    _check_saved_spaces(path, data, env)
    custom: dict[str, Any] = {"observation_space": env.observation_space, "action_space": env.action_space}
    for key in _SCHEDULE_KEYS:
        if key in data:
            custom[key] = 0.0 if key == "learning_rate" else _zero_schedule
    model = cls.load(path, device=device, custom_objects=custom)
    norm = None
    if obs_norm == "auto":
        cand = path.parent / "obs_norm.npz"
        norm = load_obs_norm(cand) if cand.is_file() else None
    elif obs_norm:
        norm = load_obs_norm(obs_norm)
    return SB3Policy(model, norm, name=f"{name}:{path}", deterministic=deterministic, seed=seed)


def _saved_shape(data: dict, key: str) -> tuple[int, ...] | None:
    """The shape an SB3 save file's ``data`` records for space ``key`` (``None`` when unreadable)."""

    entry = data.get(key)
    shape = entry.get("shape") if isinstance(entry, dict) else None
    try:
        if isinstance(shape, str):
            shape = ast.literal_eval(shape)
        return None if shape is None else tuple(int(n) for n in shape)
    except (ValueError, TypeError, SyntaxError):
        return None


def _check_saved_spaces(path: Path, data: dict, env: gym.Env) -> None:
    """Refuse a save file trained on spaces of another shape than ``env``'s, naming both.

    Without this, SB3 fails deep inside ``load_state_dict`` with a size mismatch per layer.

    Raises:
        ValueError: the saved observation or action shape differs from the environment's.
    """
    env_name = getattr(env.spec, "id", None) or type(env.unwrapped).__name__
    for key, space in (("observation_space", env.observation_space), ("action_space", env.action_space)):
        saved = _saved_shape(data, key)
        if saved is not None and saved != tuple(space.shape):
            raise ValueError(f"--policy {path}: trained with {key.replace('_', ' ')} of shape {saved}, but "
                             f"{env_name} has {space!r}; give the policy of this environment (or the "
                             "environment of this policy)")


def _zero_schedule(_progress: float) -> float:
    return 0.0


class NoisyPolicy:
    """Weaken a policy: with probability ``epsilon`` take a uniform random action, otherwise the
    policy's action plus Gaussian noise clipped to the action space.

    ``noise_std`` is in units of half the action range, ``(high - low) / 2`` (so 0.1 means 0.1
    for the usual [-1, 1] MuJoCo actions). Both draws use a generator seeded with ``seed``.

    Raises:
        ValueError: noise on a non-Box space, ``noise_std`` < 0, epsilon outside [0, 1], or
            epsilon on a Box with infinite bounds.
    """

    def __init__(self, policy, action_space: gym.Space, *, noise_std: float = 0.0, epsilon: float = 0.0,
                 seed: int = 0):
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
        if noise_std < 0:
            raise ValueError(f"noise std must be >= 0, got {noise_std}")
        box = isinstance(action_space, gym.spaces.Box)
        if noise_std > 0 and not box:
            raise ValueError(f"--noise needs a Box action space, got {action_space!r}; use --epsilon")
        if epsilon > 0 and box and not (np.all(np.isfinite(action_space.low)) and np.all(np.isfinite(action_space.high))):
            raise ValueError(f"--epsilon needs a bounded action space, got {action_space!r}")
        self.policy = policy
        self.space = action_space
        self.noise_std = float(noise_std)
        self.epsilon = float(epsilon)
        self.rng = np.random.default_rng(seed)
        self.random = RandomPolicy(action_space, seed=int(self.rng.integers(2**31 - 1)))
        self.name = getattr(policy, "name", "policy")

    def reset(self) -> None:
        """Reset the wrapped policy."""
        self.policy.reset()

    def __call__(self, obs: np.ndarray) -> Any:
        """The weakened action for one observation (the wrapped policy is always queried)."""
        action = self.policy(obs)  # always query: keeps recurrent state and rng streams aligned
        if self.epsilon > 0 and self.rng.random() < self.epsilon:
            return self.random(obs)
        if self.noise_std > 0:
            half = (self.space.high - self.space.low) / 2.0
            noisy = np.asarray(action, np.float64) + self.rng.normal(0.0, self.noise_std, size=self.space.shape) * half
            return np.clip(noisy, self.space.low, self.space.high).astype(self.space.dtype)
        return action


#: smallest image side SB3's ``NatureCNN`` takes (8x8 stride 4, 4x4 stride 2, 3x3 stride 1)
NATURE_CNN_MIN_SIDE = 36
#: replay buffer of an off-policy agent on pixels when none is given: 100k transitions (Young and
#: Tian 2019's MinAtar DQN), not SB3's 1M (a million 4x84x84 frame pairs is 56 GB)
PIXEL_BUFFER_SIZE = 100_000


def minatar_extractor_class():
    """The feature extractor of Young and Tian 2019's MinAtar DQN as an SB3
    ``BaseFeaturesExtractor`` subclass: one 3x3 convolution of 16 channels (stride 1, ReLU) on the
    ``(C, 10, 10)`` maps, flattened to 1600 features, then a 128-unit ReLU layer (the DQN's own
    head adds the action values). Input: ``(B, C, H, W)`` float in [0, 1] (SB3 divides uint8
    images by 255)."""
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor  # heavy: SB3's torch layers

    class MinAtarCNN(BaseFeaturesExtractor):
        def __init__(self, observation_space: gym.spaces.Box, features_dim: int = 128) -> None:
            super().__init__(observation_space, features_dim)
            c, h, w = observation_space.shape
            self.net = torch.nn.Sequential(
                torch.nn.Conv2d(c, 16, kernel_size=3, stride=1), torch.nn.ReLU(), torch.nn.Flatten(),  # (B, 16*(H-2)*(W-2))
                torch.nn.Linear(16 * (h - 2) * (w - 2), features_dim), torch.nn.ReLU())

        def forward(self, observations: torch.Tensor) -> torch.Tensor:
            return self.net(observations)

    return MinAtarCNN


def sb3_policy_for(env: gym.Env, algo: str, kwargs: dict) -> tuple[str, dict]:
    """SB3's policy name and keyword arguments for ``env``: ``MlpPolicy`` on vectors;
    ``CnnPolicy`` on uint8 ``(C, H, W)`` images (Nature CNN; :func:`minatar_extractor_class` below
    :data:`NATURE_CNN_MIN_SIDE` pixels), off-policy agents with a :data:`PIXEL_BUFFER_SIZE` replay
    buffer unless ``kwargs`` gives one. ``kwargs`` is returned with those defaults added."""
    space = env.observation_space
    if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 3 and space.dtype == np.uint8):
        return "MlpPolicy", dict(kwargs)
    out = dict(kwargs)
    if min(space.shape[1:]) < NATURE_CNN_MIN_SIDE:
        out["policy_kwargs"] = {"features_extractor_class": minatar_extractor_class(), **out.get("policy_kwargs", {})}
    if algo in ("dqn", "qrdqn", "sac", "td3", "ddpg", "tqc", "crossq"):
        out.setdefault("buffer_size", PIXEL_BUFFER_SIZE)
    return "CnnPolicy", out


def train_sb3(algo: str, env: gym.Env, steps: int, *, seed: int = 0, device: str = "cpu", progress: bool = False,
              callbacks: Sequence[Any] = (), **kwargs):
    """Train an SB3 agent (``"sac"``, ``"ppo"``, ``"dqn"``, ... with SB3's defaults) on ``env``:
    ``MlpPolicy`` on vector observations, ``CnnPolicy`` on pixels (:func:`sb3_policy_for`).

    Every transition the agent experiences passes through ``env``; wrap it in an
    :class:`~rl_tformers.envs.recording.EpisodeRecorder` to record the replay data (what SAC's
    replay buffer holds). ``callbacks`` are SB3 callbacks run with the stop check (one that
    returns ``False`` ends training early, e.g. :func:`until_return_callback`).
    Returns the trained model. Nothing is logged: the model gets a logger without outputs (SB3's
    default one would create an empty ``$TMPDIR/SB3-<date>`` folder on every call).
    """
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList
    from stable_baselines3.common.logger import Logger

    class StopCheck(BaseCallback):  # rl-tformers collect: a stop signal ends training at the next step
        def _on_step(self) -> bool:
            check_stop()
            return True

    cls = algorithm_class(algo)
    policy, kwargs = sb3_policy_for(env, algo, kwargs)
    try:
        model = cls(policy, env, seed=seed, device=device, verbose=0, **kwargs)
    except AssertionError as exc:  # SB3 asserts the spaces it supports (SAC on Discrete actions, ...)
        raise ValueError(f"--train {algo}: cannot train on {getattr(env.spec, 'id', None) or env}: {exc}") from None
    model.set_logger(Logger(folder=None, output_formats=[]))
    model.learn(total_timesteps=int(steps), progress_bar=progress, callback=CallbackList([StopCheck(), *callbacks]))
    return model


def until_return_callback(env_id: str, threshold: float, *, seed: int = 0, every: int = 5_000, episodes: int = 5):
    """An SB3 callback that evaluates the training agent and stops training once it is good enough.

    Every ``every`` training steps it runs ``episodes`` episodes of a separate ``make_task(env_id)``
    with the agent's deterministic actions (SB3's ``EvalCallback``; reset seeds drawn from
    ``seed + 1``) and ends training when the mean undiscounted return reaches ``threshold``
    (``StopTrainingOnRewardThreshold``). Evaluation steps are not training transitions: a
    recorder around the training environment never sees them. After training, the callback's
    ``last_mean_reward`` is the last evaluation's mean return and ``n_calls`` the training steps.
    """
    from stable_baselines3.common.callbacks import EvalCallback, StopTrainingOnRewardThreshold
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    eval_env = DummyVecEnv([lambda: Monitor(make_task(env_id))])
    eval_env.seed(int(seed) + 1)
    return EvalCallback(eval_env, callback_on_new_best=StopTrainingOnRewardThreshold(float(threshold), verbose=0),
                        n_eval_episodes=int(episodes), eval_freq=int(every), deterministic=True, verbose=0,
                        log_path=None, best_model_save_path=None, warn=False)
