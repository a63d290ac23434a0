"""rl_tformers.agents.gtrxl package."""
