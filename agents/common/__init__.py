"""Pieces shared by the agents: the policy protocol used by evaluation, heads, utilities."""
