# The two commands: `make up` runs the whole stack, `make test` runs the tests.
# Both build the virtual environment first (once, and again when pyproject.toml changes).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ENGINES ?= 2
PYTEST_ARGS ?=

.PHONY: up test check install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first: an open range alone could pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,engine,fast,bench,gateway]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/dpcoord up --engines $(ENGINES)

# Lint, types and the layer contracts of pyproject.toml (docs/architecture.md), then the tests.
check: $(STAMP)
	$(PY) -m ruff check service handlers engines tests benchmarks
	$(PY) -m ruff format --check service handlers engines tests benchmarks
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

test: check
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
