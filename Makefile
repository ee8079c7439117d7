# The two commands of the README: `make demo` and `make test`. Both create .venv and install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.py | cksum | cut -d' ' -f1)
# pin the CPU torch in the same pip call: an unpinned torch would pull a multi-GB CUDA build
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: install llama-cpp test demo test-gpu bench-cpu clean

install: $(STAMP)

$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)" -e '.[test]'
	rm -f $(VENV)/.installed-*; touch $(STAMP)

# llama.cpp's own runtime and tools (llama-quantize, llama-perplexity, ...), built once from the
# llama-cpp-python sdist on PyPI and cached per CPU under ~/.cache/qatfactory/llama.cpp (3-6 min the
# first time); the gate runs it on every GGUF export (without it a GGUF verdict is INCOMPLETE)
llama-cpp: install
	$(BIN)/python scripts/llama_cpp_runtime.py ensure

test: install llama-cpp
	$(BIN)/ruff check qatfactory exporters
	$(BIN)/python -m pytest -q -m "not cuda and not multi_gpu" tests $(PYTEST_ARGS)

demo: install llama-cpp
	$(BIN)/qatfactory demo

bench-cpu: install
	$(BIN)/python benchmarks/formats_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
