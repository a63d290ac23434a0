"""Defects found by the tenth breaker pass (data layer, BC/DT on odd data, sweeps, CLI):

1. float64 observations that are finite but outside float32's range pass validation, and the
   agents (which compute in float32) then train on inf/NaN: the run dies with
   ``NonFiniteLossError`` ("try a lower train.lr") instead of a data error naming the field,
   the episode and the step;
2. a diverged run (``NonFiniteLossError``) ends ``rl-tformers train`` with a Python traceback
   instead of one ``error: ...`` line;
3. negative integer actions without an action space: the error names neither the episode nor
   the step (the data layer's promise for every validation error);
4. the DT's ``agent.max_ep_len`` error does not name the episode;
5. ``next_return_to_go`` does not reproduce ``returns_to_go`` exactly for non-integer rewards,
   and ``returns_to_go(r)[0]`` differs from the episode's return (``episode_returns``);
6. ``--grid`` splits a YAML-quoted value at the commas inside the quotes;
7. integer actions stored as ``(N, 1)`` in a file whose ``env_id`` has a Discrete action space
   are refused as "multi-dimensional discrete actions" with "no action space".

Every test builds its own tiny data in ``tmp_path`` and trains for at most a few updates of a
16-wide model.
"""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from rl_tformers.cli import app

runner = CliRunner()

TINY = ["train.batch_size=4", "train.steps=3", "eval.every=0", "eval.at_end=false", "train.progress=false",
        "train.warmup_steps=1", "train.log_every=1", "--device", "cpu"]


def _cartpole_file(path: Path, *, obs=None, actions=None, env_id: str | None = "CartPole-v1", n: int = 40) -> Path:
    """A CartPole-shaped D4RL file of 4 episodes of 10 steps."""
    rng = np.random.default_rng(0)
    term = np.zeros(n, bool)
    term[np.arange(9, n, 10)] = True
    with h5py.File(path, "w") as f:
        f["observations"] = rng.normal(size=(n, 4)).astype(np.float32) if obs is None else obs
        f["actions"] = rng.integers(0, 2, n) if actions is None else actions
        f["rewards"] = np.ones(n)
        f["terminals"] = term
        f["timeouts"] = np.zeros(n, bool)
        if env_id:
            f.attrs["env_id"] = env_id
    return path


# ------------------------------------------- 1. float64 observations outside float32's range
@pytest.mark.parametrize("agent", [["agent.kind=bc"],
                                   ["-c", "dt/cartpole_demo", "backbone.d_model=16", "backbone.n_layers=1"]],
                         ids=["bc", "dt"])
