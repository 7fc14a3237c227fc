# Everything runs inside .venv, created on first use. torch is pinned for development and tests;
# the package itself needs torch>=2.6.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck unit demo bench docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,docs,bench]'
	touch $(STAMP)

test: lint typecheck docs unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m credit.parallel demo

bench: $(STAMP)
	$(PY) -m credit.parallel bench --json bench-results/bench.json --plot docs/_static/bench.png

docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -q -b html docs docs/_build/html

clean:
	rm -rf $(VENV) docs/_build .pytest_cache .mypy_cache .ruff_cache
