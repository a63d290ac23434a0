"""Peer worker of :mod:`rl_tformers.bench.crosscheck`: trains d3rlpy's own ``DecisionTransformer``,
``BC``, ``IQL`` or ``CQL`` on an exported dataset and evaluates it in gymnasium's ``Hopper-v5``.

A standalone script (it must not import rl_tformers: it runs in the peers' own virtual
environment, ``.bench-venvs/peers``, because d3rlpy 2.8 pins gymnasium 1.0.0). Started as::

    python _peer_crosscheck.py --algo dt|bc|iql|cql --data crosscheck_data.npz --seed 0 \\
        --targets 3559,3300 --steps 4000 --episodes 10 --out result.json

``crosscheck_data.npz`` holds the dataset in D4RL layout (``observations, actions, rewards,
terminals, timeouts``; written by :func:`rl_tformers.bench.train.d4rl_arrays`). d3rlpy does the
rest with its own code: ``MDPDataset`` (episodes split on the flags), its trajectory / transition
sampling, scalers, models, losses and ``fit``; DT is evaluated through
``algo.as_stateful_wrapper(target_return=...)``, BC through ``algo.predict``. One episode per
reset seed ``0 .. episodes-1``; raw undiscounted returns.

Settings (the shortened ones of our Hopper table, as far as d3rlpy allows):

- DT: context 20, 2 layers, 1 head, 64 dims (a 64-unit linear state encoder, as d3rlpy's
  reproduction script does at 128), ReLU, dropout 0.1 (embedding, attention, residual),
  simple timestep embedding, tanh actions; ``GPTAdamWFactory`` (decay on weight matrices only)
  weight decay 1e-4, grad clip 0.25; standard observation scaler, reward scale 0.001.
- BC: ``BCConfig`` deterministic policy, 256-256 ReLU MLP with dropout 0.1, ``AdamWFactory``
  weight decay 1e-4 (d3rlpy's AdamW decays every parameter), grad clip 0.25, standard
  observation scaler.
- IQL and CQL: the settings of d3rlpy's own reproduction scripts (``reproductions/offline/iql.py``
  and ``cql.py``), which this worker follows rather than ours, with ``--steps`` updates:
  IQL (Kostrikov et al. 2022): actor and critic lr 3e-4, batch 256, expectile 0.7, inverse
  temperature 3.0, weights clipped at 100, rewards scaled by 1000 / (max - min episode return),
  cosine decay of the actor's lr over the ``--steps`` updates; CQL (Kumar et al. 2020): 256-256
  encoders, actor lr 1e-4, critic lr 3e-4, temperature lr 1e-4, alpha lr 3e-4 from e with
  threshold 10, batch 256, 10 action samples, ``--conservative-weight`` (the script's 10 for
  medium sets, 5 otherwise). Both evaluate through ``algo.predict`` (the policy's mean).
- DT and BC: batch 64, lr 6e-4, ``--steps`` updates, linear warmup over 400 updates then cosine decay
  to 0.1 x lr. d3rlpy has warmup and cosine schedules only separately, so the schedule is a
  small ``LRSchedulerFactory`` subclass registered with d3rlpy (``warmup_cosine_rlt``): factor
  ``(s + 1) / W`` for update ``s < W``, then ``m + (1 - m) (1 + cos(pi p)) / 2`` with
  ``p = (s - W) / (N - W)``, ``m = 0.1`` (ours, ``rl_tformers.runtime.optim``).

Writes one JSON object to ``--out``: returns per target, train/eval wall seconds, final lr,
d3rlpy/torch/gymnasium versions and the settings.
"""

from __future__ import annotations

import os
import sys

# This file's folder (rl_tformers/bench) must not shadow modules of the standard library or of
# the peers (Python puts a script's folder first).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402


def _warmup_cosine_factory():
    """A d3rlpy ``LRSchedulerFactory`` for linear warmup then cosine decay (registered once)."""
    import d3rlpy
    from d3rlpy.optimizers.lr_schedulers import LRSchedulerFactory, register_lr_scheduler_factory
    from torch.optim.lr_scheduler import LambdaLR

    @dataclasses.dataclass()
    class WarmupCosineFactory(LRSchedulerFactory):
        warmup_steps: int = 400
        total_steps: int = 4000
        min_lr_ratio: float = 0.1

        def factor(self, s: int) -> float:
            w, n, m = self.warmup_steps, self.total_steps, self.min_lr_ratio
            if s < w:
                return (s + 1) / w
            p = min(max((s - w) / max(n - w, 1), 0.0), 1.0)
            return m + (1.0 - m) * (1.0 + math.cos(math.pi * p)) / 2.0

        def create(self, optim):
            return LambdaLR(optim, self.factor)

        @staticmethod
        def get_type() -> str:
            return "warmup_cosine_rlt"

    register_lr_scheduler_factory(WarmupCosineFactory)
    del d3rlpy
    return WarmupCosineFactory


