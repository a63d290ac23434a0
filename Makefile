# rl-tformers: two commands on a fresh machine.
#   make demo   create .venv if missing, install the package, run the main job (a small DT run)
#   make test   create/update the same .venv and run the default test suite (CPU; no network beyond the package index)
# Other targets: make test-slow (long checks), make lint, make bench, make clean.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-slow lint bench clean venv

venv: $(STAMP)

# Every install uses pip's configured index (PIP_INDEX_URL, pip.conf: a mirror or proxy applies).
# CPU-only machine: install the CPU build of torch (a local wheel first, else PyTorch's CPU-wheel
# index as an extra index, never a multi-GB CUDA build: on Linux its torch==X+cpu sorts above the
# configured index's torch==X, which is the CPU build already on macOS and Windows). Machine with
# CUDA: the venv sees the system site-packages so the user's own CUDA torch is kept; torch is
# installed only if it is not importable.
$(STAMP): pyproject.toml setup.py
	@if [ ! -x $(PY) ]; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "CUDA device found: creating $(VENV) with access to the system torch"; \
	    $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	@if ! $(PY) -c "import torch" >/dev/null 2>&1; then \
	  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(PIP) install "torch>=2.4"; \
	  else \
	    if $(PIP) download -q --no-deps --no-index -d $(VENV)/.torch-probe "torch==$(TORCH_VERSION)" >/dev/null 2>&1; then \
	      $(PIP) install "torch==$(TORCH_VERSION)"; \
	    else \
	      $(PIP) install --timeout 30 "torch==$(TORCH_VERSION)" --extra-index-url https://download.pytorch.org/whl/cpu; \
	    fi; \
	    rm -rf $(VENV)/.torch-probe; \
	  fi; \
	fi
	$(PIP) install -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rl-tformers demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VENV)/bin/rl-tformers bench --help

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
