# Two commands do all the set-up on a fresh clone:
#   make example   creates .venv and runs the digits example end to end
#   make test      creates .venv, type-checks src/ (mypy --strict) and runs the whole test suite, then the DeepSpeed tests (DeepSpeed
#                  in .deepspeed-site), then the core tests again with the oldest Accelerate
#                  trainfold supports (in .venv-floor); every part runs, and the end says which passed
#   make test-quick  the type check and the in-process tests only
# TORCH pins the CPU build that lies on this project's machines; elsewhere set TORCH=torch
# (or a build of your choice) to let pip pick one: `make test TORCH=torch`.

PYTHON ?= python3
VENV ?= .venv
FLOOR_VENV ?= .venv-floor
TORCH ?= torch==2.13.0
# The lowest versions pyproject.toml admits; make test-floor runs the core tests against them (of the multi-process
# ones, those of test_distributed.py: what goes through Accelerate's DDP and loaders; the signal agreement is trainfold's
# and torch's own, tested in the main run).
FLOOR ?= accelerate==1.0.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.trainfold-installed
FLOOR_STAMP := $(FLOOR_VENV)/.trainfold-installed
DS_SITE := .deepspeed-site
DS_STAMP := $(DS_SITE)/.trainfold-installed
# Tensor parallelism's tests need transformers: Accelerate checks its version when a ParallelismConfig has tp_size, and
# under TP + FSDP2 imports its ReplicateParallel, which transformers 5 no longer has. 4.57 is the newest release with it,
# and it wants huggingface_hub below 1.0 (.venv has a newer one): both live apart, put first on the path of those tests'
# processes only (tests/helpers.py, TP_SITE).
TP_SITE := .tp-site
TP_STAMP := $(TP_SITE)/.trainfold-installed
# Ray Train, for its engine test (tests/test_engines.py): ray and what it needs live apart, on the path of the Ray
# driver's processes only (its workers inherit it): its numpy, pandas and pyarrow never meet .venv's other tests.
RAY_SITE := .ray-site
RAY_STAMP := $(RAY_SITE)/.trainfold-installed
RAY ?= ray[train]==2.60.0
# etcd, for the test of torchrun's etcd rendezvous: Debian's etcd-server, installed where make may (as root, with
# apt-get); elsewhere that test is skipped, and says why. (Its client, python-etcd, is a dev dependency.)
ETCD_STAMP := $(VENV)/.etcd-tried
# Azurite, Microsoft's Azure Storage emulator (Node.js, from the npm registry): the az:// tests run against it on 127.0.0.1
AZURITE ?= azurite@3.37.0
AZ_STAMP := .azurite/.installed
FLOOR_TESTS := tests/test_equivalence.py tests/test_step.py tests/test_checkpoint.py tests/test_snapshot.py tests/test_evaluate.py tests/test_tokens.py tests/test_distributed.py tests/test_signals.py

.PHONY: example test test-quick test-types test-docs docs test-inprocess test-multiprocess test-deepspeed test-floor test-wheel bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev,examples]"
	touch $(STAMP)

# DeepSpeed lives apart from .venv: once installed, Accelerate imports it (and it prints a warning) in every
# process that unwraps a model. It ships as source that imports torch to build: built against .venv's torch,
# its ops compiled on first use (its tests run on CPU). transformers: Accelerate's DeepSpeed path imports it; the
# transformers export tests and the peft tests (adapters) run here too. peft without its dependencies: they are
# .venv's and this folder's (its torch requirement would fetch another torch). DeepSpeed's CPU backend compiles its
# shared-memory op (C++, ~35 s, into ~/.cache/torch_extensions) when a process first starts its group: compiled here,
# with the rest of the set-up, rather than inside the first test.
$(DS_STAMP): $(STAMP)
	rm -rf $(DS_SITE)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation --no-deps --target $(DS_SITE) "deepspeed>=0.16"
	$(PY) -m pip install --quiet --target $(DS_SITE) hjson "pydantic>=2" msgpack ninja py-cpuinfo einops "transformers>=4.46"
	$(PY) -m pip install --quiet --no-deps --target $(DS_SITE) "peft>=0.17"
	PYTHONPATH=$(DS_SITE) $(PY) -c "from deepspeed.accelerator import get_accelerator; get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $(DS_STAMP)

# datasets too: Accelerate's loader imports it wherever it is installed (.venv has it for the streamed-data tests), and
# .venv's needs a huggingface_hub this folder shadows; 4.4 takes hub 0.x (with httpx, which .venv lacks).
$(TP_STAMP): $(STAMP) Makefile
	rm -rf $(TP_SITE)
	$(PY) -m pip install --quiet --no-deps --target $(TP_SITE) "transformers==4.57.6" "huggingface_hub>=0.34,<1.0" "tokenizers>=0.22,<0.23" \
		"datasets==4.4.1" httpx httpcore h11
	touch $(TP_STAMP)

