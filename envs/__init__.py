"""rl_tformers.envs package."""
