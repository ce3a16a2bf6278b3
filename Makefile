# Everyday commands. Each one sets up what it needs on a fresh machine (.venv, demo data).
#   make demo   set up, then run the whole pipeline on the embedded demo and print a summary
#   make test   the test suite (what CI runs); make test-quick runs the unit and Dagster tiers (hsx_dagster_tests/unit,
#               defs, and the layout checks; not end_to_end) without the slow tests (servers, CLI runs, kills, whole-corpus
#               passes, the other values of sweeps: hsx_dagster_tests/support/sweeps.py), on every core, a module per
#               worker (its module fixtures built once)
#   make check  lint, format check and types (ruff, mypy); CI runs it beside the tests
#   make ui     the Dagster UI on http://127.0.0.1:3000 over the same local instance
#   make bench  the CPU benchmark (durations: docs/benchmarks.md): benchmarks/results/<date>-cpu.{json,md}, then the
#               host path at real widths: <date>-host-path.{json,md}
#   make bench-gpu  the GPU benchmark (one GPU): benchmarks/results/<date>-gpu.{json,md}, <date>-host-path-gpu.*
#   make bench-regen  regeneration throughput by concurrency on a local server: benchmarks/results/<date>-regeneration.{json,md}
#   make bench-scale  every step of the pipeline at 2 x 10^4 and 2 x 10^5 conversations: benchmarks/results/<date>-scale.{json,md}
#   make bench-acceptance  acceptance length of drafters trained on our data, against a target trained here (every step
#               cached; about 90 minutes on 2 quiet cores from nothing): benchmarks/results/<date>-acceptance.{json,md}
#   make acceptance-target  its target alone (cached): data/acceptance/<size>/, SIZE=ci|bench
#   make acceptance-data    and its drafters' data, every variant through the Dagster definitions (cached): .../<size>/data/

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DAGSTER_HOME := $(CURDIR)/.dagster_home

.PHONY: demo test test-quick check ui bench bench-gpu bench-regen bench-scale install data instance clean trainer-env \
	acceptance-target acceptance-data bench-acceptance

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# constraints.txt pins the CPU build of torch used here; GPU machines bring their own torch.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $@

data: install
	$(BIN)/python -m hsx_dagster.demo build --out data

# The acceptance benchmark's target and data (benchmarks/acceptance/); each is rebuilt only when its recipe changes.
SIZE ?= bench
acceptance-target: install
	$(BIN)/python -m benchmarks.acceptance.bench --size $(SIZE) --until target

acceptance-data: install
	$(BIN)/python -m benchmarks.acceptance.bench --size $(SIZE) --until data

bench-acceptance: install trainer-env
	$(BIN)/python -m benchmarks.acceptance.bench --size $(SIZE)

# Slots of the `gpu` pool: one per GPU that nvidia-smi lists, 1 without GPUs (`make instance GPUS=4` to choose).
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
instance:
	mkdir -p $(DAGSTER_HOME)
	sed 's/^\(    default_limit:\) .*/\1 $(or $(filter-out 0,$(strip $(GPUS))),1)/' deploy/local/dagster.yaml > $(DAGSTER_HOME)/dagster.yaml

DAGSTER_CLI := -m hsx_dagster.definitions
DAGSTER_MATERIALIZE := $(BIN)/dagster asset materialize $(DAGSTER_CLI)

demo: data instance
	# The inputs' content hashes first: every output records what it was made from (the UI then knows what is stale).
	$(BIN)/dagster job execute $(DAGSTER_CLI) -j observe_inputs
	# With regenerate.enabled the target first rewrites the assistant turns (docs/regeneration.md).
	if $(BIN)/python -c 'from hsx_dagster.core.settings import load_settings; exit(not load_settings().regenerate.enabled)'; then \
		$(DAGSTER_MATERIALIZE) --select regenerated_conversations || exit 1; \
	fi
	$(DAGSTER_MATERIALIZE) --select tokenized_dataset
	# One run per shard of the job hidden_states_shard, launched as the UI launches them (listed on the job's page and
	# each partition), as on a GPU box (one shard per GPU); here one after another on the CPU. Each run checks its
	# shard (blocking checks shard_coverage, shard_integrity, shard_numerics); python -m hsx_dagster.launch --help.
	$(BIN)/python -m hsx_dagster.launch $$($(BIN)/python -c 'from hsx_dagster.core.settings import load_settings; print(*load_settings().shard_keys)')
	$(DAGSTER_MATERIALIZE) --select drafter_dataset
	# The trainers' data folders, when asked (export.speculators, export.specforge: docs/trainers-*.md).
	for name in speculators specforge; do \
		if $(BIN)/python -c "from hsx_dagster.core.settings import load_settings; exit(not getattr(load_settings().export, '$$name'))"; then \
			$(DAGSTER_MATERIALIZE) --select $${name}_dataset || exit 1; \
		fi; \
	done
	@echo
	@$(BIN)/python -m hsx_dagster.report

# The isolated environment the trainer tests run speculators' and SpecForge's code in (hsx_dagster_tests/end_to_end/trainers/env.py);
# the tests build it on first use, this builds it ahead (CI starts it beside the other tests' set-up).
trainer-env: install
	$(BIN)/python -c 'from hsx_dagster_tests.end_to_end.trainers.env import trainer_python; print(trainer_python())'

# Two workers, a test module each at a time: the slow tests mostly wait on servers, subprocesses and the trainer
# environment, and one worker's wait is the other's CPU (the whole suite on 2 cores: docs/benchmarks.md). The modules
# in the order the suite's conftest gives them, the longest first (LONGEST_MODULES), not pytest-xdist's.
test: data
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25

test-quick: data
	$(BIN)/python -m pytest -q -m "not slow" -n auto --dist loadfile --durations=10 --ignore=hsx_dagster_tests/end_to_end

check: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: data
	$(BIN)/python -m benchmarks.cpu
	$(BIN)/python -m benchmarks.shared.host_path

bench-regen: data
	$(BIN)/python -m benchmarks.cpu.regeneration

# Resumable: a second call measures only the steps not recorded yet (python -m benchmarks.cpu.scale_run --help).
bench-scale: data
	$(BIN)/python -m benchmarks.cpu.scale_run

# Needs the core's dependencies (torch, transformers, safetensors, pyarrow, pydantic-settings, ...), not dagster:
# runs with a GPU box's own Python when there is no .venv (`-m` finds benchmarks/ here, installed or not).
bench-gpu:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m benchmarks.gpu
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m benchmarks.shared.host_path --device cuda

# dagster dev runs the webserver and the daemon, which evaluates the sensors: retry_failed_shards (a backfill of the
# failed shards), observe_inputs_on_change (an observation without a run when an input changed) and hsx_automation
# (drafter_dataset once every shard is newer).
ui: data instance
	$(BIN)/dagster dev $(DAGSTER_CLI) -h 127.0.0.1 -p 3000

clean:
	rm -rf data/out $(DAGSTER_HOME)
