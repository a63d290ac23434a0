"""Helpers of the benchmark plumbing tests."""

#: a backbone small enough for one update in milliseconds
TINY = ("backbone.d_model=16", "backbone.n_layers=1", "backbone.n_heads=1")
