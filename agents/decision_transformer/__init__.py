"""rl_tformers.agents.decision_transformer package."""