def build_q_learning(algo: str, args, d3rlpy):
    """IQL or CQL with the settings of d3rlpy's reproduction scripts (module docstring)."""
    if algo == "iql":
        cfg = d3rlpy.algos.IQLConfig(
            actor_learning_rate=3e-4, critic_learning_rate=3e-4, batch_size=256, weight_temp=3.0, max_weight=100.0,
            expectile=0.7, reward_scaler=d3rlpy.preprocessing.ReturnBasedRewardScaler(multiplier=1000.0),
            actor_optim_factory=d3rlpy.optimizers.AdamFactory(
                lr_scheduler_factory=d3rlpy.optimizers.CosineAnnealingLRFactory(T_max=args.steps)),
        )
    else:
        encoder = d3rlpy.models.VectorEncoderFactory([256, 256])
        cfg = d3rlpy.algos.CQLConfig(
            actor_learning_rate=1e-4, critic_learning_rate=3e-4, temp_learning_rate=1e-4, alpha_learning_rate=3e-4,
            initial_alpha=math.e, actor_encoder_factory=encoder, critic_encoder_factory=encoder, batch_size=256,
            n_action_samples=10, alpha_threshold=10, conservative_weight=args.conservative_weight,
        )
    return cfg, cfg.create(device=False)


def build(algo: str, args, d3rlpy):
    if algo in ("iql", "cql"):
        return build_q_learning(algo, args, d3rlpy)
    sched = _warmup_cosine_factory()(warmup_steps=args.warmup, total_steps=args.steps, min_lr_ratio=args.min_lr_ratio)
    scaler = d3rlpy.preprocessing.StandardObservationScaler()
    if algo == "dt":
        opt = d3rlpy.optimizers.GPTAdamWFactory(weight_decay=args.weight_decay, clip_grad_norm=args.clip,
                                                lr_scheduler_factory=sched)
        cfg = d3rlpy.algos.DecisionTransformerConfig(
            batch_size=args.batch, learning_rate=args.lr, optim_factory=opt,
            encoder_factory=d3rlpy.models.VectorEncoderFactory([args.d_model], exclude_last_activation=True),
            observation_scaler=scaler, reward_scaler=d3rlpy.preprocessing.MultiplyRewardScaler(args.reward_scale),
            context_size=args.context, num_heads=args.heads, num_layers=args.layers, max_timestep=args.max_timestep,
            attn_dropout=args.dropout, resid_dropout=args.dropout, embed_dropout=args.dropout, activation_type="relu",
        )
    else:
        opt = d3rlpy.optimizers.AdamWFactory(weight_decay=args.weight_decay, clip_grad_norm=args.clip,
                                             lr_scheduler_factory=sched)
        cfg = d3rlpy.algos.BCConfig(
            batch_size=args.batch, learning_rate=args.lr, optim_factory=opt, policy_type="deterministic",
            encoder_factory=d3rlpy.models.VectorEncoderFactory([256, 256], dropout_rate=args.dropout),
            observation_scaler=scaler,
        )
    return cfg, cfg.create(device=False)


def rollout(env, act, seed: int) -> tuple[float, int]:
    obs, _ = env.reset(seed=seed)
    ret, n, reward, done = 0.0, 0, 0.0, False
    while not done:
        obs, reward, term, trunc, _ = env.step(act(obs, reward))
        ret += float(reward)
        n += 1
        done = term or trunc
    return ret, n


