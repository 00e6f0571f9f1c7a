# `make run` installs and runs the default job; `make test` installs and runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install run test test-fast test-wheel test-floor clean-outputs

install:
	@bash scripts/install.sh

run: install
	$(PY) -m llama_fsdp

# two pytest workers: most tests wait on processes they start (ranks, SLURM, a server), so two
# at once fill 2 cores (measured: 22:11 with two, 23:46 with three; again on 2026-11-28 at
# 911 tests: 30:23 with two, 28:58 with three, the CPU busy 3,467 s and idle 9 s of it, so a
# third worker only adds contention); a module's tests stay on one worker, the SLURM tests
# share one
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --durations=15

test-fast: install
	$(PY) -m pytest -q -m "not slow and not integration"

test-wheel: install  # the wheel in a fresh venv, run from an empty directory
	bash scripts/check_wheel.sh

test-floor: install  # the oldest supported torch and transformers (the GPU image's), on the CPU
	bash scripts/test_floor.sh

clean-outputs:
	@echo "outputs/ holds your runs and MLflow store; remove it by hand if you mean it."
