# The two commands: `make demo` and `make test`. Everything else is for developers.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast lint protos bench demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not e2e'

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

protos: $(STAMP)
	$(BIN)/python -m istio_agent.protos.generate

bench: $(STAMP)
	$(BIN)/python -m bench.sds
	$(BIN)/python -m bench.xds
	$(BIN)/python -m bench.startup
	$(BIN)/python -m bench.metrics

demo: $(STAMP)
	$(BIN)/agentctl demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
