# `make demo` and `make test` set everything up on a fresh machine (see scripts/bootstrap.sh).
VENV     ?= .venv
PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
JOBS     ?= 2
# The oldest triton the package supports (the GPU image and the engines pin it): its interpreter runs a fast
# subset of every backend in a second environment, so the minimum is tested as well as the newest release.
TRITON_MIN  ?= 3.6.0
VENV_MIN    ?= .venv-triton-min
STAMP_MIN   := $(VENV_MIN)/.installed
TESTS_MIN   ?= tests/test_plan.py tests/test_step_build.py tests/test_ops.py tests/test_ops_pair.py tests/test_cache.py \
               tests/test_streaming.py tests/test_projection.py
# Of build_plan's multi-block steps, which cost most under the interpreter, the subset keeps those that each
# reach a path: the 1,024-row config through the out_slot tests, the 2,048-row config and far run ends (counts1).
TESTS_MIN_K ?= not random_programs and not (matches_model and blocks and 128) and not (longer_than_one_block and not counts1)

# The real serving engines: each pinned release installed with --no-deps (with the pure-Python modules its
# imports need, tests/engines/<engine>.txt) in an environment of its own, on the CPU build of torch and the
# triton the engines' releases bring (3.8); the adapter's test module runs there against the engine's own
# classes and Triton kernels (under the interpreter). Without the engine the same modules skip.
TRITON_ENGINES ?= 3.8.0
VENV_SGLANG    ?= .venv-sglang
VENV_VLLM      ?= .venv-vllm
STAMP_SGLANG   := $(VENV_SGLANG)/.installed
STAMP_VLLM     := $(VENV_VLLM)/.installed
TESTS_SGLANG   ?= tests/test_engine_sglang.py tests/test_engine_sglang_projection.py tests/test_engine_sglang_settings.py \
                  tests/test_engine_sglang_online.py tests/test_engine_sglang_v41.py tests/test_engine_sglang_uniform_fp8.py \
                  tests/test_integration_sglang.py
TESTS_VLLM     ?= tests/test_engine_vllm.py tests/test_engine_vllm_online.py tests/test_engine_vllm_transfer.py \
                  tests/test_engine_vllm_gpu.py tests/test_integration_vllm.py tests/test_integration_vllm_patching.py \
                  tests/test_integration_vllm_layer.py

.PHONY: demo test test-newest test-triton-min test-engines-min test-engines test-sglang test-sglang-min test-vllm lint format compile-check \
	compile-check-min compile-check-engines compile-checks gpu-check clean

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) scripts/bootstrap.sh
	touch $(STAMP)

$(STAMP_MIN): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV_MIN) TRITON_VERSION=$(TRITON_MIN) scripts/bootstrap.sh
	touch $(STAMP_MIN)

$(STAMP_SGLANG): pyproject.toml scripts/bootstrap.sh tests/engines/sglang.txt
	VENV=$(VENV_SGLANG) TRITON_VERSION=$(TRITON_ENGINES) ENGINE_REQUIREMENTS=tests/engines/sglang.txt scripts/bootstrap.sh
	touch $(STAMP_SGLANG)

$(STAMP_VLLM): pyproject.toml scripts/bootstrap.sh tests/engines/vllm.txt
	VENV=$(VENV_VLLM) TRITON_VERSION=$(TRITON_ENGINES) ENGINE_REQUIREMENTS=tests/engines/vllm.txt scripts/bootstrap.sh
	touch $(STAMP_VLLM)

demo: $(STAMP)
	$(PY) -m dsv4_compressor demo

lint: $(STAMP)
	$(PY) -m ruff check src tests scripts benchmarks
	$(PY) -m ruff format --check src tests scripts benchmarks