$(RAY_STAMP): $(STAMP) Makefile
	rm -rf $(RAY_SITE)
	$(PY) -m pip install --quiet --target $(RAY_SITE) "$(RAY)"
	touch $(RAY_STAMP)

$(ETCD_STAMP): $(STAMP)
	@command -v etcd > /dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null && \
		{ apt-get install -y -q etcd-server > /dev/null 2>&1 || { apt-get update -q > /dev/null && apt-get install -y -q etcd-server > /dev/null; }; }; } || \
		echo "make: no etcd (Debian's etcd-server): the etcd rendezvous test is skipped"
	touch $(ETCD_STAMP)

$(AZ_STAMP):
	@command -v npm > /dev/null || { echo "make: the az:// tests need Azurite, installed with npm (Node.js): install Node.js and npm"; exit 1; }
	npm install --prefix .azurite --no-audit --no-fund --silent "$(AZURITE)"
	touch $(AZ_STAMP)

$(FLOOR_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/python -m pip install --quiet "$(TORCH)" "$(FLOOR)"
	$(FLOOR_VENV)/bin/python -m pip install --quiet -e ".[dev]" "$(FLOOR)"
	touch $(FLOOR_STAMP)

example: $(STAMP)
	$(PY) examples/digits.py

# The documentation site (mkdocs.yml): the guides in docs/guides/, the API reference from the docstrings.
# --strict: a broken link, a public name without its API entry, or a docstring without its sections fails the build.
# Not --quiet: it lowers the log level below warnings, and --strict fails only on the warnings it sees.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "the site is in site/: serve it with $(VENV)/bin/python -m http.server -d site 8000 and open http://127.0.0.1:8000/ (search needs a server)"

test-docs: docs

# The suite in two parts: the tests that run in this process, spread over the cores by pytest-xdist, then the ones
# marked multiprocess (they spawn torchrun jobs and gloo process groups, or time a stop), two at a time: much of their
# time is spent waiting (for a checkpoint to kill after, a lease to lapse, a signal's stop), so two keep 2 cores busy
# (one at a time: ~60% busy, 15 min; two: ~95%, 10 min). Their limits stretch with the machine's load.
XDIST ?= -n auto --maxprocesses 4
XDIST_MP ?= -n 2

# Every part runs even when one before it failed; the end says which ran and passed (tests/suite.sh).
test: $(STAMP)
	MAKE="$(MAKE)" bash tests/suite.sh

# The type check and the in-process tests: what to run after a change, in about two minutes.
test-quick: test-types test-inprocess

test-types: $(STAMP)
	$(PY) -m mypy src/trainfold
	$(PY) -m ruff check --no-cache .
	$(PY) -m ruff format --no-cache --check .

test-inprocess: $(STAMP) $(AZ_STAMP)
	$(PY) -m pytest $(XDIST) -m "not multiprocess"

test-multiprocess: $(STAMP) $(TP_STAMP) $(RAY_STAMP) $(ETCD_STAMP)
	$(PY) -m pytest $(XDIST_MP) -m multiprocess --durations=15

test-deepspeed: $(DS_STAMP)
	PYTHONPATH=$(DS_SITE) $(PY) -m pytest -o addopts="-p no:cacheprovider" $(XDIST_MP) --durations=10 tests/test_deepspeed.py tests/test_export_transformers.py tests/test_peft.py tests/test_flops.py

test-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -c "import accelerate, torch; print('floor: accelerate', accelerate.__version__, 'torch', torch.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -o addopts="-p no:cacheprovider" $(XDIST) -m "not multiprocess" $(FLOOR_TESTS)
	$(FLOOR_VENV)/bin/python -m pytest -o addopts="-p no:cacheprovider" $(XDIST_MP) -m multiprocess tests/test_distributed.py -k "not digits_example"

# The wheel a user installs, not the editable tree: built (sdist and wheel, into dist/), installed into a fresh
# .venv-wheel, and used from outside the source tree: the digits example, the pytest plugin, the version it reports.
WHEEL_VENV ?= .venv-wheel
test-wheel: $(STAMP)
	rm -rf dist $(WHEEL_VENV)
	$(PY) -m build --no-isolation --outdir dist . > /dev/null
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(WHEEL_VENV)/bin/python -m pip install --quiet "$$(ls dist/trainfold-*.whl)[examples]" pytest
	WHEEL_PY=$(abspath $(WHEEL_VENV))/bin/python SRC=$(CURDIR) bash tests/wheel_check.sh

# The peers (pytorch-accelerated, Lightning) come with the bench extra; bench.py names any it has to skip.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/bench.py --processes 5 --rounds 6

clean:
	rm -rf $(VENV) $(FLOOR_VENV) $(DS_SITE) $(TP_SITE) $(RAY_SITE) $(WHEEL_VENV) dist site .azurite
