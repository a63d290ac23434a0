"""Peer worker of ``rl-tformers bench train``: times Decision Transformer training steps of
d3rlpy's ``DecisionTransformer`` or Hugging Face's ``DecisionTransformerModel``.

A standalone script (it must not import rl_tformers: it runs in the peers' own virtual
environment, ``.bench-venvs/peers``, because d3rlpy 2.8 pins gymnasium 1.0.0). Started as::

    python _peer_dt.py --impl d3rlpy|hf --data bench_data.npz --threads 1 --device cpu

``bench_data.npz`` (written by :mod:`rl_tformers.bench.train`) holds the Hopper dataset
(``observations, actions, rewards, terminals, timeouts``, D4RL layout) and pre-sampled training
batches from rl-tformers' own window sampler (``b_obs (M, B, K, obs)`` normalised, ``b_actions``
in [-1, 1], ``b_rtg (M, B, K)`` / 1000, ``b_timesteps``, ``b_mask``) plus ``meta`` (JSON).

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout (everything the
libraries print goes to stderr)::

    -> {"cmd": "run", "mode": "e2e" | "model", "steps": n}   <- {"seconds": s, "steps": n, "loss": x}
    -> {"cmd": "flops"}                                      <- {"flops": f}   (one step, fwd + bwd)
    -> {"cmd": "memory"}      <- {"rss_start", "rss_built", "peak_rss_built", "peak_rss" (bytes), ...}
    -> {"cmd": "quit"}

The first line written is ``{"ready": true, "impl": ..., "versions": {...}, "params": n, ...}``.

Settings, both peers (the paper's, table 8): context 20, 3 layers, 1 head, 128 dims, ReLU,
dropout 0.1 (embedding, attention, residual), batch 64, AdamW lr 1e-4, weight decay 1e-4, grad
clip 0.25, linear warmup 10k. d3rlpy as in its reproduction script
(``reproductions/offline/decision_transformer.py``): ``GPTAdamWFactory``, a 128-unit linear state
encoder, standard observation scaler, reward scale 0.001. Modes: ``e2e`` = what ``fit`` does
per step (d3rlpy: ``sample_trajectory_batch`` + ``update``); ``model`` = pre-sampled batches,
one ``update`` each. Hugging Face has no offline-RL data pipeline, so it runs ``model`` only
(its ``e2e`` is refused): forward, masked MSE on actions, backward, clip, ``torch.optim.AdamW``.

Discrete actions (``meta["discrete"]``, the pixel task): d3rlpy's ``DiscreteDecisionTransformer``
with our config's sizes and optimiser settings from ``meta``; image observations (uint8
``(N, C, H, W)`` frames, kept so in d3rlpy's episodes, each sampled batch cast to float32) go
through d3rlpy's ``PixelEncoder`` with our ``minatar_cnn``'s layers plus the state embedding
(:func:`_pixel_encoder_factory`).
"""

from __future__ import annotations

import os
import sys

# This file's folder (rl_tformers/bench: train.py, eval.py, profile.py...) must not shadow
# modules of the standard library or of the peers (Python puts a script's folder first).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402


def _reply(out, obj) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _continuous_config(d3rlpy, meta):
    """The Hopper setting: d3rlpy's reproduction-script DT (see the module docstring)."""
    opt = d3rlpy.optimizers.GPTAdamWFactory(
        weight_decay=1e-4, clip_grad_norm=0.25,
        lr_scheduler_factory=d3rlpy.optimizers.WarmupSchedulerFactory(warmup_steps=10000),
    )
    return d3rlpy.algos.DecisionTransformerConfig(
        batch_size=int(meta["batch_size"]), learning_rate=1e-4, optim_factory=opt,
        encoder_factory=d3rlpy.models.VectorEncoderFactory([int(meta["d_model"])], exclude_last_activation=True),
        observation_scaler=d3rlpy.preprocessing.StandardObservationScaler(),
        reward_scaler=d3rlpy.preprocessing.MultiplyRewardScaler(1.0 / float(meta["reward_scale"])),
        context_size=int(meta["context_len"]), num_heads=int(meta["n_heads"]), num_layers=int(meta["n_layers"]),
        max_timestep=int(meta["max_ep_len"]), attn_dropout=0.1, resid_dropout=0.1, embed_dropout=0.1,
        activation_type="relu",
    )


