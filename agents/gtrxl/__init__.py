"""The GTrXL agents: offline ``gtrxl`` (:mod:`.agent`) and online ``gtrxl_ppo`` (:mod:`.ppo`);
importing the package registers both."""

from rl_tformers.agents.gtrxl import agent, ppo  # noqa: F401  (register gtrxl, gtrxl_ppo)
