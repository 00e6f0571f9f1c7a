# `make run` installs and runs the default job; `make test` installs and runs the test suite.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install run test test-fast clean-outputs

install:
	@bash scripts/install.sh

run: install
	$(PY) -m llama_fsdp

test: install
	$(PY) -m pytest -q --durations=15

test-fast: install
	$(PY) -m pytest -q -m "not slow and not integration"

clean-outputs:
	@echo "outputs/ holds your runs and MLflow store; remove it by hand if you mean it."
