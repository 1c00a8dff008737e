# The two commands: `make up` runs the whole stack, `make test` runs the tests.
# Both build the virtual environment first (once, and again when pyproject.toml changes).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ENGINES ?= 2
PYTEST_ARGS ?=

DOCKER ?= docker
# Whether a Docker engine answers: `make test` then builds the images first, for the NATS fixture
# (testcontainers) and the container rehearsal (README, "Containers").
DOCKER_UP := $(shell $(DOCKER) info >/dev/null 2>&1 && echo yes)
DOCKER_BUILD := $(DOCKER) build --network host

.PHONY: up test check install clean images

install: $(STAMP)

# pip shows its progress where make runs on a terminal, and stays quiet (errors only) in a log,
# such as CI's: $(shell) hands its commands make's standard error, so [ -t 2 ] asks about it.
PIP_QUIET := $(shell [ -t 2 ] || echo --quiet)

$(STAMP): pyproject.toml
	@echo "Installing into $(VENV): torch and the dev tools, a few minutes the first time."
	python3 -m venv $(VENV)
	$(PY) -m pip install $(PIP_QUIET) --upgrade pip
	# The CPU wheel of torch first: an open range alone could pull a multi-GB CUDA build.
	$(PY) -m pip install $(PIP_QUIET) torch==2.13.0
	$(PY) -m pip install $(PIP_QUIET) -e '.[dev,engine,fast,bench,gateway,otel]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/dpcoord up --engines $(ENGINES)

# Lint, types and the layer contracts of pyproject.toml (docs/architecture.md), then the tests.
check: $(STAMP)
	$(PY) -m ruff check service handlers engines tests benchmarks
	$(PY) -m ruff format --check service handlers engines tests benchmarks
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

# The images into the local engine: the bases first (pulled, or made here: docker/local/bases.sh).
images: $(STAMP)
	bash docker/local/bases.sh
	$(DOCKER_BUILD) -f docker/coordinator.Dockerfile -t dpcoord/coordinator:local .
	$(DOCKER_BUILD) -f docker/gateway.Dockerfile -t dpcoord/gateway:local .
	$(DOCKER_BUILD) -f docker/engine.Dockerfile -t dpcoord/engine:local-cpu \
	  --build-arg BASE_IMAGE=dpcoord/torch-cpu:2.13.0 --build-arg REQUIRE_CUDA=0 .

test: check $(if $(DOCKER_UP),images)
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
