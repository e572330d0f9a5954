# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install plait with the pinned dev constraints
# (torch==2.13.0, the CPU wheel; a bare `torch` would pull a multi-GB CUDA build).

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST  := $(BIN)/python -m pytest

.PHONY: demo test test-slow test-fast lint bench clean help

help:
	@echo "make demo       train the tiny transformer on 2 CPU processes (plan, progress, loss, ledger)"
	@echo "make test       the whole suite (multi-process cases included, slow ones in a cheap form)"
	@echo "make test-slow  also the long cases marked slow"
	@echo "make lint       ruff (pyflakes, pycodestyle, isort, bugbear, naming, pyupgrade) and mypy"
	@echo "make bench      the side-by-side benchmarks in bench/"

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-dev.txt -e ".[dev,hf,plot]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/plait demo

test: $(STAMP)
	$(PYTEST) -q -m "not slow"

test-slow: $(STAMP)
	$(PYTEST) -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	for f in bench/[!_]*.py; do echo "== $$f"; PYTHONPATH=. $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
