"""rl_tformers.agents.bc package."""
