# Two commands do all the set-up on a fresh clone:
#   make example   creates .venv and runs the digits example end to end
#   make test      creates .venv and runs the whole test suite
# TORCH pins the CPU build that lies on this project's machines; elsewhere set TORCH=torch
# (or a build of your choice) to let pip pick one: `make test TORCH=torch`.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainfold-installed

.PHONY: example test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,examples]"
	touch $(STAMP)

example: $(STAMP)
	$(PY) examples/digits.py

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/bench.py --processes 5 --rounds 6

clean:
	rm -rf $(VENV)
