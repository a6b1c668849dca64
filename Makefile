# The two commands of the README: `make serve` (the whole server, embedded Redis, tiny model) and
# `make test`. Both set up .venv on first use: torch==2.13.0 first (the CPU build this machine holds),
# then the project, whose pyproject range 2.13.0 satisfies.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: serve test bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

serve: $(BIN)/.installed
	$(BIN)/ferry-server $(ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest $(ARGS)

# The serving benchmark (bench/serve_bench.py; bench/RESULTS.md): writes bench/out/. ARGS="--help" lists its options.
bench: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/serve_bench.py $(ARGS)