def _pixel_encoder_factory(d3rlpy, meta):
    """An ``EncoderFactory`` of rl-tformers' ``minatar_cnn`` + state embedding: d3rlpy's own
    ``PixelEncoder`` (conv ``filters``, ReLU, fc ``features``, ReLU) followed by a
    ``Linear(features, d_model)``, the DT's state-embedding layer that d3rlpy otherwise folds into
    the encoder's last layer."""
    import dataclasses

    import torch
    from d3rlpy.models.torch.encoders import PixelEncoder

    enc = meta["encoder"]

    class StateEmbedding(torch.nn.Module):
        def __init__(self, observation_shape) -> None:
            super().__init__()
            self.cnn = PixelEncoder(observation_shape, filters=enc["filters"], feature_size=int(enc["features"]),
                                    dropout_rate=None)
            self.embed = torch.nn.Linear(int(enc["features"]), int(meta["d_model"]))

        def forward(self, x):  # (N, C, H, W) scaled by d3rlpy's PixelObservationScaler -> (N, d_model)
            return self.embed(self.cnn(x))

    @dataclasses.dataclass()
    class MinAtarEncoderFactory(d3rlpy.models.EncoderFactory):
        def create(self, observation_shape):
            return StateEmbedding(observation_shape)

        def create_with_action(self, observation_shape, action_size, discrete_action=False):
            raise NotImplementedError("the Decision Transformer encodes observations only")

        @staticmethod
        def get_type() -> str:
            return "rl_tformers_minatar_cnn"

    return MinAtarEncoderFactory()


def _discrete_config(d3rlpy, meta):
    """The pixel setting: ``DiscreteDecisionTransformer`` with our model's sizes, encoder,
    optimiser settings (AdamW, lr, weight decay, grad clip) and dropout; learned timestep
    embedding (``SIMPLE``) and no activation on the embeddings, as ours; frames scaled by 1/255
    (``PixelObservationScaler``) on each sampled batch."""
    image = bool(meta["image_obs"])
    opt = d3rlpy.optimizers.GPTAdamWFactory(weight_decay=float(meta["weight_decay"]),
                                            clip_grad_norm=float(meta["grad_clip"]))
    d = int(meta["d_model"])
    return d3rlpy.algos.DiscreteDecisionTransformerConfig(
        batch_size=int(meta["batch_size"]), learning_rate=float(meta["lr"]), optim_factory=opt,
        encoder_factory=(_pixel_encoder_factory(d3rlpy, meta) if image
                         else d3rlpy.models.VectorEncoderFactory([d], exclude_last_activation=True)),
        observation_scaler=(d3rlpy.preprocessing.PixelObservationScaler() if image
                            else d3rlpy.preprocessing.StandardObservationScaler()),
        reward_scaler=d3rlpy.preprocessing.MultiplyRewardScaler(1.0 / float(meta["reward_scale"])),
        context_size=int(meta["context_len"]), num_heads=int(meta["n_heads"]), num_layers=int(meta["n_layers"]),
        max_timestep=int(meta["max_ep_len"]), attn_dropout=float(meta["attn_dropout"]),
        resid_dropout=float(meta["dropout"]), embed_dropout=float(meta["dropout"]),
        activation_type=str(meta["activation"]), embed_activation_type="none",
        position_encoding_type=d3rlpy.PositionEncodingType.SIMPLE,
    )


