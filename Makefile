# Everything runs inside .venv, created on first use. torch is pinned for development and tests;
# the package itself needs torch>=2.10,<2.16 (`make test-compat` tests both ends). `make demo`
# installs only what the demo needs (torch and the package); the other targets add the
# development tools. `make test-integrations` runs the framework recipes (Lightning, accelerate,
# torchtitan, torchtune) in a venv of their own, .venv-integrations, and CREDIT's own trainer in
# .venv-credit.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
DEV := $(VENV)/.installed-dev

.PHONY: test test-fast lint typecheck unit demo bench docs clean test-torch test-compat test-gpu test-integrations

# The supported torch range (pyproject.toml), tested by `make test-compat` at both ends.
TORCH_FLOOR := 2.10.0
TORCH_NEWEST := 2.15.0

# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes torch from torch's own index (its CPU
# build); by default it comes from PyPI (on Linux, the CUDA build).
TORCH_INDEX ?=

$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(PY) -m pip install --quiet numpy
	$(PY) -m pip install --quiet -e .
	touch $(BASE)

$(DEV): $(BASE)
	$(PY) -m pip install --quiet -e '.[dev,docs,bench]'
	touch $(DEV)

test: lint typecheck docs unit

lint: $(DEV)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(DEV)
	$(VENV)/bin/mypy

unit: $(DEV)
	$(PY) -m pytest -q

# `make test-fast`: pytest alone, without the tests marked slow (pyproject.toml registers the
# marker; tests/README.md lists what each file covers). About a minute on two cores; `make test`
# and `make unit` still run every test.
test-fast: $(DEV)
	$(PY) -m pytest -q -m "not slow"

demo: $(BASE)
	$(PY) -m credit.parallel demo

bench: $(DEV)
	$(PY) benchmarks/run.py --json bench-results/bench.json --plot docs/_static/bench.png

docs: $(DEV)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

# `make test-torch TORCH=X.Y.Z`: the whole suite against that torch release, in its own venv.
# The constraint override lets releases newer than the machine's pinned torch install.
# DROP_VENV=1 removes the venv once its suite has passed (CI: each holds a 5-7 GB build of torch).
test-torch:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=X.Y.Z" >&2; exit 2; }
	$(MAKE) .venv-torch-$(TORCH)/.installed
	.venv-torch-$(TORCH)/bin/python -m pytest -q
	$(if $(filter 1,$(DROP_VENV)),rm -rf .venv-torch-$(TORCH))

test-compat:
	$(MAKE) test-torch TORCH=$(TORCH_FLOOR) DROP_VENV=$(DROP_VENV)
	$(MAKE) test-torch TORCH=$(TORCH_NEWEST) DROP_VENV=$(DROP_VENV)

.venv-torch-%/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-torch-$*
	PIP_CONSTRAINT=/dev/null .venv-torch-$*/bin/python -m pip install --quiet --no-cache-dir torch==$* -e '.[dev,docs]'
	touch $@

# `make test-integrations`: each framework's recipe run against the framework itself, on 4 gloo
# ranks (integration_tests/), the complete scripts of docs/examples/ run by the commands the
# Integrations page shows, and the install lines of the README and the docs in a fresh venv, with
# the versions the `integrations` extra pins and the test tools of `integration-tests`. torch is
# installed first, so that no framework pulls another build of it.
INTEGRATIONS := .venv-integrations

# CREDIT's own gen2 trainer (integration_tests/test_credit.py) runs in .venv-credit: miles-credit
# installs a regular `credit` package, which hides this one where it is installed editable (a
# namespace package), so this package goes in after it, non-editable, as its users install it.
# CREDIT's model modules import torchvision, and PyPI's torchvision 0.28.0 (for torch 2.13.0) is
# linked against PyPI's CUDA build of torch: beside a CPU build of 2.13.0 it fails to import.
# PyPI's torch 2.14.1 with torchvision 0.29.1 import and run on the CPU.
CREDIT_VENV := .venv-credit
CREDIT_TORCH := torch==2.14.1 torchvision==0.29.1

$(CREDIT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(CREDIT_VENV)
	$(CREDIT_VENV)/bin/python -m pip install --quiet $(CREDIT_TORCH)
	$(CREDIT_VENV)/bin/python -m pip install --quiet $(CREDIT_TORCH) '.[credit-tests]'
	$(CREDIT_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall .
	touch $@

test-integrations: $(INTEGRATIONS)/.installed $(CREDIT_VENV)/.installed
	$(INTEGRATIONS)/bin/python -m pytest -q integration_tests --ignore=integration_tests/test_credit.py
	$(CREDIT_VENV)/bin/python -m pytest -q integration_tests/test_credit.py

$(INTEGRATIONS)/.installed: pyproject.toml
	$(PYTHON) -m venv $(INTEGRATIONS)
	$(INTEGRATIONS)/bin/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==2.13.0
	$(INTEGRATIONS)/bin/python -m pip install --quiet numpy
	$(INTEGRATIONS)/bin/python -m pip install --quiet torch==2.13.0 -e '.[integration-tests]'
	touch $@

# `make test-gpu`: the checks that need a CUDA GPU, with the interpreter at hand and nothing
# installed but torch and pytest (tests/gpu_check.sh; the log goes to gpu-check.log).
test-gpu:
	PYTHON=$(PYTHON) tests/gpu_check.sh

clean:
	rm -rf $(VENV) .venv-torch-* $(INTEGRATIONS) $(CREDIT_VENV) docs/_build .pytest_cache .mypy_cache .ruff_cache build gpu-check.log
