# `make run` installs and runs the default job; `make test` installs and runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install run test test-fast test-wheel test-floor clean-outputs

install:
	@bash scripts/install.sh

run: install
	$(PY) -m llama_fsdp

# three pytest workers on 2 cores: tests wait on the processes they start (ranks, SLURM, a
# server, paced steps), so with two the cores sat idle a fifth of the time (35 min of CPU in a
# 22 min run); a module's tests stay on one worker, the SLURM tests share one
TEST_WORKERS ?= 3

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=15

test-fast: install
	$(PY) -m pytest -q -m "not slow and not integration"

test-wheel: install  # the wheel in a fresh venv, run from an empty directory
	bash scripts/check_wheel.sh

test-floor: install  # the oldest supported transformers
	bash scripts/test_floor.sh

clean-outputs:
	@echo "outputs/ holds your runs and MLflow store; remove it by hand if you mean it."