def build_parser() -> argparse.ArgumentParser:
    """The worker's options (the driver also reads them: a per-run JSON is reused only when the
    settings it records equal :func:`recorded_settings` of the command the driver would run)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algo", choices=("dt", "bc", "iql", "cql"), required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default="", help="comma-separated target returns (DT)")
    ap.add_argument("--env", default="Hopper-v5")
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--clip", type=float, default=0.25)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--context", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--reward-scale", type=float, default=0.001)
    ap.add_argument("--max-timestep", type=int, default=1001, help="timesteps run 1..1000 in d3rlpy")
    ap.add_argument("--conservative-weight", type=float, default=5.0, help="CQL's alpha (its script: 10 on medium sets)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also evaluate every N updates (a learning curve; N divides --steps; 0: at the end only)")
    return ap


def recorded_settings(args: argparse.Namespace) -> dict:
    """The settings written into the result JSON: every option but the file paths, and
    ``eval_every`` only when it is set (the evaluations in between do not change training: a
    result without a curve records no ``eval_every``)."""
    return {k: v for k, v in vars(args).items()
            if k not in ("out", "data") and not (k == "eval_every" and not v)}


def fit(args: argparse.Namespace):
    """Train ``args.algo`` with d3rlpy on ``args.data``: returns ``(config, algo, dataset,
    train seconds, final learning rate, curve)``. With ``--eval-every N`` the curve holds one
    :func:`evaluate` after every N updates before the last (``{"step", "results",
    "eval_seconds"}``; its time is not counted in the train seconds), run by the callback d3rlpy's
    ``fit`` calls after each update (its transformer algorithms, DT, have no ``fitter``); the
    evaluations read no random numbers of training (the environment seeds its own generator; the
    policies act deterministically), so the trained model is the one of a run without them."""
    # the peers' environment's libraries (this script runs there only)
    import d3rlpy
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    d3rlpy.seed(args.seed)
    data = np.load(args.data)
    dataset = d3rlpy.dataset.MDPDataset(
        observations=data["observations"], actions=data["actions"], rewards=data["rewards"],
        terminals=data["terminals"].astype(np.float32), timeouts=data["timeouts"].astype(np.float32),
    )
    cfg, algo = build(args.algo, args, d3rlpy)
    curve: list[dict] = []

    def evaluate_between(_algo, _epoch: int, step: int) -> None:
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            results, seconds = evaluate(args, algo)
            curve.append({"step": step, "results": results, "eval_seconds": seconds})
            returns = ", ".join(f"{np.mean(r['returns']):.1f}" for r in results)
            print(f"[{args.algo} seed {args.seed}] {step} updates: return {returns}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    algo.fit(dataset, n_steps=args.steps, n_steps_per_epoch=args.steps, show_progress=False, with_timestamp=False,
             logger_adapter=d3rlpy.logging.NoopAdapterFactory(), save_interval=10**9, callback=evaluate_between)
    train_s = time.perf_counter() - t0 - sum(c["eval_seconds"] for c in curve)
    # the last update's learning rate (checks the schedule ran to its end): the policy's optimiser
    modules = algo.impl.modules
    optim = (modules.optim if hasattr(modules, "optim") else modules.actor_optim).optim
    final_lr = float(optim.param_groups[0]["lr"])
    print(f"[{args.algo} seed {args.seed}] {args.steps} updates in {train_s:.1f} s (final lr {final_lr:.2e})",
          file=sys.stderr, flush=True)
    return cfg, algo, dataset, train_s, final_lr, curve


def evaluate(args: argparse.Namespace, algo) -> tuple[list[dict], float]:
    """``args.episodes`` episodes (reset seeds 0..) of ``algo`` in ``args.env`` per target (DT)
    or once (BC): returns ``(results, eval seconds)``, one result per target."""
    # the peers' environment's libraries (this script runs there only)
    import gymnasium as gym
    import numpy as np

    env = gym.make(args.env)
    results = []
    t1 = time.perf_counter()
    if args.algo == "dt":
        targets = [float(t) for t in args.targets.split(",") if t.strip()]
        for target in targets:
            wrapper = algo.as_stateful_wrapper(target_return=target)

            def act(obs, reward, w=wrapper):
                return w.predict(np.asarray(obs, dtype=np.float32), float(reward))

            rets, lens = [], []
            for ep in range(args.episodes):
                wrapper.reset()
                r, n = rollout(env, act, ep)
                rets.append(r)
                lens.append(n)
            results.append({"target": target, "returns": rets, "lengths": lens})
    else:
        def act(obs, reward):
            return algo.predict(np.asarray(obs, dtype=np.float32)[None])[0]

        rets, lens = [], []
        for ep in range(args.episodes):
            r, n = rollout(env, act, ep)
            rets.append(r)
            lens.append(n)
        results.append({"target": None, "returns": rets, "lengths": lens})
    return results, time.perf_counter() - t1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    # the peers' environment's libraries (this script runs there only)
    import d3rlpy
    import gymnasium
    import numpy as np
    import torch

    if args.eval_every < 0 or (args.eval_every and args.steps % args.eval_every):
        print(f"error: --eval-every {args.eval_every} must be 0 or divide --steps {args.steps}", file=sys.stderr)
        return 2
    cfg, algo, dataset, train_s, final_lr, curve = fit(args)
    results, eval_s = evaluate(args, algo)
    if args.eval_every:
        curve.append({"step": args.steps, "results": results, "eval_seconds": eval_s})
    for r in results:
        print(f"[{args.algo} seed {args.seed}] target {r['target']}: return {np.mean(r['returns']):.1f} "
              f"± {np.std(r['returns']):.1f} (eval {eval_s:.1f} s)", file=sys.stderr, flush=True)
    out = {
        "algo": args.algo, "seed": args.seed, "env": args.env, "episodes": args.episodes,
        "reset_seeds": list(range(args.episodes)), "results": results, "train_seconds": train_s,
        **({"curve": curve} if args.eval_every else {}),
        "eval_seconds": eval_s, "final_lr": final_lr, "n_episodes_in_dataset": len(dataset.episodes),
        "versions": {"d3rlpy": d3rlpy.__version__, "torch": torch.__version__, "gymnasium": gymnasium.__version__},
        "settings": recorded_settings(args),
        "d3rlpy_config": cfg.serialize(),
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
