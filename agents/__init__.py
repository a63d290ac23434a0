"""rl_tformers.agents package."""