def test_observations_beyond_float32_are_refused_by_name_not_trained_into_nan(tmp_path: Path, agent) -> None:
    """A float64 observation of 1e300 is finite, so validation passes; the agents cast
    observations to float32 (inf), normalise them (NaN) and the run dies at the first update with
    ``NonFiniteLossError: ... try a lower train.lr``, which points at the wrong cause. The data
    cannot be trained on: it must be refused before training, naming observations, the episode
    and the step (like rewards whose returns-to-go are not finite in float32)."""
    obs = np.random.default_rng(1).normal(size=(40, 4))
    obs[17, 2] = 1e300  # episode 1, step 7
    h5 = _cartpole_file(tmp_path / "big.hdf5", obs=obs)
    r = runner.invoke(app, ["train", *agent, f"dataset.path={h5}", *TINY, "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, (r.exception, r.output)
    assert "observations" in r.stderr and "episode 1, step 7" in r.stderr, r.stderr


# ------------------------------------------- 2. a diverged run ends in a traceback
def test_diverged_training_ends_with_one_error_line_not_a_traceback(tmp_path: Path) -> None:
    """``rl-tformers train -c toy train.lr=1e300`` diverges at update 2 and the CLI lets
    ``NonFiniteLossError`` escape: ~40 lines of traceback for a user-level outcome whose message
    already says what to do. Every other refusal of the command is one ``error: ...`` line."""
    from rl_tformers.runtime.trainer import NonFiniteLossError

    r = runner.invoke(app, ["train", "-c", "toy", "train.lr=1e300", "train.steps=5", "train.warmup_steps=1",
                            "train.log_every=1", "train.progress=false", "eval.every=0", "eval.at_end=false",
                            "--device", "cpu", "--run-dir", str(tmp_path / "run")])
    assert r.exit_code != 0
    assert not isinstance(r.exception, NonFiniteLossError), "NonFiniteLossError escaped the CLI (a traceback)"
    assert r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr


# ------------------------------------------- 3. negative integer actions: no episode, no step
def test_negative_integer_action_error_names_the_episode_and_the_step(tmp_path: Path) -> None:
    """``actions: negative integer action -1; pass action_space explicitly``: no episode, no
    step, ``.episode``/``.step`` None, although docs/data.md promises both for every error."""
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    actions = np.random.default_rng(0).integers(0, 2, 40)
    actions[13] = -1  # episode 1, step 3
    h5 = _cartpole_file(tmp_path / "neg.hdf5", actions=actions, env_id=None)
    with pytest.raises(DatasetError) as info:
        load_dataset(h5)
    assert (info.value.field, info.value.episode, info.value.step) == ("actions", 1, 3), str(info.value)
    assert "episode 1, step 3" in str(info.value)


# ------------------------------------------- 4. DT max_ep_len error without the episode
def test_dt_max_ep_len_error_names_the_episode(tmp_path: Path) -> None:
    """README: episodes longer than the model's ``max_ep_len`` are refused with an error naming
    the episode (``lengths: episode 2 has 1000 steps, more than the model's max_ep_len=500``);
    the DT says only ``agent.max_ep_len=5 but the dataset has an episode of 10 steps``."""
    h5 = _cartpole_file(tmp_path / "cp.hdf5")
    r = runner.invoke(app, ["train", "-c", "dt/cartpole_demo", f"dataset.path={h5}", "agent.max_ep_len=5",
                            "backbone.d_model=16", "backbone.n_layers=1", *TINY, "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "episode 0" in r.stderr, r.stderr


# ------------------------------------------- 5. exact returns-to-go for non-integer rewards
def test_evaluation_rtg_update_reproduces_training_rtg_for_float_rewards() -> None:
    """``next_return_to_go`` was said to reproduce ``returns_to_go`` "exactly (tested)", tested with
    integer rewards only: with rewards [0.1, 0.1, 0.1] the evaluation-time RTG at step 1 is
    0.20000000000000004 where training saw 0.2 (training sums from the end, the update subtracts
    from the start; no float64 order of operations makes both exact). The documented guarantee
    now: exact for integer rewards, within a few ulps of the return otherwise."""
    from rl_tformers.envs.trajectory import next_return_to_go, returns_to_go

    rng = np.random.default_rng(0)
    for rewards in ([0.1, 0.1, 0.1], [0.1, 0.7, 0.2], rng.normal(3.0, 1.0, 1000).tolist()):
        rtg = returns_to_go(rewards)
        x, seen = float(rtg[0]), []
        for r in rewards:
            seen.append(x)
            x = next_return_to_go(x, r)
        tol = 8 * np.finfo(np.float64).eps * math.fsum(abs(r) for r in rewards) * len(rewards) ** 0.5
        assert np.abs(np.array(seen) - rtg).max() <= tol
        assert rtg[-1] == rewards[-1]  # the last step's RTG is its reward exactly
    ints = rng.integers(-5, 6, 500).astype(np.float64)
    rtg = returns_to_go(ints)
    x, seen = float(rtg[0]), []
    for r in ints:
        seen.append(x)
        x = next_return_to_go(x, r)
    assert seen == rtg.tolist()  # integer rewards: bit for bit


def test_return_to_go_at_step_0_is_the_episode_return() -> None:
    """``episode_returns`` (math.fsum, used for top_fraction, targets and reward_scale) is 1.0 for
    rewards [0.1, 0.7, 0.2], the training RTG of step 0 0.9999999999999999: both within float64
    rounding of the true sum (documented), and equal for integer rewards."""
    import gymnasium as gym
    from rl_tformers.envs.dataset import EpisodeDataset
    from rl_tformers.envs.trajectory import dataset_returns_to_go

    for rewards in (np.array([0.1, 0.7, 0.2]), np.array([3.0, -1.0, 7.0])):
        ds = EpisodeDataset.from_flags(np.zeros((3, 1), np.float32), np.zeros((3, 1), np.float32), rewards,
                                       np.array([0, 0, 1]), action_space=gym.spaces.Box(-1.0, 1.0, (1,), np.float32))
        assert ds.episode_returns[0] == math.fsum(rewards)
        assert abs(dataset_returns_to_go(ds)[0] - ds.episode_returns[0]) <= 4 * np.finfo(np.float64).eps
    assert dataset_returns_to_go(ds)[0] == ds.episode_returns[0] == 9.0


# ------------------------------------------- 6. --grid with a quoted value holding a comma
def test_grid_keeps_a_quoted_value_with_a_comma_whole() -> None:
    """Grid values are YAML; a quoted string is one value, yet ``--grid
    dataset.path='a,b.hdf5',c.hdf5`` gives three values ``'a``, ``b.hdf5'`` and ``c.hdf5``
    (brackets and braces are respected, quotes are not): a path or any string holding a comma
    cannot be swept."""
    from rl_tformers.runtime.sweep import parse_grid

    assert parse_grid(["dataset.path='a,b.hdf5',c.hdf5"]) == {"dataset.path": ["'a,b.hdf5'", "c.hdf5"]}
    assert parse_grid(['dataset.path="a,b.hdf5",c.hdf5']) == {"dataset.path": ['"a,b.hdf5"', "c.hdf5"]}


# ------------------------------------------- 7. (N, 1) integer actions of a Discrete task
def test_n_by_1_integer_actions_of_a_discrete_env_are_not_called_multi_dimensional(tmp_path: Path) -> None:
    """A CartPole-v1 file (env_id attribute) with actions stored as (N, 1) integers, as rewards
    (N, 1) are accepted, is refused with "integer actions of shape (40, 1) and no action space
    ... (1,) integers per step are multi-dimensional discrete actions": the file names a task
    with a Discrete(2) space and one integer per step is not multi-dimensional. Either accept
    them as (N,) (like rewards) or say what is wrong with them."""
    from rl_tformers.envs.dataset import DatasetError
    from rl_tformers.envs.loaders import load_dataset

    actions = np.random.default_rng(0).integers(0, 2, (40, 1))
    h5 = _cartpole_file(tmp_path / "cp_n1.hdf5", actions=actions)
    try:
        ds = load_dataset(h5)
    except DatasetError as exc:
        msg = str(exc)
        assert "multi-dimensional" not in msg and "no action space" not in msg, msg
    else:
        assert ds.discrete_actions and ds.actions.shape == (40,)
        np.testing.assert_array_equal(ds.actions, actions[:, 0])


# ------------------------------------------- 8. a sweep rerun cannot retry a run that failed early
def test_sweep_rerun_retries_a_run_that_failed_before_its_first_checkpoint(tmp_path: Path) -> None:
    """A run that fails before its first checkpoint (here: it diverges at update 2) leaves
    config.yaml and metrics.jsonl in its directory. Running the same sweep again takes it for
    a ``partial`` run and starts ``train --resume``, which fails at once with ``error: no
    checkpoint in .../checkpoints``: the run is never retried (sweep --help: "Running the same
    command again ... resumes unfinished ones"), and the new failure hides the real one."""
    import json

    from rl_tformers.runtime.sweep import sweep

    out = tmp_path / "sw"
    common = ["train.steps=4", "train.warmup_steps=1", "train.log_every=1", "eval.every=0", "eval.at_end=false",
              "train.checkpoint_every=0"]
    kwargs = dict(jobs=1, threads=1, device="cpu", echo=lambda m: None)
    first = sweep("toy", {"train.lr": ["1e300"]}, [0], out, common, **kwargs)
    assert [r["status"] for r in first.rows] == ["failed"]
    second = sweep("toy", {"train.lr": ["1e300"]}, [0], out, common, **kwargs)
    assert [r["status"] for r in second.rows] == ["failed"]
    log = json.loads((out / "results.json").read_text())["failed"]["lr=1e300/seed0"]["log"]
    assert "no checkpoint" not in log, log
    assert "non-finite" in log, log


# ------------------------------------------- 4b. GTrXL's learned-position limit without the episode
def test_gtrxl_max_position_error_names_the_episode(tmp_path: Path) -> None:
    """The GTrXL equivalent of 4: ``backbone.max_position=10 but the dataset has an episode of 15
    steps`` did not say which episode (here episode 2: lengths 5, 5, 15, 15)."""
    h5 = _cartpole_file(tmp_path / "cp.hdf5")
    with h5py.File(h5, "r+") as f:
        term = np.zeros(40, bool)
        term[[4, 9, 24, 39]] = True
        f["terminals"][...] = term
    r = runner.invoke(app, ["train", "agent.kind=gtrxl", f"dataset.path={h5}", "backbone.d_model=16",
                            "backbone.n_layers=1", "backbone.n_heads=1", "agent.seq_len=3", "agent.burn_in=1",
                            "backbone.position.kind=learned", "backbone.max_position=10", *TINY,
                            "--run-dir", str(tmp_path / "run")])
    assert r.exit_code == 2, r.output
    assert "backbone.max_position=10 but the dataset has an episode of 15 steps (lengths: episode 2)" in r.stderr, \
        r.stderr


# ------------------------------------------- 6b. --grid with an unbalanced bracket or quote
@pytest.mark.parametrize("item, what", [("train.betas=[0.9,0.95", "unclosed '['"),
                                        ("dataset.path='a,b.hdf5,c.hdf5", "unclosed ' quote"),
                                        ("train.betas=0.9]", "']' closes no bracket")])
def test_grid_with_an_unbalanced_bracket_or_quote_is_refused_naming_the_key(item: str, what: str) -> None:
    """``[0.9,0.95`` used to be one value holding everything after the bracket (a run with a
    config nobody asked for, or a confusing compose error): refused, naming the grid key."""
    from rl_tformers.runtime.sweep import SweepError, parse_grid

    key = item.partition("=")[0]
    with pytest.raises(SweepError) as info:
        parse_grid([item])
    assert str(info.value).startswith(f"--grid {key}: {what}"), str(info.value)
    assert parse_grid(["agent.note=it's,b"]) == {"agent.note": ["it's", "b"]}  # an apostrophe is not a quote


# ------------------------------------------- 7b. (N, 1) Discrete actions read lazily
def test_n_by_1_discrete_actions_load_lazily_as_one_action_per_step(tmp_path: Path) -> None:
    """``lazy=True`` gives the same (N,) actions (read into memory: N integers, like rewards)."""
    from rl_tformers.envs.loaders import load_dataset

    actions = np.random.default_rng(0).integers(0, 2, (40, 1))
    ds = load_dataset(_cartpole_file(tmp_path / "cp_n1.hdf5", actions=actions), lazy=True)
    assert ds.discrete_actions and ds.actions.shape == (40,)
    np.testing.assert_array_equal(ds.actions, actions[:, 0])


# ------------------------------------------- 1b. actions and final observations beyond float32
def test_float64_actions_and_final_observations_beyond_float32_are_refused_by_name() -> None:
    """The same as 1 for Box actions without bounds (an inferred unbounded float64 Box) and for
    final observations (``next_observations`` at an episode's end)."""
    from rl_tformers.envs.dataset import DatasetError, EpisodeDataset

    obs, act = np.zeros((6, 2)), np.zeros((6, 1))
    term = np.array([0, 0, 1, 0, 0, 1])
    act[4, 0] = -1e39  # episode 1, step 1
    with pytest.raises(DatasetError) as info:
        EpisodeDataset.from_flags(obs, act, np.ones(6), term)
    assert (info.value.field, info.value.episode, info.value.step) == ("actions", 1, 1), str(info.value)
    assert "outside float32's range" in str(info.value)
    nxt = np.zeros((6, 2))
    nxt[5, 1] = 1e300  # the final observation of episode 1
    with pytest.raises(DatasetError) as info:
        EpisodeDataset.from_flags(obs, np.zeros((6, 1)), np.ones(6), term, next_observations=nxt)
    assert (info.value.field, info.value.episode) == ("final_observations", 1), str(info.value)
    ok = EpisodeDataset.from_flags(np.full((6, 2), 3e38), np.zeros((6, 1)), np.ones(6), term)  # float32 holds 3e38
    assert ok.num_steps == 6
