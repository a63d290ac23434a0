# Sourced by the shell scripts of scripts/ (after they cd to the repository root): the
# rl-tformers command and the Python of this checkout's .venv, else those on PATH; $RLT and $PY,
# when set, name others (the tests use stand-ins).
RLT=${RLT:-.venv/bin/rl-tformers}
[ -x "$RLT" ] || RLT=rl-tformers
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
