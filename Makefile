# The two commands of the README: `make demo` and `make test`. Both create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# constraints.txt: the versions make test last passed with (see its header); a change to it reinstalls
CONSTRAINTS := $(wildcard constraints.txt)
STAMP := $(VENV)/.installed-$(shell cat setup.py $(CONSTRAINTS) | cksum | cut -d' ' -f1)
# pin the CPU torch in the same pip call: an unpinned torch would pull a multi-GB CUDA build
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest workers (pytest-xdist): one per core of the CI machine; each test file stays on one worker, so its
# module fixtures are built once; one OpenMP thread each, so two workers do not oversubscribe two cores.
# PYTEST_WORKERS=0 runs in this process (pdb, -s)
PYTEST_WORKERS ?= 2

.PHONY: install lock llama-cpp test demo test-gpu bench-cpu clean

install: $(STAMP)

# --no-compile: pip would byte-compile all ~19,000 files of the dependencies (about a minute of one core)
# while a train + export + verify imports under 4,000; Python compiles and caches those at first import
$(STAMP): setup.py $(CONSTRAINTS)
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-compile $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) "$(TORCH)" -e '.[test]'
	rm -f $(VENV)/.installed-*; touch $(STAMP)

# after make test passed on newer versions: write them as the new constraints (torch stays the Makefile's)
lock: install
	$(BIN)/python scripts/lock.py $(BIN)/pip constraints.txt

# llama.cpp's own runtime and tools (llama-quantize, llama-perplexity, ...), built once from the
# llama-cpp-python sdist on PyPI and cached per CPU under ~/.cache/qatfactory/llama.cpp (3-6 min the
# first time); the gate runs it on every GGUF export (without it a GGUF verdict is INCOMPLETE)
llama-cpp: install
	$(BIN)/python scripts/llama_cpp_runtime.py ensure

test: install llama-cpp
	$(BIN)/ruff check qatfactory exporters readers
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -m "not cuda and not multi_gpu" -n $(PYTEST_WORKERS) --dist loadfile --durations=15 tests $(PYTEST_ARGS)

demo: install llama-cpp
	$(BIN)/qatfactory demo

bench-cpu: install
	$(BIN)/python benchmarks/formats_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
