# Everything runs inside .venv, created on first use. torch is pinned for development and tests;
# the package itself needs torch>=2.6. `make demo` installs only what the demo needs (torch and
# the package); the other targets add the development tools.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
DEV := $(VENV)/.installed-dev

.PHONY: test lint typecheck unit demo bench docs clean

$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
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

demo: $(BASE)
	$(PY) -m credit.parallel demo

bench: $(DEV)
	$(PY) benchmarks/run.py --json bench-results/bench.json --plot docs/_static/bench.png

docs: $(DEV)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) docs/_build .pytest_cache .mypy_cache .ruff_cache