class D3rlpyPeer:
    def __init__(self, data, meta, device: str, seed: int) -> None:
        import d3rlpy

        d3rlpy.seed(seed)
        self.d3rlpy = d3rlpy
        discrete = bool(meta.get("discrete", False))
        self.dataset = d3rlpy.dataset.MDPDataset(
            observations=data["observations"], actions=data["actions"], rewards=data["rewards"],
            terminals=data["terminals"].astype(float), timeouts=data["timeouts"].astype(float),
            **({"action_space": d3rlpy.ActionSpace.DISCRETE, "action_size": int(meta["act_dim"])} if discrete else {}),
        )
        k, b = int(meta["context_len"]), int(meta["batch_size"])
        config = _discrete_config(d3rlpy, meta) if discrete else _continuous_config(d3rlpy, meta)
        self.algo = config.create(device=device if device != "cpu" else False)
        from d3rlpy.algos.utility import build_scalers_with_trajectory_slicer

        build_scalers_with_trajectory_slicer(self.algo, self.dataset)
        self.algo.build_with_dataset(self.dataset)
        self.k, self.b = k, b
        self.presampled = [self.dataset.sample_trajectory_batch(b, length=k) for _ in range(8)]
        self.i = 0

    @property
    def model(self):
        return self.algo.impl.modules.transformer

    def observation_arrays(self):
        """The dataset's observations as d3rlpy holds them (one array per episode)."""
        return [ep.observations for ep in self.dataset.episodes]

    def step(self, mode: str) -> float:
        if mode == "e2e":
            batch = self.dataset.sample_trajectory_batch(self.b, length=self.k)
        else:
            batch = self.presampled[self.i % len(self.presampled)]
            self.i += 1
        return float(self.algo.update(batch)["loss"])  # d3rlpy reads the loss back every step

    def flops(self) -> int:
        from d3rlpy.torch_utility import TorchTrajectoryMiniBatch
        from torch.utils.flop_counter import FlopCounterMode

        impl = self.algo.impl
        batch = TorchTrajectoryMiniBatch.from_batch(
            self.presampled[0], device=impl.device, observation_scaler=self.algo.observation_scaler,
            action_scaler=self.algo.action_scaler, reward_scaler=self.algo.reward_scaler,
        )
        fc = FlopCounterMode(display=False)
        with fc:
            impl.compute_loss(batch).backward()
        impl.modules.optim.zero_grad()
        return int(fc.get_total_flops())


class HFPeer:
    def __init__(self, data, meta, device: str, seed: int) -> None:
        import numpy as np
        import torch
        from transformers import DecisionTransformerConfig, DecisionTransformerModel

        torch.manual_seed(seed)
        d = int(meta["d_model"])
        cfg = DecisionTransformerConfig(
            state_dim=int(meta["obs_dim"]), act_dim=int(meta["act_dim"]), hidden_size=d,
            max_ep_len=int(meta["max_ep_len"]), n_layer=int(meta["n_layers"]), n_head=int(meta["n_heads"]),
            n_inner=4 * d, activation_function="relu", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
            action_tanh=True, n_positions=1024,
        )
        self.dev = torch.device(device)
        self.model = DecisionTransformerModel(cfg).to(self.dev).train()
        self.attn_implementation = str(getattr(self.model.config, "_attn_implementation", "?"))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=1e-4)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min((s + 1) / 10000, 1.0))
        self.torch = torch
        t = lambda a, dt=torch.float32: torch.as_tensor(np.asarray(a), dtype=dt)  # noqa: E731
        m = data["b_obs"].shape[0]
        self.batches = [
            {
                "states": t(data["b_obs"][i]), "actions": t(data["b_actions"][i]),
                "returns_to_go": t(data["b_rtg"][i])[..., None], "timesteps": t(data["b_timesteps"][i], torch.long),
                "mask": t(data["b_mask"][i], torch.bool),
            }
            for i in range(m)
        ]
        self.i = 0

    def loss(self, b):
        out = self.model(states=b["states"], actions=b["actions"], rewards=None, returns_to_go=b["returns_to_go"],
                         timesteps=b["timesteps"], attention_mask=b["mask"].long(), return_dict=True)
        err = (out.action_preds - b["actions"]).pow(2).mean(-1)  # (B, K)
        w = b["mask"].float()
        return (err * w).sum() / w.sum().clamp_min(1.0)

    def step(self, mode: str) -> float:
        if mode != "model":
            raise ValueError("Hugging Face has no offline-RL data pipeline: only mode 'model' is measured")
        b = {k: v.to(self.dev) for k, v in self.batches[self.i % len(self.batches)].items()}
        self.i += 1
        loss = self.loss(b)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.25)
        self.opt.step()
        self.sched.step()
        return loss.detach()

    def flops(self) -> int:
        from torch.utils.flop_counter import FlopCounterMode

        fc = FlopCounterMode(display=False)
        with fc:
            self.loss(self.batches[0]).backward()
        self.opt.zero_grad(set_to_none=True)
        return int(fc.get_total_flops())

    def observation_arrays(self):
        """Hugging Face holds no dataset: the pre-sampled batches' states."""
        return [b["states"].numpy() for b in self.batches]


