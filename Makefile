# The two quick-start commands: `make run` and `make test`. Both create .venv and install
# everything on first use. GPU users: make run TORCH_SPEC="torch==2.13.0 --index-url <a CUDA index>"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.glassbox-installed

.PHONY: install run test lint format default-model clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

## run: serve the bundled default model on http://127.0.0.1:8000 (OpenAI-compatible API)
run: install
	$(BIN)/glassbox serve $(SERVE_ARGS)

## test: lint, format check, and the CPU test suite
test: install lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## default-model: rebuild engine/assets/default_model from scripts/make_default_model.py
default-model: install
	$(BIN)/python scripts/make_default_model.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
