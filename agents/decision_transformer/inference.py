"""What acting adds to a trained Decision Transformer: early exit and the kNN-LM datastore.

:class:`DTInference` holds the inference options of one :class:`~rl_tformers.agents.decision_transformer.agent.DTAgent`
(the exit threshold, calibrated or set, and the datastore with what its keys were computed for)
and wraps the plain policy with them (:meth:`DTInference.wrap`). The training side of the
agent does not use them. The algorithms are in
:mod:`~rl_tformers.agents.decision_transformer.early_exit` and
:mod:`~rl_tformers.agents.decision_transformer.knn_lm`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from rl_tformers.agents.common.knn_memory import KNNPolicyMemory
from rl_tformers.agents.common.offline import load_offline_dataset, plain
from rl_tformers.agents.common.policy import InferenceOptions
from rl_tformers.agents.decision_transformer.config import exit_threshold
from rl_tformers.agents.decision_transformer.early_exit import (
    EarlyExitPolicy,
    calibrate_exit_threshold,
    heldout_mask,
)
from rl_tformers.agents.decision_transformer.knn_lm import KNNLMPolicy, build_datastore
from rl_tformers.agents.decision_transformer.policy import DTPolicy, DTPolicyWrapper
from rl_tformers.envs.dataset import EpisodeDataset
from rl_tformers.envs.samplers import WindowSampler
from rl_tformers.envs.trajectory import ObsStats
from torch import Tensor


class DTInference(InferenceOptions):
    """The inference options of a DT agent: early exit at a threshold and a kNN-LM datastore.

    Args:
        agent: the :class:`~rl_tformers.agents.decision_transformer.agent.DTAgent` (its model,
            dataset statistics, options and acting context).
        to_model_batch: sampler arrays and dataset statistics -> a model-unit batch.

    Attributes:
        exit_threshold: early-exit threshold the policy acts with (None: the full model).
        knn_memory: the kNN-LM memory the policy interpolates with (None: none).
    """

    def __init__(self, agent: Any,
                 to_model_batch: Callable[[Mapping[str, Tensor], Any], dict[str, Tensor]]) -> None:
        self.agent = agent
        self._to_model_batch = to_model_batch
        self.exit_threshold: float | None = None  # set by set_exit_threshold / calibrate_early_exit
        self.knn_memory: KNNPolicyMemory | None = None  # set by build_knn_memory
        self._knn_for: tuple[float | None, int | None] | None = None  # what its keys were computed for

    def wrap(self, policy: DTPolicy) -> DTPolicy | DTPolicyWrapper:
        """``policy`` with the inference options in use: an
        :class:`~rl_tformers.agents.decision_transformer.early_exit.EarlyExitPolicy` at
        :attr:`exit_threshold` when the depth kind is ``early_exit`` (``None``: the backbone's
        stored threshold), then a :class:`~rl_tformers.agents.decision_transformer.knn_lm.KNNLMPolicy`
        with :attr:`knn_memory` when there is one.

        Raises:
            ValueError: the datastore was built for another threshold or acting context than the
                ones in use (its keys would not be the features the policy queries with).
        """
        if self.knn_memory is not None and self._knn_for not in (None, self._knn_built_for()):
            (thr, ctx), (now_thr, now_ctx) = self._knn_for, self._knn_built_for()
            raise ValueError(
                f"the kNN-LM datastore was built for early-exit threshold {thr} and acting context "
                f"{ctx or 'K'} but the policy now acts with threshold {now_thr} and context {now_ctx or 'K'}: its "
                f"keys would not be the features the policy queries with; call build_knn_memory() again "
                f"(or set the threshold / agent.eval_context_len before building it)")
        out: DTPolicy | DTPolicyWrapper = policy
        if policy.model.early_exit:
            out = EarlyExitPolicy(policy, self.exit_threshold)
        if self.knn_memory is not None:
            out = KNNLMPolicy(out, self.knn_memory)
        return out

    def heldout_mask(self, dataset: EpisodeDataset) -> np.ndarray:
        """(episodes,) bool: the calibration episodes of an ``early_exit`` run.

        Every ``round(1 / heldout_frac)``-th episode (the last of each group), so the split is
        deterministic and spread over the dataset; none when ``heldout_frac`` is 0 or the depth
        kind is not ``early_exit``.
        """
        return heldout_mask(dataset.num_episodes, float(self.agent.early_exit_options.heldout_frac), self.agent.model.early_exit)

    def training_data(self, dataset: EpisodeDataset | None) -> EpisodeDataset:
        """``dataset``, else the agent's training dataset (read from ``cfg.dataset`` once).

        Raises:
            ValueError: the run's dataset cannot be read any more (one line naming the cause).
        """
        if dataset is not None:
            return dataset
        if self.agent.dataset is None:
            try:
                self.agent.dataset = load_offline_dataset(plain(self.agent.cfg.dataset))
            except OSError as exc:  # moved or deleted since training: one error line, not a traceback
                raise ValueError(
                    f"early-exit calibration and the kNN-LM datastore read the run's training dataset "
                    f"(dataset.* in its config.yaml), which cannot be read now: {exc}") from exc
        return self.agent.dataset

    def sampler(self, dataset: EpisodeDataset) -> WindowSampler:
        """The training window sampler (its alignment, statistics and reward scale) over ``dataset``."""
        shape = dataset.observation_shape
        stats = ObsStats(self.agent.info.obs_mean.reshape(shape), self.agent.info.obs_std.reshape(shape))
        return WindowSampler(dataset, self.agent.model_cfg.context_len, align=self.agent.align, reward_scale=self.agent.info.reward_scale,
                             obs_stats=stats)

    def _knn_built_for(self) -> tuple[float | None, int | None]:
        """What the datastore keys depend on besides the weights: the exit threshold and the acting context."""
        return self.exit_threshold, self.agent.eval_context_len

    def setup(
        self, early_exit: str | float | None = None, knn_lambda: float | None = None, knn_k: int | None = None,
        knn_max_entries: int | None = None,
    ) -> dict[str, Any]:
        """Evaluation options (``rl-tformers eval --early-exit / --knn-lambda``), else the config's.

        Args:
            early_exit: ``"calibrate"`` (:meth:`calibrate_early_exit`), a threshold, ``"none"``
                (the full model), or ``None``: ``agent.early_exit.threshold``.
            knn_lambda: kNN-LM weight; > 0 builds the datastore (:meth:`build_knn_memory`).
                ``None``: ``agent.knn.lam``.
            knn_k, knn_max_entries: override ``agent.knn.k`` / ``agent.knn.max_entries``.
        Each call replaces the previous setup: a call with the defaults after one with a threshold
        or a datastore evaluates what the config says, not what the earlier call left.

        Returns:
            JSON-ready ``{"early_exit": {...}, "knn": {...}}`` for the options in use.
        Raises:
            ValueError: early exit without ``backbone.depth.kind=early_exit``, a bad value.
        """
        info: dict[str, Any] = {}
        self.exit_threshold, self.knn_memory, self._knn_for = None, None, None
        ee = self.agent.early_exit_options.threshold if early_exit is None else exit_threshold(early_exit, "--early-exit")
        if ee == "calibrate":
            info["early_exit"] = self.calibrate_early_exit()
        elif ee is not None:
            self.set_exit_threshold(ee)
            info["early_exit"] = {"threshold": ee}
        lam = float(self.agent.knn_options.lam if knn_lambda is None else knn_lambda)
        if lam > 0 or knn_lambda is not None:
            info["knn"] = self.build_knn_memory(lam=lam, k=knn_k, max_entries=knn_max_entries)
        return info

    def set_exit_threshold(self, threshold: float | None) -> None:
        """Evaluate with early exit at ``threshold`` (``None``: the full model).

        Raises:
            ValueError: the backbone's depth kind is not ``early_exit``, or ``threshold`` is not a
                finite number >= 0 (``agent.early_exit.threshold``'s range).
        """
        if threshold is not None and not self.agent.model.early_exit:
            raise ValueError("early exit needs backbone.depth.kind=early_exit in the run's config")
        self.exit_threshold = None if threshold is None else exit_threshold(float(threshold), "early exit threshold")

    @torch.no_grad()
    def calibrate_early_exit(
        self, dataset: EpisodeDataset | None = None, *, delta: float | None = None, epsilon: float | None = None,
        windows: int | None = None, candidates: Sequence[float] | None = None, seed: int = 12345,
    ) -> dict[str, Any]:
        """Calibrate the exit threshold on held-out windows and act with it (CALM sec. 4).

        ``windows`` windows are drawn from the held-out episodes (:meth:`heldout_mask`; all
        episodes when none are held out) with the training sampler; in each, only the last real
        step decides, as when acting (its window holds the K steps up to it). A decision is
        consistent when the early-exit action equals the full model's (discrete) or is within
        ``agent.early_exit.tol`` in every dimension (continuous, normalised units).
        :func:`~rl_tformers.depth.early_exit.calibrate_threshold` (Learn-then-Test with
        Hoeffding p-values) then picks the smallest candidate whose inconsistency is <= delta
        with probability >= 1 - epsilon.

        Args:
            dataset: the run's dataset (default: read from ``cfg.dataset``).
            delta, epsilon, windows: default ``agent.early_exit.*``.
            candidates: thresholds to test (default 0, 0.05, ..., 1).
            seed: window sampling seed.
        Returns:
            JSON-ready dict: ``threshold`` (None when no candidate passed: full model),
            ``delta``, ``epsilon``, ``n``, ``heldout_episodes``, ``risks`` {threshold: inconsistency}.
        Raises:
            ValueError: the depth kind is not ``early_exit``.
        """

        if not self.agent.model.early_exit:
            raise ValueError("calibration needs backbone.depth.kind=early_exit in the run's config")
        o = self.agent.early_exit_options
        delta = float(o.delta if delta is None else delta)
        epsilon = float(o.epsilon if epsilon is None else epsilon)
        windows = int(o.windows if windows is None else windows)
        data = self.training_data(dataset)
        held = self.heldout_mask(data)
        cal_data = data.select(held) if held.any() else data
        dev = next(self.agent.model.parameters()).device
        raw = self.sampler(cal_data).sample(windows, np.random.default_rng(seed))
        batch = self._to_model_batch({k: torch.as_tensor(v, device=dev) for k, v in raw.items()}, self.agent.info)
        tol = float(o.tol)
        thr, cal = calibrate_exit_threshold(self.agent.model, batch, context_steps=self.agent.eval_context_len, tol=tol,
                                            delta=delta, epsilon=epsilon, candidates=candidates)
        self.set_exit_threshold(thr)
        return {
            "threshold": thr, "delta": delta, "epsilon": epsilon, "n": cal.n,
            "tol": None if self.agent.model_cfg.discrete else tol,
            "heldout_episodes": int(held.sum()), "risks": {str(t): r for t, r in sorted(cal.risks.items())},
        }

    @torch.no_grad()
    def build_knn_memory(
        self, dataset: EpisodeDataset | None = None, *, lam: float | None = None, k: int | None = None,
        temperature: float | None = None, max_entries: int | None = None, metric: str | None = None,
        seed: int = 0, batch_windows: int = 256,
    ) -> dict[str, Any]:
        """Build the kNN-LM datastore from the training dataset and act with it.

        The datastore of :func:`~rl_tformers.agents.decision_transformer.knn_lm.build_datastore`
        (keys: the features the head reads when acting at each step, with this agent's acting
        context and exit threshold; values: the next actions), queried by the policy through
        :class:`~rl_tformers.agents.common.knn_memory.KNNPolicyMemory`.

        Args:
            dataset: default: read from ``cfg.dataset``.
            lam, k, temperature, max_entries, metric: default ``agent.knn.*``.
        Returns:
            JSON-ready summary: ``entries``, ``lam``, ``k``, ``temperature``, ``metric``, ``build_s``.
        """


        o = self.agent.knn_options
        lam = float(o.lam if lam is None else lam)
        k_nb = int(o.k if k is None else k)
        temperature = float(o.temperature if temperature is None else temperature)
        max_entries = int(o.max_entries if max_entries is None else max_entries)
        metric = str(o.metric if metric is None else metric)
        t0 = time.perf_counter()
        data = self.training_data(dataset)
        store = build_datastore(
            self.agent.model, data, self.sampler(data), lambda raw: self._to_model_batch(raw, self.agent.info), align=self.agent.align,
            context_steps=self.agent.eval_context_len, exit_threshold=self.exit_threshold, max_entries=max_entries,
            metric=metric, seed=seed, batch_windows=batch_windows)
        self.knn_memory = KNNPolicyMemory(store, k=k_nb, lam=lam, temperature=temperature)
        self._knn_for = self._knn_built_for()
        return {"entries": len(store), "lam": lam, "k": k_nb, "temperature": temperature, "metric": metric,
                "build_s": time.perf_counter() - t0}
