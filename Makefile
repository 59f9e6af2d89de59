# Convenience targets around CMake and pytest. The library itself builds with plain CMake.
BUILD ?= build
PYTHON ?= python3
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all lib deps test gpu-test gpu-check-quick clean

all: lib

lib:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

# Installs cmocka and pytest when they are missing.
deps:
	PYTHON=$(PYTHON) bash ci/test-deps.sh

# With NEWEST_VLLM_PYTHON (an interpreter with the newest vLLM; .ci/run makes one), make test also
# runs the plugin's tests and the linear seam's against that vLLM, expecting version
# $(OPGRAFT_EXPECT_VLLM_NEWEST).
NEWEST_VLLM_PYTHON ?=

# The ops' compile tests keep their cubins and resource reports here across runs (keyed by the
# kernel sources, options, arch and NVRTC version: a changed kernel is compiled again).
OPGRAFT_TEST_KERNEL_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/opgraft-test-kernels
export OPGRAFT_TEST_KERNEL_CACHE

# CI's test command: C unit tests, the kernel compile checks (ctest; their progress shown: a cold
# kernel cache takes a minute or two on two cores), then the Python tests.
# The C tests are built even where an earlier configure of $(BUILD) turned them off, and ctest
# fails where it finds none.
test: CMAKE_ARGS += -DOPGRAFT_BUILD_TESTS=ON
test: deps lib
	@echo "== [1/4] C unit tests (ctest, $(JOBS) jobs)"
	ctest --test-dir $(BUILD) --output-on-failure --no-tests=error -j $(JOBS) -E '_compile$$'
	@echo "== [2/4] kernel compile checks: every variant for sm_80 and sm_90 (kernel cache $(OPGRAFT_TEST_KERNEL_CACHE))"
	ctest --test-dir $(BUILD) --output-on-failure --no-tests=error -R '_compile$$' -V
	@echo "== [3/4] Python tests"
	PYTHONPATH=python $(PYTHON) -m pytest -q -rs tests/python
	@if [ -n "$(NEWEST_VLLM_PYTHON)" ]; then \
	  echo "== [4/4] plugin tests against the newest vLLM ($(NEWEST_VLLM_PYTHON))"; \
	  OPGRAFT_EXPECT_VLLM=$(OPGRAFT_EXPECT_VLLM_NEWEST) PYTHONPATH=python \
	    $(NEWEST_VLLM_PYTHON) -m pytest -q -rs tests/python/seams tests/python/linear; \
	else \
	  echo "== [4/4] plugin tests against the newest vLLM: skipped (NEWEST_VLLM_PYTHON is not set; .ci/run sets it)"; \
	fi

# On a machine with an NVIDIA GPU (sm_80+): correctness over odd cases, then the benchmark.
gpu-test: lib
	PYTHONPATH=python $(PYTHON) -m tools.gpucheck --out $${OUT:-bench/out}

gpu-check-quick: lib
	PYTHONPATH=python $(PYTHON) -m tools.gpucheck --quick --out $${OUT:-bench/out}

clean:
	rm -rf $(BUILD)
