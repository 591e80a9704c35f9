# Roundhouse: `make test` and `make run` each set up what they need on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
PRETTIER := node_modules/.bin/prettier
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: mlflow-server install services test lint lint-js fmt-js types unit bench gpu-check gpu-bundle run sandbox demo demo-dpo demo-grpo plan docs clean

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

# the JavaScript formatter (prettier, pinned in package-lock.json): the web UI itself has no build
$(NODE_STAMP): package.json package-lock.json
	@command -v npm >/dev/null || { \
		echo "npm not found: installing Debian's nodejs and npm for the JavaScript formatter"; \
		apt-get update -qq && apt-get install -y -qq nodejs npm; \
	}
	npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

lint: install lint-js
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# fails when a file under web/js is not as the formatter writes it; `make fmt-js` rewrites them
lint-js: $(NODE_STAMP)
	$(PRETTIER) --check web/js

fmt-js: $(NODE_STAMP)
	$(PRETTIER) --write web/js

types: install
	$(VENV)/bin/mypy

# the service tests use a real Redis (and PostgreSQL where one answers on 127.0.0.1:5432)
services: sandbox
	@if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then \
		command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server); \
		redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no; \
		sleep 1; \
	fi
	@# the browser tests drive Debian's Chromium (never a downloaded browser)
	@test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq chromium)

# python graders' confinement (engine/graders/sandbox.py): Debian's bubblewrap (namespaces) and
# libseccomp (the system call filter); Landlock needs only the kernel
sandbox:
	@if ! command -v bwrap >/dev/null || ! ldconfig -p 2>/dev/null | grep -q 'libseccomp.so.2 '; then \
		if [ "$$(id -u)" = 0 ]; then \
			apt-get update -qq && apt-get install -y -qq bubblewrap libseccomp2; \
		else \
			echo "bubblewrap or libseccomp2 missing (apt-get install bubblewrap libseccomp2 as root):" \
				"python graders run with what the kernel offers, or are refused"; \
		fi; \
	fi

unit: install services mlflow-server
	$(PY) -m pytest

# the README's test command: lint, then the type check running beside the whole suite (the suite
# leaves a core idle while it waits on servers and workers); fails when either fails
test: lint services mlflow-server
	@log=$$(mktemp); $(VENV)/bin/mypy > $$log 2>&1 & types=$$!; \
	$(PY) -m pytest; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $$log; rm -f $$log; \
	test $$tests -eq 0 && test $$typed -eq 0

bench: install
	$(PY) bench/engine_overhead.py

# on a machine with NVIDIA GPUs: the CUDA tests, then equivalence, race injection, memory, host
# syncs and throughput checks, a PASS/WARN/FAIL table (`python bench/gpu_check.py --cpu` without one)
gpu-check: install
	$(PY) bench/gpu_check.py

# wheels for a bare GPU box (its own torch, no network): gpu-bundle/engine/ and gpu-bundle/peer/
# (roundpipe 0.1.1), for its Python; prints their size and the command to run there
GPU_PYTHON ?= 3.12
gpu-bundle: install
	$(PY) bench/bundle.py --python-version $(GPU_PYTHON)

# the service on this machine: API + worker on SQLite and the no-server broker, demo model and
# datasets prepared once, a login URL printed
run: install sandbox
	$(VENV)/bin/roundhouse serve --with-worker --demo --new-login-key

# the command-line demo: accuracy of the demo model before and after a short LoRA fine-tune
demo: install
	$(VENV)/bin/roundhouse demo --models-dir data/models

# preference tuning: the preferred and rejected answers' log-likelihoods before and after a few DPO steps
demo-dpo: install
	$(VENV)/bin/roundhouse demo --dpo --models-dir data/models

# reinforcement fine-tuning: graded answers' mean reward before and after a few GRPO steps
demo-grpo: install
	$(VENV)/bin/roundhouse demo --grpo --models-dir data/models

plan: install
	$(VENV)/bin/roundhouse plan

# the generated reference of docs/reference/ (run config, settings, CLI, graders, API routes,
# modules), written again from the code; tests/docs/test_reference.py fails while one is stale
docs: install
	$(PY) -m server.guide.reference --write

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache *.egg-info

# the MLflow tracking server the tracker tests start (tests/engine/test_tracking.py), in a venv of
# its own: the full mlflow package's pins (pyarrow<26) conflict with the service's, which only
# needs the client (mlflow-skinny)
.venv-mlflow/bin/mlflow: requirements-mlflow-server.txt
	$(PYTHON) -m venv .venv-mlflow
	.venv-mlflow/bin/pip install --quiet -r requirements-mlflow-server.txt
	touch $@

mlflow-server: .venv-mlflow/bin/mlflow
