# The two quick-start commands: `make run` and `make test`. Both create .venv and install
# everything on first use, printing one "glassbox: ..." line per step, then one line naming
# the torch build and whether a GPU was found.
# TORCH_SPEC is passed to pip as is. The default resolves, on Linux x86-64, to PyPI's CUDA
# build of torch (about 2.7 GB of wheels with its nvidia-*/cuda-* packages); elsewhere to a
# CPU build. CPU only (about 190 MB):
#   make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# Server flags: make run SERVE_ARGS="--port 8001 --max-model-len 1024"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SERVE_ARGS ?=
PYTEST_ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.glassbox-installed

.PHONY: install run test lint format default-model clean

$(STAMP): pyproject.toml Makefile
	@if [ -x $(BIN)/python ]; then echo "glassbox: [1/3] using the virtualenv $(VENV)"; \
	else echo "glassbox: [1/3] creating the virtualenv $(VENV)"; $(PYTHON) -m venv $(VENV) || exit 1; fi
	@echo "glassbox: [2/3] installing $(TORCH_SPEC) (the first time takes minutes: on Linux x86-64 the default is the CUDA build, ~2.7 GB; README says how to get the CPU one)"
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	@echo "glassbox: [3/3] installing glassbox and its dependencies (pip install -e \".[test]\")"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	@touch $(STAMP)
	@echo "glassbox: installed into $(VENV)"

install: $(STAMP)

## run: serve the bundled default model on http://127.0.0.1:8000 (OpenAI-compatible API)
run: install
	@$(BIN)/python engine/cli/torch_info.py
	$(BIN)/glassbox serve $(SERVE_ARGS)

## test: lint, format check, and the CPU test suite
test: install lint
	@$(BIN)/python engine/cli/torch_info.py
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## default-model: retrain engine/assets/default_model (scripts/train_default_model.py; ~15 min on 2 quiet cores)
default-model: install
	$(BIN)/python scripts/train_default_model.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
