# The two set-up commands of the README: each makes .venv when missing, installs the project, and runs.
# `make test`: lint (ruff), type-check the core (mypy, configured in pyproject.toml), then the tests.
# Tests run in two worker processes (pytest-xdist), an idle one taking tests queued for the other.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,gpu-aot]'
	touch $(STAMP)

.PHONY: test demo
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --dist worksteal --durations=20

demo: $(STAMP)
	$(BIN)/amsp-jax train --config configs/train/demo.yaml
