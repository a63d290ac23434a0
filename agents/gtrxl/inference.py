"""What acting adds to a trained offline GTrXL: early exit and the kNN-LM datastore.

:class:`GTrXLInference` holds the inference options of one
:class:`~rl_tformers.agents.gtrxl.agent.GTrXLAgent` (the exit threshold, calibrated or set, and the
datastore with the threshold its keys were computed for) and wraps the plain policy with them
(:meth:`GTrXLInference.wrap`), as :class:`~rl_tformers.agents.decision_transformer.inference.DTInference`
does for the Decision Transformer. The algorithms are in
:mod:`~rl_tformers.agents.gtrxl.early_exit` and :mod:`~rl_tformers.agents.gtrxl.knn_lm`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.common.knn_memory import KNNPolicyMemory
from rl_tformers.agents.common.policy import InferenceOptions
from rl_tformers.agents.decision_transformer.config import exit_threshold
from rl_tformers.agents.decision_transformer.early_exit import heldout_mask
from rl_tformers.agents.gtrxl.config import IQL_NO_EXIT, IQL_NO_KNN
from rl_tformers.agents.gtrxl.early_exit import EarlyExitPolicy, calibrate_exit_threshold
from rl_tformers.agents.gtrxl.knn_lm import KNNLMPolicy, build_datastore
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.samplers import SegmentSampler
from rl_tformers.envs.trajectory import ObsStats


class GTrXLInference(InferenceOptions):
    """The inference options of an offline GTrXL agent: early exit at a threshold and a kNN-LM datastore.

    Args:
        agent: the :class:`~rl_tformers.agents.gtrxl.agent.GTrXLAgent` (model, dataset
            statistics, options, ``to_segments``).
        load_data: reads the run's training dataset (for an agent loaded without it).

    Attributes:
        exit_threshold: early-exit threshold the policy acts with (None: the full model).
        knn_memory: the kNN-LM memory the policy interpolates with (None: none).
    """

    def __init__(self, agent: Any, load_data: Callable[[], EpisodeDataset]) -> None:
        self.agent = agent
        self._load_data = load_data
        self.exit_threshold: float | None = None
        self.knn_memory: KNNPolicyMemory | None = None
        self._knn_for: float | None = None  # the exit threshold the datastore's keys were computed with

    @property
    def early_exit(self) -> bool:
        """True when the model's depth kind is ``early_exit``."""
        return self.agent.model.encoder.early_exit

    def wrap(self, policy: Any) -> Any:
        """``policy`` with the options in use: an :class:`EarlyExitPolicy` at :attr:`exit_threshold`
        when the depth kind is ``early_exit``, then a :class:`KNNLMPolicy` with :attr:`knn_memory`.

        Raises:
            ValueError: the datastore was built for another exit threshold than the one in use.
        """
        if self.knn_memory is not None and self._knn_for != self.exit_threshold:
            raise ValueError(
                f"the kNN-LM datastore was built for early-exit threshold {self._knn_for} but the policy acts "
                f"with {self.exit_threshold}: its keys would not be the features the policy queries with; build "
                f"it again after setting the threshold")
        out = policy
        if self.early_exit:
            out = EarlyExitPolicy(policy, self.exit_threshold)
        if self.knn_memory is not None:
            out = KNNLMPolicy(out, self.knn_memory)
        return out

    def heldout_mask(self, num_episodes: int) -> np.ndarray:
        """(episodes,) bool: the calibration episodes, never trained on (every
        ``round(1 / agent.early_exit.heldout_frac)``-th; none without depth kind ``early_exit``)."""
        return heldout_mask(num_episodes, float(self.agent.options.early_exit.heldout_frac), self.early_exit)

    def training_data(self) -> EpisodeDataset:
        """The agent's dataset (read from ``cfg.dataset`` once for an agent loaded for inference).

        Raises:
            ValueError: the run's dataset cannot be read any more.
        """
        if self.agent.dataset is None:
            try:
                self.agent.dataset = self._load_data()
            except OSError as exc:
                raise ValueError(f"early-exit calibration and the kNN-LM datastore read the run's training dataset "
                                 f"(dataset.* in its config.yaml), which cannot be read now: {exc}") from exc
        return self.agent.dataset

    def sampler(self, data: EpisodeDataset, burn_in: int) -> SegmentSampler:
        """A segment sampler over ``data`` in the training units, with ``burn_in + 1`` leading steps."""
        info = self.agent.info
        shape = data.observation_shape
        stats = ObsStats(info.obs_mean.reshape(shape), info.obs_std.reshape(shape))
        return SegmentSampler(data, self.agent.seq_len, burn_in=burn_in + 1, reward_scale=info.reward_scale,
                              obs_stats=stats)

    def setup(self, early_exit: str | float | None = None, knn_lambda: float | None = None, knn_k: int | None = None,
              knn_max_entries: int | None = None) -> dict[str, Any]:
        """Evaluation options (``rl-tformers eval --early-exit / --knn-*``), else the config's
        (``agent.early_exit.threshold``, ``agent.knn.*``); each call replaces the previous setup.

        Returns:
            JSON-ready ``{"early_exit": {...}, "knn": {...}}`` for the options in use.
        Raises:
            ValueError: early exit without ``backbone.depth.kind=early_exit``, either option with
                ``agent.objective=iql``, a bad value.
        """
        info: dict[str, Any] = {}
        self.exit_threshold, self.knn_memory, self._knn_for = None, None, None
        o = self.agent.options
        ee = o.early_exit.threshold if early_exit is None else exit_threshold(early_exit, "--early-exit")
        if ee is not None and o.objective == "iql":
            raise ValueError(f"--early-exit with agent.objective=iql: {IQL_NO_EXIT}")
        if ee == "calibrate":
            info["early_exit"] = self.calibrate_early_exit()
        elif ee is not None:
            self.set_exit_threshold(ee)
            info["early_exit"] = {"threshold": ee}
        lam = float(o.knn.lam if knn_lambda is None else knn_lambda)
        if (lam > 0 or knn_lambda is not None) and o.objective == "iql":
            raise ValueError(f"--knn-lambda with agent.objective=iql: {IQL_NO_KNN}")
        if lam > 0 or knn_lambda is not None:
            info["knn"] = self.build_knn_memory(lam=lam, k=knn_k, max_entries=knn_max_entries)
        return info

    def set_exit_threshold(self, threshold: float | None) -> None:
        """Act with early exit at ``threshold`` (``None``: the full model).

        Raises:
            ValueError: the depth kind is not ``early_exit``, or ``threshold`` is not a finite number >= 0.
        """
        if threshold is not None and not self.early_exit:
            raise ValueError("gtrxl: early exit needs backbone.depth.kind=early_exit in the run's config")
        self.exit_threshold = None if threshold is None else exit_threshold(float(threshold), "early exit threshold")

    @torch.no_grad()
    def calibrate_early_exit(self, *, windows: int | None = None, candidates: Sequence[float] | None = None,
                             seed: int = 12345) -> dict[str, Any]:
        """Calibrate the exit threshold on ``windows`` segments of the held-out episodes (all episodes
        when none are held out) and act with it (:func:`calibrate_exit_threshold`; ``agent.early_exit``'s
        ``delta``, ``epsilon``, ``tol``). Segments are ``agent.burn_in + agent.seq_len`` steps, acted
        through step by step, all together.

        Returns:
            JSON-ready dict: ``threshold`` (None when no candidate passed), ``delta``, ``epsilon``,
            ``n``, ``tol``, ``heldout_episodes``, ``risks``.
        Raises:
            ValueError: the depth kind is not ``early_exit``, or the plain-window mode.
        """
        if not self.early_exit:
            raise ValueError("gtrxl: calibration needs backbone.depth.kind=early_exit in the run's config")
        o = self.agent.options.early_exit
        data = self.training_data()
        held = self.heldout_mask(data.num_episodes)
        cal_data = data.select(held) if held.any() else data
        n = int(o.windows if windows is None else windows)
        raw = self.sampler(cal_data, self.agent.burn_in).sample(n, np.random.default_rng(seed))
        dev = next(self.agent.model.parameters()).device
        seg = self.agent.to_segments({k: torch.as_tensor(v, device=dev) for k, v in raw.items()})
        thr, cal = calibrate_exit_threshold(self.agent.model, seg, tol=float(o.tol), delta=float(o.delta),
                                            epsilon=float(o.epsilon), candidates=candidates)
        self.set_exit_threshold(thr)
        return {"threshold": thr, "delta": float(o.delta), "epsilon": float(o.epsilon), "n": cal.n,
                "tol": None if self.agent.model_cfg.discrete else float(o.tol), "heldout_episodes": int(held.sum()),
                "risks": {str(t): r for t, r in sorted(cal.risks.items())}}

    @torch.no_grad()
    def build_knn_memory(self, *, lam: float | None = None, k: int | None = None, temperature: float | None = None,
                         max_entries: int | None = None, metric: str | None = None, seed: int = 0) -> dict[str, Any]:
        """Build the kNN-LM datastore from the training dataset (:func:`build_datastore`, with the exit
        threshold in use) and act with it; arguments default to ``agent.knn.*``.

        Returns:
            JSON-ready summary: ``entries``, ``lam``, ``k``, ``temperature``, ``metric``, ``build_s``.
        Raises:
            ValueError: the plain-window mode, or a continuous-action policy that samples.
        """
        o = self.agent.options.knn
        lam = float(o.lam if lam is None else lam)
        k_nb = int(o.k if k is None else k)
        temperature = float(o.temperature if temperature is None else temperature)
        max_entries = int(o.max_entries if max_entries is None else max_entries)
        metric = str(o.metric if metric is None else metric)
        if not self.agent.model_cfg.discrete and not self.agent.options.deterministic:
            raise ValueError("gtrxl: the kNN-LM memory gives continuous actions as the mean of the interpolated "
                             "mixture, not a draw; use agent.deterministic=true")
        t0 = time.perf_counter()
        data = self.training_data()
        store = build_datastore(self.agent.model, data, self.sampler(data, 0),
                                lambda raw: self.agent.to_segments(raw, burn_in=0), exit_threshold=self.exit_threshold,
                                max_entries=max_entries, metric=metric, seed=seed)
        self.knn_memory = KNNPolicyMemory(store, k=k_nb, lam=lam, temperature=temperature)
        self._knn_for = self.exit_threshold
        return {"entries": len(store), "lam": lam, "k": k_nb, "temperature": temperature, "metric": metric,
                "build_s": time.perf_counter() - t0}