def _status_bytes(key):
    """A ``kB`` field of ``/proc/self/status`` in bytes (None where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes():
    """Resident memory now (VmRSS, bytes; None where there is none)."""
    return _status_bytes("VmRSS")


def _peak_rss_bytes() -> int:
    """Peak resident memory so far, bytes: VmHWM (this process image's peak), else ``getrusage``'s
    ``ru_maxrss`` (KiB on Linux; it keeps the benchmark process's peak across fork and exec)."""
    import resource

    hwm = _status_bytes("VmHWM")
    return hwm if hwm is not None else int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _memory(peer, rss_start, rss_built, peak_built) -> dict:
    """RSS after the imports, after data + model, the peak by then and the peak now (bytes), and
    the observations as the library holds them."""
    arrays = peer.observation_arrays()
    return {"rss_start": rss_start, "rss_built": rss_built, "peak_rss_built": peak_built,
            "peak_rss": _peak_rss_bytes(),
            "observations_dtype": str(arrays[0].dtype), "observations_bytes": int(sum(a.nbytes for a in arrays)),
            "observations_held": f"{len(arrays)} arrays"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("d3rlpy", "hf"), required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = sys.stdout
    sys.stdout = sys.stderr  # library output must not reach the protocol stream

    import numpy as np
    import torch

    torch.set_num_threads(max(1, args.threads))
    __import__("d3rlpy" if args.impl == "d3rlpy" else "transformers")
    rss_start = _rss_bytes()
    data = dict(np.load(args.data))
    meta = json.loads(str(data.pop("meta")))
    peer = D3rlpyPeer(data, meta, args.device, args.seed) if args.impl == "d3rlpy" else HFPeer(
        data, meta, args.device, args.seed)
    rss_built, peak_built = _rss_bytes(), _peak_rss_bytes()
    versions = {"torch": torch.__version__}
    for mod in ("d3rlpy", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            pass
    n_params = sum(p.numel() for p in peer.model.parameters() if p.requires_grad)
    _reply(out, {"ready": True, "impl": args.impl, "versions": versions, "params": n_params,
                 "threads": torch.get_num_threads(), "pid": os.getpid(),
                 "attn_implementation": getattr(peer, "attn_implementation", "d3rlpy CausalSelfAttention (matmul)")})

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["cmd"] == "quit":
                break
            if req["cmd"] == "flops":
                _reply(out, {"flops": peer.flops()})
            elif req["cmd"] == "memory":
                _reply(out, _memory(peer, rss_start, rss_built, peak_built))
            elif req["cmd"] == "run":
                sync()
                t0 = time.perf_counter()
                loss = None
                for _ in range(int(req["steps"])):
                    loss = peer.step(req["mode"])
                sync()
                _reply(out, {"seconds": time.perf_counter() - t0, "steps": int(req["steps"]), "loss": float(loss)})
            else:
                _reply(out, {"error": f"unknown command {req['cmd']!r}"})
        except Exception as exc:  # reported to the benchmark, which records it for this peer
            _reply(out, {"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
