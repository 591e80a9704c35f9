# Roundhouse: `make test` and `make run` each set up what they need on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install test lint types unit bench run plan clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# reinstall only when the pins change
$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

types: install
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest

# the README's test command: lint, types, the whole suite
test: lint types unit

bench: install
	$(PY) bench/engine_overhead.py

# what runs today: the demo fine-tune (prepares the demo model once), accuracy before and after
run: install
	$(VENV)/bin/roundhouse demo --models-dir data/models

plan: install
	$(VENV)/bin/roundhouse plan

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
