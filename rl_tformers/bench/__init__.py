"""Benchmarks (`rl-tformers bench ...`): each module measures one thing against a baseline in the same process."""
