# Everyday commands. Each one sets up what it needs on a fresh machine (.venv, demo data).
#   make demo   set up, then run the whole pipeline on the embedded demo and print a summary
#   make test   the test suite (what CI runs); make test-quick leaves out the slow tests (servers, CLI runs, kills)
#   make check  lint, format check and types (ruff, mypy); CI runs it before the tests
#   make ui     the Dagster UI on http://127.0.0.1:3000 over the same local instance
#   make bench  the CPU benchmark (durations: docs/benchmarks.md): benchmarks/results/<date>-cpu.{json,md}
#   make bench-gpu  the GPU benchmark (one GPU): benchmarks/results/<date>-gpu.{json,md}

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME := $(CURDIR)/.dagster_home

.PHONY: demo test test-quick check ui bench bench-gpu install data instance clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# constraints.txt pins the CPU build of torch used here; GPU machines bring their own torch.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

data: install
	$(BIN)/python -m hsx_dagster.demo build --out data

instance:
	mkdir -p $(DAGSTER_HOME)
	cp deploy/local/dagster.yaml $(DAGSTER_HOME)/dagster.yaml

DAGSTER_MATERIALIZE := $(BIN)/dagster asset materialize -m hsx_dagster.definitions

demo: data instance
	$(DAGSTER_MATERIALIZE) --select tokenized_dataset
	# One run per shard, as on a GPU box (one shard per GPU); here they run one after another on the CPU.
	for shard in $$($(BIN)/python -c 'from hsx_dagster.core.settings import load_settings; print(*load_settings().shard_keys)'); do \
		$(DAGSTER_MATERIALIZE) --select hidden_states --partition $$shard || exit 1; \
	done
	$(DAGSTER_MATERIALIZE) --select drafter_dataset
	@echo
	@$(BIN)/python -m hsx_dagster.report

test: data
	$(BIN)/python -m pytest -q --durations=15

test-quick: data
	$(BIN)/python -m pytest -q -m "not slow" --durations=10

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: data
	$(BIN)/python -m benchmarks.cpu

# Needs the core's dependencies (torch, transformers, safetensors, pyarrow, pydantic-settings, ...), not dagster:
# runs with a GPU box's own Python when there is no .venv.
bench-gpu:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) benchmarks/gpu.py

ui: data instance
	$(BIN)/dagster dev -m hsx_dagster.definitions -h 127.0.0.1 -p 3000

clean:
	rm -rf data/out $(DAGSTER_HOME)
