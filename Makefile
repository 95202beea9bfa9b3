# The two set-up commands of the README: each makes .venv when missing, installs what it needs, and runs.
# `make test`: lint (ruff), type-check the core (mypy, configured in pyproject.toml), then the tests.
# Tests run in two worker processes (pytest-xdist), an idle one taking tests queued for the other.

# The Python: the first Python 3.12 found (on PATH, else pyenv's), where pip installs the newest jax
# (0.12); python3 where there is none (on Python 3.11 pip stops at jax 0.10.2). On CI's machines
# `python3.12` on PATH is a pyenv shim that fails, and ~/.pyenv/versions/3.12.*/bin/python3.12 is taken.
# `make test PYTHON=python3.11` picks one. A .venv made earlier keeps its Python: remove it to switch.
FIND_PYTHON := for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
	"$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$$p"; exit; }; \
	done; echo python3
PYTHON ?= $(shell $(FIND_PYTHON))
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
