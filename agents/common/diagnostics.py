"""Which behaviour does an agent imitate? Compare its actions with reference policies along its own rollouts.

On a dataset mixed from several behaviour policies (medium + expert), a return-conditioned agent
should act like the policy whose returns it is asked for. :func:`imitation_report` runs the
agent with the shared evaluation loop and, at every step, also asks each reference policy what
it would do in the same observations; it reports, separately for the first ``early_steps`` steps
of each episode and for the rest, the mean squared action distance to every reference and the
fraction of steps on which each reference is the closest.

Command line (SB3 references, e.g. the behaviour policies of a recipe)::

    python -m rl_tformers.agents.common.diagnostics runs/hopper/dt-medium-expert-s0 --target 3300 \\
        --ref medium=../shared/policies/sac/Hopper-v3/model.zip --ref expert=../shared/policies/ars/Hopper-v3/model.zip
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from rl_tformers.envs.policies import load_sb3_policy

from rl_tformers.runtime.evaluation import EnvFactory, evaluate
from rl_tformers.runtime.loading import load_run
from rl_tformers.runtime.protocol import Policy

#: obs (N, *obs_shape) -> actions (N, *act_shape)
Reference = Callable[[np.ndarray], np.ndarray]


class _Probe:
    """A :class:`Policy` wrapper recording (step in episode, squared distance to each reference)."""

    def __init__(self, policy: Policy, references: Mapping[str, Reference]) -> None:
        self.policy, self.refs = policy, dict(references)
        self.rows: list[np.ndarray] = []
        self.t: np.ndarray | None = None

    def initial_state(self, n_envs: int, target_return: float | None = None) -> Any:
        self.t = np.full(n_envs, -1)
        return self.policy.initial_state(n_envs, target_return)

    def act(self, obs, state, episode_start, last_reward=None):
        actions, state = self.policy.act(obs, state, episode_start, last_reward)
        self.t = np.where(episode_start, 0, self.t + 1)
        a = np.asarray(actions, np.float64).reshape(len(self.t), -1)  # (N, A)
        dist = [((a - np.asarray(ref(obs), np.float64).reshape(a.shape)) ** 2).sum(-1) for ref in self.refs.values()]
        self.rows.append(np.stack([self.t, *dist], axis=1))  # (N, 1 + R)
        return actions, state


def imitation_report(
    policy: Policy,
    make_env: EnvFactory,
    references: Mapping[str, Reference],
    target: float | None = None,
    *,
    episodes: int = 10,
    n_envs: int = 10,
    seed: int = 0,
    early_steps: int = 20,
) -> dict[str, Any]:
    """Roll ``policy`` out and compare its actions with each reference's at the same observations.

    Args:
        policy: the agent (any :class:`Policy`).
        make_env: evaluation environment factory.
        references: name -> function ``obs (N, ...) -> actions (N, ...)`` (at least one).
        target: target return of a return-conditioned agent (``None`` otherwise).
        episodes, n_envs, seed: as in :func:`~rl_tformers.runtime.evaluation.evaluate`.
        early_steps: steps ``t < early_steps`` of each episode are reported separately.

    Returns:
        ``{"return_mean", "return_std", "early": {...}, "late": {...}}`` where each phase holds
        ``dist[name]`` (mean squared action distance, summed over action dims), ``closest[name]``
        (fraction of steps on which that reference is the closest) and ``steps``. Steps of the
        environments that run past their episode quota are included (they are the same agent).

    Raises:
        ValueError: no references.
    """
    if not references:
        raise ValueError("imitation_report: give at least one reference policy")
    probe = _Probe(policy, references)
    rep = evaluate(probe, make_env, [target], episodes=episodes, n_envs=n_envs, seed=seed)
    rows = np.concatenate(probe.rows)  # (total steps, 1 + R)
    names = list(references)
    out: dict[str, Any] = {"return_mean": rep.results[0].return_mean, "return_std": rep.results[0].return_std}
    for phase, sel in (("early", rows[:, 0] < early_steps), ("late", rows[:, 0] >= early_steps)):
        d = rows[sel, 1:]  # (S, R)
        best = d.argmin(1) if len(d) else np.zeros(0, int)
        out[phase] = {
            "steps": int(sel.sum()),
            "dist": {n: float(d[:, i].mean()) if len(d) else float("nan") for i, n in enumerate(names)},
            "closest": {n: float((best == i).mean()) if len(d) else float("nan") for i, n in enumerate(names)},
        }
    return out


def sb3_reference(path: str, env_id: str) -> Reference:
    """Deterministic actions of an SB3 save file (observation normalisation applied) as a reference."""

    env = gym.make(env_id)
    pol = load_sb3_policy(path, env)
    env.close()

    def act(obs: np.ndarray) -> np.ndarray:
        return pol.model.predict(pol.normalize(np.asarray(obs)), deterministic=True)[0]

    return act


def main(argv: list[str] | None = None) -> None:
    """``python -m rl_tformers.agents.common.diagnostics RUN_DIR --ref NAME=MODEL.zip ... [--target R]``."""


    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--ref", action="append", required=True, metavar="NAME=PATH", help="SB3 save file of a reference")
    p.add_argument("--target", type=float, default=None, help="target return (default: the run's first target)")
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--envs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--early-steps", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    run = load_run(args.run_dir)
    target = args.target if args.target is not None else run.agent.default_targets()[0]
    refs = {}
    for item in args.ref:
        name, _, path = item.partition("=")
        refs[name] = sb3_reference(path, run.env_id)
    rep = imitation_report(run.agent.policy(), run.agent.make_env(), refs, target, episodes=args.episodes,
                           n_envs=args.envs, seed=args.seed, early_steps=args.early_steps)
    line = f"{args.run_dir} target={target} return {rep['return_mean']:.0f} +- {rep['return_std']:.0f}"
    for phase in ("early", "late"):
        ph = rep[phase]
        line += f" | {phase}: " + ", ".join(
            f"{n} closest {ph['closest'][n]:.2f} dist {ph['dist'][n]:.3f}" for n in refs
        )
    print(line)


if __name__ == "__main__":
    main()
