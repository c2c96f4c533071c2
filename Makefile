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
LATENCY_ARGS ?= --np 4 -b 8 -e 1M -f 4 -n 20 --mode blocking --collective all
BENCH_DEPS_STAMP := $(VENV)/.bench-deps-installed
RESULTS := bench/results
# bench-mpi: pycomm's direct API (the subject), the same backend through torch.distributed
# (their difference is the dispatch overhead), Open MPI and Gloo, in the same processes.
MPI_BENCH_ARGS ?= --sizes 4K,64K,1M,16M,64M --backends pycomm:algorithm=auto,torch=pycomm,mpi,gloo
# bench-algos: one backend per pycomm all-reduce algorithm, labelled by its name, in
# blocking mode (each call's latency: the least noisy view on a shared machine). One host
# is one node, where hierarchical falls back to auto: bench/multihost.py measures it.
ALGOS ?= auto ring tree oneshot twoshot
comma := ,
space := $(subst ,, )
ALGOS_BENCH_ARGS ?= --mode blocking -r 9 -b 8 -e 64M --backends $(subst $(space),$(comma),$(foreach a,$(ALGOS),$(a)=pycomm:algorithm=$(a)))
# bench-determinism: the cost of each determinism mode against the default, in blocking
# mode (each call's latency), the three modes interleaved per repeat.
DETERMINISM_BENCH_ARGS ?= --mode blocking -r 9 --sizes 4K,1M,64M --backends default=pycomm,det1=pycomm:deterministic=1,exact=pycomm:deterministic=exact
PYTEST_ARGS ?=

.PHONY: all build test bench bench-mpi bench-algos bench-determinism bench-gpu openmpi cuda-check core-test clean

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

# Compiles every CUDA source as a check when nvcc exists (no GPU needed), for each
# compute capability of PYCOMM_CUDA_ARCH, with the flags setup.py uses.
PYCOMM_CUDA_ARCH ?= 90
CUDA_GENCODE := $(foreach a,$(subst ;, ,$(PYCOMM_CUDA_ARCH)),-gencode=arch=compute_$(a),code=sm_$(a))
cuda-check:
ifneq ($(and $(NVCC),$(CU_SOURCES)),)
	@for f in $(CU_SOURCES); do echo "nvcc -c $$f"; $(NVCC) -std=c++17 -O3 -fmad=false -Icsrc $(CUDA_GENCODE) -c $$f -o /dev/null || exit 1; done
else
	@echo "cuda-check: skipped ($(if $(NVCC),no CUDA sources yet,nvcc not found))"
endif

# The torch-free core's own tests: threads of one process over real shm and TCP. The core
# is compiled once into objects that every test links.
CORE_SOURCES := $(wildcard csrc/core/*.cc csrc/transport/*.cc csrc/algorithms/*.cc csrc/device/*.cc)
CORE_OBJECTS := $(patsubst csrc/%.cc,build/cpp/core/%.o,$(CORE_SOURCES))
CORE_CXXFLAGS := -std=c++17 -O2 -Wall -Wextra -pthread -Icsrc
CPP_TESTS := $(patsubst tests/cpp/%.cc,build/cpp/%,$(wildcard tests/cpp/test_*.cc))
.SECONDARY: $(CORE_OBJECTS)  # kept between runs, not deleted as intermediates
build/cpp/core/%.o: csrc/%.cc $(wildcard csrc/*/*.h)
	@mkdir -p $(dir $@)
	$(CXX) $(CORE_CXXFLAGS) -c $< -o $@
build/cpp/%: tests/cpp/%.cc $(CORE_OBJECTS) $(wildcard csrc/*/*.h tests/cpp/*.h)
	$(CXX) $(CORE_CXXFLAGS) -Itests/cpp $(CORE_OBJECTS) $< -o $@

core-test: $(CPP_TESTS)
	@for t in $(CPP_TESTS); do echo "$$t"; timeout 300 $$t || exit 1; done

# pytest exit code 5 means no test was collected: a broken suite, never a pass.
test: build cuda-check core-test
	@$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Throughput (back-to-back calls) over the whole range, then per-call latency of small ones
# for every collective: bench/out/{throughput,latency}/ (run.json, run.jsonl, report.md, plots).
bench: build
	$(PY) -m pycomm.bench $(BENCH_ARGS) --out bench/out/throughput
	$(PY) -m pycomm.bench $(LATENCY_ARGS) --out bench/out/latency

$(BENCH_DEPS_STAMP): requirements-bench.txt | $(DEPS_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	touch $@

# Open MPI's mpirun: installed from Debian when missing and we are root with apt-get.
openmpi:
	@command -v mpirun >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev || \
	    { apt-get update && apt-get install -y --no-install-recommends openmpi-bin libopenmpi-dev; }; \
	  else \
	    echo "mpirun not found: install Open MPI (Debian: apt-get install openmpi-bin libopenmpi-dev)" >&2; \
	    exit 1; \
	  fi; }

# $(call saved,FILE,COMMAND): COMMAND's stdout is shown and appended to FILE; fails when it does.
saved = $(2) > $(1).part; rc=$$?; cat $(1).part >> $(1); cat $(1).part; rm -f $(1).part; [ $$rc -eq 0 ]

# pycomm against Open MPI (mpi4py) and Gloo, 2 and 4 ranks, throughput and latency:
# $(RESULTS)/cpu-allreduce-mpi-np<N>-<mode>.{txt,json}.
bench-mpi: build openmpi $(BENCH_DEPS_STAMP)
	@mkdir -p $(RESULTS); for np in 2 4; do for mode in b2b blocking; do \
	  out=$(RESULTS)/cpu-allreduce-mpi-np$$np-$$mode; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np --mode $$mode $(MPI_BENCH_ARGS) --json $$out.json) || exit 1; \
	done; done

# Every pycomm all-reduce algorithm against the automatic choice, 2 and 4 ranks:
# $(RESULTS)/cpu-allreduce-algos-np<N>.{txt,json,png}; the .txt ends with the best per size.
bench-algos: build $(BENCH_DEPS_STAMP)
	@mkdir -p $(RESULTS); for np in 2 4; do \
	  out=$(RESULTS)/cpu-allreduce-algos-np$$np; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np $(ALGOS_BENCH_ARGS) --json $$out.json) || exit 1; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench.plot $$out.json -o $$out.png) || exit 1; \
	done

# bench-gpu: the kernels and one-GPU all-reduce (bench/gpu.py); a CUDA build on a GPU machine.
bench-gpu: build
	$(PY) bench/gpu.py --out bench/out

# pycomm's determinism modes against its default, 2 and 4 ranks:
# $(RESULTS)/cpu-allreduce-determinism-np<N>.{txt,json}.
bench-determinism: build
	@mkdir -p $(RESULTS); for np in 2 4; do \
	  out=$(RESULTS)/cpu-allreduce-determinism-np$$np; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np $(DETERMINISM_BENCH_ARGS) --json $$out.json) || exit 1; \
	done

clean:
	rm -rf build pycomm/_C*.so $(EXT_STAMP) pycomm.egg-info
