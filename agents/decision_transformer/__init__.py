"""The Decision Transformer agents: ``dt`` (:mod:`.agent`) and Online DT fine-tuning ``odt``
(:mod:`.online`); importing the package registers both."""

from rl_tformers.agents.decision_transformer import agent, online  # noqa: F401  (register dt, odt)
