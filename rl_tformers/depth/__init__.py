"""Backbone slot package 'depth': every module here registers its kinds on import."""

from rl_tformers._discover import import_submodules

import_submodules(__name__)
