# Two commands on a fresh machine: `make demo` and `make test`.
# Both create .venv when it is missing and install plait with the pinned dev constraints
# (torch==2.13.0, the CPU wheel; a bare `torch` would pull a multi-GB CUDA build).

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST  := $(BIN)/python -m pytest
# PyTorch/XLA's own environment: torch-xla 2.9 needs torch 2.9.0 (whose x86_64 wheel is a CUDA
# build: its NVIDIA runtime wheels come along, about 3.6 GB). Created once, reused after.
XLA_VENV  := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed
# TorchTPU beside the pinned CPU torch: without a TPU only detection and refusals can run.
TPU_VENV  := .venv-tpu
TPU_STAMP := $(TPU_VENV)/.installed

.PHONY: demo test test-xla test-tpu test-slow test-fast lint bench bench-env docs clean help

help:
	@echo "make demo       train the tiny transformer on 2 CPU processes (plan, progress, loss, ledger)"
	@echo "make test       the whole suite (multi-process cases included, slow ones in a cheap form)"
	@echo "make test-slow  also the long cases marked slow"
	@echo "make test-xla   the PyTorch/XLA cases on the XLA CPU device (creates .venv-xla once)"
	@echo "make test-tpu   TorchTPU without a TPU: detection, doctor, refusals (creates .venv-tpu)"
	@echo "make lint       ruff (pyflakes, pycodestyle, isort, bugbear, naming, pyupgrade) and mypy"
	@echo "make bench      the side-by-side benchmarks in bench/ (vs_anchors.py needs make bench-env)"
	@echo "make docs       the documentation site (MkDocs + Material) into site/, warnings and broken links as errors"
	@echo "make bench-env  .venv-bench: plait beside HF Accelerate and Lightning Fabric, for bench/vs_anchors.py"

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints-dev.txt -e ".[dev,hf,plot,tensorboard]"
	touch $(STAMP)

$(XLA_STAMP): pyproject.toml constraints-xla.txt
	test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install -q --upgrade pip
	$(XLA_VENV)/bin/python -m pip install -q -c constraints-xla.txt -e ".[dev,xla]"
	touch $(XLA_STAMP)

$(TPU_STAMP): pyproject.toml constraints-dev.txt
	test -x $(TPU_VENV)/bin/python || $(PY) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(TPU_VENV)/bin/python -m pip install -q -c constraints-dev.txt -e ".[dev,tpu]"
	touch $(TPU_STAMP)

demo: $(STAMP)
	$(BIN)/plait demo

test: $(STAMP)
	$(PYTEST) -q -m "not slow"

# One XLA CPU device for training vs eager CPU and the diagnostics, four (CPU_NUM_DEVICES, set
# per case) for the SPMD layouts.
test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -q -m "not slow" tests/xla

test-tpu: $(TPU_STAMP)
	$(TPU_VENV)/bin/python -m pytest -q -p no:warnings tests/tpu

test-slow: $(STAMP)
	$(PYTEST) -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# vs_anchors.py runs in .venv-bench when `make bench-env` made it, and says how to make it
# otherwise (`make bench` does not install the anchors as a side effect).
bench: $(STAMP)
	for f in bench/[!_]*.py; do echo "== $$f"; PYTHONPATH=. $(BIN)/python $$f || exit 1; done

# The docs toolchain is the `docs` extra, installed on demand (not part of `make test`'s install).
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -q -c constraints-dev.txt -e ".[docs]"
	touch $(DOCS_STAMP)

# --strict: any warning fails, and mkdocs.yml's validation turns a link to a missing page or a
# missing anchor into a warning; the example scripts are embedded, so a moved one fails too.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The anchors plait is compared with (bench/vs_anchors.py) live in their own environment so
# that they never become plait's dependencies; torch is pinned the same as in .venv.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed

bench-env: $(BENCH_STAMP)

$(BENCH_STAMP): pyproject.toml constraints-dev.txt requirements-bench.txt
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -c constraints-dev.txt -e . -r requirements-bench.txt
	touch $(BENCH_STAMP)

clean:
	rm -rf $(VENV) $(XLA_VENV) $(TPU_VENV) $(BENCH_VENV) site build *.egg-info .pytest_cache