# The whole suite on the newest triton, then the subset on the minimum one, then the real vLLM's modules
# (test-vllm: 2 min 18 s on 2 shared cores; its environment's first build downloads the 336 MB vllm wheel,
# PIP_FIND_LINKS=<dir> reuses a downloaded one). On a machine with a CUDA GPU the
# suite runs the GPU modules too (kernels on the device); without one, kernels run under the interpreter.
# test-sglang (the real SGLang 0.5.23, ~1.5 min on 2 cores once its environment is built, ~2 min once) runs here;
# the interpreter subset also runs on the engines' triton (3.8, in .venv-sglang: ~3 min), and the compile checks
# on the GPU image's triton (3.6, sm_90a) and the engines' (3.8, sm_90a / sm_100a / sm_103a), side by side.
test: lint test-newest test-triton-min test-engines-min compile-checks test-sglang test-vllm

test-newest: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -rs -n $(JOBS) --durations=15
	@if $(PY) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then \
	  echo "== a CUDA device is here: the GPU modules, kernels compiled for it"; \
	  $(PY) -m pytest -q -rs -m gpu tests; \
	else \
	  echo "== NOTE: no CUDA device here, so the GPU modules (marker 'gpu') were skipped; make test on a GPU"; \
	  echo "   machine runs them (or scripts/gpu_check.sh)"; \
	fi

test-triton-min: $(STAMP_MIN)
	TRITON_INTERPRET=1 $(VENV_MIN)/bin/python -m pytest -q -rs -n $(JOBS) $(TESTS_MIN) -k "$(TESTS_MIN_K)"

test-engines: test-sglang test-vllm

test-sglang: $(STAMP_SGLANG)
	TRITON_INTERPRET=1 $(VENV_SGLANG)/bin/python -m pytest -q -rs -n $(JOBS) $(TESTS_SGLANG)

# SGLang's and vLLM's toolchain (triton 3.8): the interpreter subset, and with the sm_90a / sm_100a / sm_103a compile check
test-engines-min: $(STAMP_SGLANG)
	TRITON_INTERPRET=1 $(VENV_SGLANG)/bin/python -m pytest -q -rs -n $(JOBS) $(TESTS_MIN) -k "$(TESTS_MIN_K)"

test-sglang-min: test-engines-min compile-check-engines

test-vllm: $(STAMP_VLLM)
	TRITON_INTERPRET=1 $(VENV_VLLM)/bin/python -m pytest -q -rs -n $(JOBS) $(TESTS_VLLM)

# Compile every kernel variant without a GPU: catches what the interpreter accepts and the compiler does not.
# `make test` runs it for sm_90a on the minimum triton, the GPU image's, and for sm_90a, sm_100a and sm_103a
# (Blackwell) on the engines' triton, with programmatic dependent launch on as the GPUs run them (it also checks
# where each kernel releases the next).
compile-check: compile-check-min $(STAMP)
	$(PY) scripts/compile_check.py --quiet

compile-check-min: $(STAMP_MIN)
	$(VENV_MIN)/bin/python scripts/compile_check.py --quiet --pdl

compile-check-engines: compile-check-engines-90 compile-check-engines-100 compile-check-engines-103

compile-check-engines-%: $(STAMP_SGLANG)
	$(VENV_SGLANG)/bin/python scripts/compile_check.py --quiet --pdl --arch $*

# the four compile checks (one process per triton and arch, each ~2-3 min on one core) shared out over the
# machine's cores: each is one process, so one check per core
compile-checks: $(STAMP_MIN) $(STAMP_SGLANG)
	$(MAKE) --no-print-directory -j$(JOBS) compile-check-min compile-check-engines-90 compile-check-engines-100 \
	  compile-check-engines-103

format: $(STAMP)
	$(PY) -m ruff format src tests scripts benchmarks
	$(PY) -m ruff check --fix src tests scripts benchmarks

clean:
	rm -rf $(VENV) $(VENV_MIN) $(VENV_SGLANG) $(VENV_VLLM) build src/*.egg-info .pytest_cache .ruff_cache .hypothesis
