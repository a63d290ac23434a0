"""Benchmarks (``rl-tformers bench ...``): each module measures one thing against a baseline
run in the same process and reports ratios.

Adding a benchmark: create a module here with a ``register(bench_app: typer.Typer)`` function
that adds its command(s) to the ``bench`` group; :mod:`rl_tformers.cli.bench` imports
every module of this package and calls it (modules starting with ``_`` are skipped).

- :mod:`~rl_tformers.bench.attention`: every attention kind vs dense SDPA (time, peak memory,
  crossover lengths), plus registered RL-scale cases.
- :mod:`~rl_tformers.bench.memory`: peak-memory measurement on CPU and CUDA.
- :mod:`~rl_tformers.bench.train`: DT training updates/s vs d3rlpy and Hugging Face, MFU.
- :mod:`~rl_tformers.bench.eval`: batched vs one-env-at-a-time evaluation; memory vs re-encoding.
- :mod:`~rl_tformers.bench.data`: sampler samples/s vs training; loading a 1M-step HDF5 file.
"""
