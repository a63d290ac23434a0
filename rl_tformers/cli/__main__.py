"""``python -m rl_tformers.cli``: the ``rl-tformers`` command."""

from rl_tformers.cli import main

main()
