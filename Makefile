# Two entry points for a fresh clone: `make bench` and `make test`. Both create .venv,
# install the pinned dependencies and build the extension against that torch when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-installed
EXT_STAMP := pycomm/.built
SOURCES := $(shell find csrc -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py
NVCC := $(shell command -v nvcc 2>/dev/null)
CU_SOURCES := $(shell find csrc -name '*.cu' 2>/dev/null)
BENCH_ARGS ?= --np 4 -b 8 -e 64M
LATENCY_ARGS ?= --np 4 -b 8 -e 1M --mode blocking
PYTEST_ARGS ?=

.PHONY: all build test bench cuda-check core-test clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

# Built in place (incremental, ninja); a .pth file puts this checkout on .venv's path so
# `import pycomm` works from any directory (torchrun scripts, spawned ranks).
$(EXT_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PY) setup.py --quiet build_ext --inplace
	$(PY) -c "import os, sysconfig; open(os.path.join(sysconfig.get_paths()['purelib'], 'pycomm-checkout.pth'), 'w').write(os.getcwd() + '\n')"
	touch $@

build: $(EXT_STAMP)

# Compiles every CUDA source as a check when nvcc exists (no GPU needed).
cuda-check:
ifneq ($(and $(NVCC),$(CU_SOURCES)),)
	@for f in $(CU_SOURCES); do echo "nvcc -c $$f"; $(NVCC) -std=c++17 -Icsrc -arch=sm_90 -c $$f -o /dev/null || exit 1; done
else
	@echo "cuda-check: skipped ($(if $(NVCC),no CUDA sources yet,nvcc not found))"
endif

# The torch-free core's own tests: threads of one process over real shm and TCP.
CORE_SOURCES := $(wildcard csrc/core/*.cc csrc/transport/*.cc csrc/algorithms/*.cc csrc/device/*.cc)
CPP_TESTS := $(patsubst tests/cpp/%.cc,build/cpp/%,$(wildcard tests/cpp/test_*.cc))
build/cpp/%: tests/cpp/%.cc $(CORE_SOURCES) $(wildcard csrc/*/*.h tests/cpp/*.h)
	@mkdir -p build/cpp
	$(CXX) -std=c++17 -O2 -Wall -Wextra -pthread -Icsrc -Itests/cpp $(CORE_SOURCES) $< -o $@

core-test: $(CPP_TESTS)
	@for t in $(CPP_TESTS); do echo "$$t"; timeout 300 $$t || exit 1; done

# pytest exit code 5 means no test was collected: a broken suite, never a pass.
test: build cuda-check core-test
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Throughput (back-to-back calls) over the whole range, then per-call latency of small ones.
bench: build
	$(PY) -m pycomm.bench $(BENCH_ARGS)
	$(PY) -m pycomm.bench $(LATENCY_ARGS)

clean:
	rm -rf build pycomm/_C*.so $(EXT_STAMP) pycomm.egg-info
