"""rl_tformers.envs: the offline data layer (installed from the top-level ``envs/`` folder).

Modules (import them directly; this package imports nothing heavy):

* :mod:`~rl_tformers.envs.dataset`: :class:`EpisodeDataset` (flat step arrays + episode table),
  :class:`DatasetError`, :class:`DatasetMetadata`, :class:`LazyH5Array`.
* :mod:`~rl_tformers.envs.loaders`: ``load_dataset`` (Minari id / folder / D4RL HDF5),
  ``load_minari``, ``open_minari`` (lazy: :mod:`~rl_tformers.envs.minari_episodes`),
  ``load_d4rl_hdf5``, ``save_d4rl_hdf5``, ``data_root``.
* :mod:`~rl_tformers.envs.trajectory`: ``returns_to_go``, ``next_return_to_go``,
  ``observation_stats``, ``reward_scale``, ``top_fraction``.
* :mod:`~rl_tformers.envs.samplers`: ``WindowSampler`` (Decision Transformer), ``SegmentSampler``
  (recurrent agents); :mod:`~rl_tformers.envs.torch_data`: ``StepBatchDataset``, ``make_dataloader``,
  ``DeviceSampler`` (the dataset held on the training device, ``train.data_on_device``).
* :mod:`~rl_tformers.envs.scores`: ``normalized_score``, ``reference_scores`` (D4RL's and Atari's).
* :mod:`~rl_tformers.envs.pomdp`: ``ObservationMaskWrapper``, ``position_indices``, ``make_env``.
* :mod:`~rl_tformers.envs.environments`: ``make_task`` (POPGym's ids with the ``popgym`` extra,
  Atari and MinAtar ids with the ``atari`` extra, ``OneHotObservation``, ``FlatDiscreteAction``),
  the environments every agent acts in; :mod:`~rl_tformers.envs.pixels`: the Atari preprocessing
  and MinAtar's maps as ``(C, H, W)`` uint8; :mod:`~rl_tformers.envs.extras`: ``MissingExtraError``.
* :mod:`~rl_tformers.envs.frames`: ``stack_frames``, pixel datasets' frames stacked per sample.
* :mod:`~rl_tformers.envs.policies`, :mod:`~rl_tformers.envs.collect`,
  :mod:`~rl_tformers.envs.recipes`: behaviour policies, dataset collection, D4RL-style recipes.
* :mod:`~rl_tformers.cli.data`: ``rl-tformers collect`` and ``rl-tformers dataset``.
"""
