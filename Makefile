# The two set-up commands of the README: each makes .venv when missing, installs what it needs, and runs.
# `make test`: lint (ruff), type-check the core (mypy, configured in pyproject.toml), then the tests.
# Tests run in two worker processes (pytest-xdist), an idle one taking tests queued for the other.

# The Python: python3 (pip then installs the newest jax it takes: 0.10.2 on Python 3.11). The suite does
# not yet pass on jax 0.12 within CI's time (docs/reference/compatibility.md); in a fresh clone
# `make test PYTHON=python3.12` (on CI's machines pyenv's ~/.pyenv/versions/3.12.1/bin/python3.12) runs
# it there. A .venv made earlier keeps its Python: remove it to switch.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# One stamp per set of extras: the demo needs only the project; the tests add the dev tools and the
# `gpu-aot` extra (XLA's CUDA compiler and cuDNN, over 1 GB), which a CPU demo does not need.
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev,gpu-aot]'
	touch $@

.PHONY: test demo
test: $(TEST_STAMP)
	$(BIN)/python -c "import sys, jax, jaxlib; print('Python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --dist worksteal --durations=20

demo: $(DEMO_STAMP)
	$(BIN)/amsp-jax train --config configs/train/demo.yaml
