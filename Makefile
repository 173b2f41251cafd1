# `make demo` and `make test` set everything up on a fresh machine: a .venv in the repository root,
# the CPU build of torch where no NVIDIA GPU is present (a bare `torch` requirement would pull a
# CUDA build of several GB), then vgpu itself with its test and benchmark extras.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_CPU_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test venv proto lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: pip takes the CUDA build of torch"; \
	else \
		echo "no NVIDIA GPU: installing the CPU build torch==$(TORCH_CPU_VERSION)+cpu"; \
		$(PIP) install -q "torch==$(TORCH_CPU_VERSION)+cpu" 2>/dev/null || \
		$(PIP) install -q --index-url https://download.pytorch.org/whl/cpu "torch==$(TORCH_CPU_VERSION)+cpu"; \
	fi
	$(PIP) install -q -e ".[dev,bench]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	mkdir -p runs
	$(VENV)/bin/vgpu demo --plot runs/demo.png

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

proto: $(STAMP)
	$(PY) tools/gen_proto.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info
