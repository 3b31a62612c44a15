# The two quick-start commands: `make run` and `make test`. Both create .venv and install
# on first use, printing one "glassbox: ..." line per step, then one line naming the torch
# build and whether a GPU was found. `make run` installs what serving needs (pip install -e .);
# `make test` (and lint, format) also the test extras (pip install -e ".[test]": pytest, ruff,
# schemathesis, ray ...) — after a `make run`, as one more step.
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
# pytest processes for `make test` (pytest-xdist); 0 runs the suite in this one process.
TEST_WORKERS ?= 2

BIN := $(VENV)/bin
# torch and glassbox (what `make run` needs), and the test extras on top (`make test`).
STAMP := $(VENV)/.glassbox-installed
TEST_STAMP := $(VENV)/.glassbox-test-installed
# What step 3 installs: "." for `make run`; the targets that need the test extras set ".[test]"
# (a target-specific value, so it holds while their prerequisites are made).
GLASSBOX_PIP := .

.PHONY: install install-test run test lint format default-model moe-model clean

$(STAMP): pyproject.toml Makefile
	@if [ -x $(BIN)/python ]; then echo "glassbox: [1/3] using the virtualenv $(VENV)"; \
	else echo "glassbox: [1/3] creating the virtualenv $(VENV)"; $(PYTHON) -m venv $(VENV) || exit 1; fi
	@echo "glassbox: [2/3] installing $(TORCH_SPEC) (the first time takes minutes: on Linux x86-64 the default is the CUDA build, ~2.7 GB; README says how to get the CPU one)"
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	@echo "glassbox: [3/3] installing glassbox and its dependencies (pip install -e \"$(GLASSBOX_PIP)\")"
	$(BIN)/python -m pip install --quiet -e "$(GLASSBOX_PIP)"
	@if [ "$(GLASSBOX_PIP)" = ".[test]" ]; then touch $(STAMP) $(TEST_STAMP); else touch $(STAMP); fi
	@echo "glassbox: installed into $(VENV)"

# The test extras, unless step 3 just installed them (then this stamp is as new as $(STAMP)).
$(TEST_STAMP): $(STAMP)
	@if [ -e $@ ] && ! [ $(STAMP) -nt $@ ]; then exit 0; fi; \
	echo "glassbox: installing the test extras (pip install -e \".[test]\")"; \
	$(BIN)/python -m pip install --quiet -e ".[test]" && touch $@

install: $(STAMP)

install-test: $(TEST_STAMP)

install-test test lint format: GLASSBOX_PIP := .[test]

## run: serve the bundled default model on http://127.0.0.1:8000 (OpenAI-compatible API)
run: install
	@$(BIN)/python engine/cli/torch_info.py
	$(BIN)/glassbox serve $(SERVE_ARGS)

## test: lint, format check, and the CPU test suite
test: install-test lint
	@$(BIN)/python engine/cli/torch_info.py
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30 $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install-test
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

## default-model: retrain engine/assets/default_model (scripts/train_default_model.py; ~15 min on 2 quiet cores)
default-model: install
	$(BIN)/python scripts/train_default_model.py

## moe-model: remake engine/assets/moe_model from the default model (scripts/train_moe_model.py; minutes)
moe-model: install
	$(BIN)/python scripts/train_moe_model.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
