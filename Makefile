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
# make bench, a user's first result within minutes of a fresh clone: every 16th size from
# 4 B to 64 MiB, then every 32nd from 8 B to 256 KiB for the latency of each collective.
BENCH_ARGS ?= --np 4 -b 4 -e 64M -f 16
LATENCY_ARGS ?= --np 4 -b 8 -e 256K -f 32 -n 20 --mode blocking --collective all
BENCH_DEPS_STAMP := $(VENV)/.bench-deps-installed
RESULTS := bench/results
# Updates the rows of bench/results/INDEX.md for the files named (torch-free, any python).
INDEX := $(PYTHON) pycomm/bench/index.py
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
# bench-verify: the cost of the verify mode (PYCOMM_VERIFY, as the group's pycomm.Options)
# checking every call and every 100th against none, in blocking mode, interleaved per repeat;
# off2, a second group like off, is the noise floor of the ratios.
VERIFY_BENCH_ARGS ?= --mode blocking -r 31 --sizes 4K,1M,64M --backends off=pycomm,off2=pycomm,n1=pycomm:verify=1,n100=pycomm:verify=100
# bench-layered: pycomm's layered path (its direct algorithm over a gloo group, gloo moving
# the bytes) against gloo's own all-reduce, uncompressed, exact and fp8, in blocking mode.
LAYERED_BENCH_ARGS ?= --mode blocking -r 9 -b 4K -e 16M -f 4 --backends gloo,layered=pycomm-over:gloo,exact=pycomm-over:gloo:deterministic=exact,fp8=pycomm-over:gloo:compression=fp8_e4m3
# bench-peers: pycomm's direct API (the subject) against torch.distributed on it,
# DeepSpeed's shared-memory all-reduce, Open MPI, Gloo, and a single-threaded copy of the
# same bytes (the memory's yardstick).
PEERS_BENCH_ARGS ?= -r 9 --sizes 4K,64K,1M,16M,64M --backends pycomm:algorithm=auto,torch=pycomm,deepspeed,mpi,gloo,copy
PYTEST_ARGS ?=

.PHONY: FORCE all build lint format test test-quick test-durations layer-check bench bench-mpi bench-peers bench-algos bench-determinism bench-verify bench-layered bench-gpu gpu-check bench-scale-core conformance openmpi cuda-check core-test clean

all: build

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEPS_STAMP): requirements.txt | $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

# Built in place (incremental, ninja on every core), its objects in $(EXT_BUILD); a .pth file
# puts this checkout on .venv's path so `import pycomm` works from any directory (torchrun
# scripts, spawned ranks). The core's objects there include no torch header: the C++ tests
# link those same objects (CORE_OBJECTS) rather than compile the core again.
EXT_BUILD := build/ext
$(EXT_STAMP): $(DEPS_STAMP) $(SOURCES)
	$(PY) setup.py --quiet build_ext --inplace --build-temp $(EXT_BUILD)
	$(PY) -c "import os, sysconfig; open(os.path.join(sysconfig.get_paths()['purelib'], 'pycomm-checkout.pth'), 'w').write(os.getcwd() + '\n')"
	touch $@

build: $(EXT_STAMP)

# Compiles every CUDA source as a check when nvcc exists (no GPU needed), for each
# compute capability of PYCOMM_CUDA_ARCH, with the flags setup.py uses but the device code's
# optimizer at -O1 (-Xcicc): every template is still instantiated and checked, and ptxas
# still assembles every kernel, inline PTX included; at -O3 the unrolling of the codec
# kernels made each coded_kernels_<codec>.cu take 42 s, at -O1 9 s. A source is checked
# again only when it, a header it includes (nvcc's dependency file) or the flags and nvcc's
# version (CUDA_CHECK_DIR/flags) changed since its last successful check: its stamp,
# CUDA_CHECK_DIR/NAME.ok, is written only then. `make -j` checks them in parallel.
PYCOMM_CUDA_ARCH ?= 90
CUDA_GENCODE := $(foreach a,$(subst ;, ,$(PYCOMM_CUDA_ARCH)),-gencode=arch=compute_$(a),code=sm_$(a))
CUDA_CHECK_FLAGS := -std=c++17 -O3 -fmad=false -Xcicc -O1 -Icsrc $(CUDA_GENCODE)
CUDA_CHECK_DIR := build/cuda-check
CUDA_STAMPS := $(patsubst csrc/cuda/%.cu,$(CUDA_CHECK_DIR)/%.ok,$(CU_SOURCES))
# tests/cuda/test_conversions.cu: the kernels' conversions (cuda/conversions.cuh) against
# numerics.h's on the host, where the CUDA headers convert in software as the GPU's
# instructions do; sampled here, every float32 pattern with `--all` (bench/README.md).
CONVERSIONS_TEST := $(CUDA_CHECK_DIR)/test_conversions
ifneq ($(and $(NVCC),$(CU_SOURCES)),)
cuda-check: $(CUDA_STAMPS) $(CONVERSIONS_TEST).ok
$(CONVERSIONS_TEST): tests/cuda/test_conversions.cu $(CUDA_CHECK_DIR)/flags
	@echo "nvcc $< (host)"
	@$(NVCC) -std=c++17 -O2 -Icsrc -x cu -MD -MF $@.d -MT $@ $< -o $@
$(CONVERSIONS_TEST).ok: $(CONVERSIONS_TEST)
	@$< && touch $@
$(CUDA_CHECK_DIR)/flags: FORCE
	@mkdir -p $(@D); echo '$(CUDA_CHECK_FLAGS) $(shell $(NVCC) --version | tail -n 1)' > $@.new; \
	if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
$(CUDA_CHECK_DIR)/%.ok: csrc/cuda/%.cu $(CUDA_CHECK_DIR)/flags
	@echo "nvcc -c $<"
	@$(NVCC) $(CUDA_CHECK_FLAGS) -MD -MF $(@:.ok=.d) -MT $@ -c $< -o /dev/null && touch $@
-include $(wildcard $(CUDA_CHECK_DIR)/*.d)
else
cuda-check:
	@echo "cuda-check: skipped ($(if $(NVCC),no CUDA sources yet,nvcc not found))"
endif

# The torch-free core's own tests: threads of one process over real shm and TCP. Each
# flavour's core is compiled once into objects that every test of that flavour links: the
# extension's own (build/ext, -O3) for core-test, build/asan and build/tsan for sanitize.
CORE_SOURCES := $(wildcard csrc/core/*.cc csrc/device/*.cc csrc/transport/*.cc csrc/algorithms/*.cc csrc/runtime/*.cc)
CORE_HEADERS := $(wildcard csrc/*/*.h)
CORE_OBJECTS := $(patsubst csrc/%.cc,$(EXT_BUILD)/csrc/%.o,$(CORE_SOURCES))
CORE_CXXFLAGS := -std=c++17 -O2 -fno-trapping-math -Wall -Wextra -pthread -Icsrc
# -g1: the line tables a sanitizer's report needs for its stacks, without the full debug
# info (-g), which made a sanitized unit 1.5-1.8x slower to compile.
SAN_CXXFLAGS := -std=c++17 -O1 -g1 -fno-trapping-math -Wall -Wextra -pthread -Icsrc
cpp_CXXFLAGS := $(CORE_CXXFLAGS)
asan_CXXFLAGS := $(SAN_CXXFLAGS) -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
# -Wno-tsan: gcc warns that TSan ignores std::atomic_thread_fence. The shm transport's
# fences only order its `sleeping` flags against the counters (whether to call futex
# wake), all relaxed atomics that TSan never reports; the payloads are handed over by
# release/acquire on the counters (stated to TSan by annotations there).
tsan_CXXFLAGS := $(SAN_CXXFLAGS) -fsanitize=thread -Wno-tsan

$(CORE_OBJECTS): $(EXT_STAMP) ;

# $(call core_objects,FLAVOUR): FLAVOUR_OBJECTS, the core compiled with FLAVOUR_CXXFLAGS
# into build/FLAVOUR/core.
define core_objects
$(1)_OBJECTS := $$(patsubst csrc/%.cc,build/$(1)/core/%.o,$$(CORE_SOURCES))
.SECONDARY: $$($(1)_OBJECTS)  # kept between runs, not deleted as intermediates
build/$(1)/core/%.o: csrc/%.cc $$(CORE_HEADERS)
	@mkdir -p $$(dir $$@)
	$$(CXX) $$($(1)_CXXFLAGS) -c $$< -o $$@
endef
# $(call cpp_tests,FLAVOUR,OBJECTS): FLAVOUR_TESTS (build/FLAVOUR/test_* from every
# tests/cpp/test_*.cc) and their rules, compiled with FLAVOUR_CXXFLAGS, linked with OBJECTS.
define cpp_tests
$(1)_TESTS := $$(patsubst tests/cpp/%.cc,build/$(1)/%,$$(wildcard tests/cpp/test_*.cc))
build/$(1)/%: tests/cpp/%.cc $(2) $$(CORE_HEADERS) $$(wildcard tests/cpp/*.h)
	@mkdir -p $$(dir $$@)
	$$(CXX) $$($(1)_CXXFLAGS) -Itests/cpp $(2) $$< -o $$@
endef
SAN_FLAVOURS := asan tsan
$(foreach f,$(SAN_FLAVOURS),$(eval $(call core_objects,$(f))))
$(foreach f,$(SAN_FLAVOURS),$(eval $(call cpp_tests,$(f),$$($(f)_OBJECTS))))
$(eval $(call cpp_tests,cpp,$$(CORE_OBJECTS)))
CPP_TESTS := $(cpp_TESTS)

core-test: $(CPP_TESTS)
	@for t in $(CPP_TESTS); do echo "$$t"; timeout 300 $$t || exit 1; done

# sanitize: every C++ test under AddressSanitizer + UndefinedBehaviorSanitizer, then under
# ThreadSanitizer (sanitize-asan, sanitize-tsan: one of them). The first report stops the
# test with a failing status (halt_on_error; UBSan cannot recover, being compiled with
# -fno-sanitize-recover), and so fails the target; so does a leak at exit (LeakSanitizer)
# or a test that outlives SANITIZE_TIMEOUT seconds. Slower code gets 10x the timing
# bounds of the tests (PYCOMM_TEST_SLACK), and the scale test runs 32 ranks, not 128
# (PYCOMM_SCALE_RANKS). tests/cpp/tsan.supp is where a TSan report
# shown to be a false positive would go, with its reason (none so far).
SANITIZE_TIMEOUT ?= 300
asan_ENV := ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:detect_stack_use_after_return=1:strict_init_order=1:check_initialization_order=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
tsan_ENV := TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/cpp/tsan.supp
# gcc 12's sanitizer runtimes place their shadow memory at fixed addresses that assume at
# most 28 bits of mmap randomisation: with more (vm.mmap_rnd_bits=32 is the default of
# recent kernels on some distributions), TSan dies with "unexpected memory mapping" and
# ASan can loop on DEADLYSIGNAL. There the tests run with this process's address space
# randomisation off (setarch -R, no privilege needed, unlike the sysctl), and when even that
# is refused (a seccomp filter on personality(), as in Docker's default), the target fails
# saying so rather than report the runtime's crash as a bug of pycomm.
# $(call run_sanitized,FLAVOUR): runs every FLAVOUR test, with its options and a timeout.
define run_sanitized
run=""; bits=$$(cat /proc/sys/vm/mmap_rnd_bits 2>/dev/null || echo 0); \
if [ "$$bits" -gt 28 ]; then \
  if setarch "$$(uname -m)" -R true 2>/dev/null; then run="setarch $$(uname -m) -R"; \
  else echo "make sanitize: vm.mmap_rnd_bits=$$bits is more than gcc's sanitizer runtimes support and setarch -R is refused here: set vm.mmap_rnd_bits=28" >&2; exit 1; fi; \
fi; \
for t in $($(1)_TESTS); do \
  echo "$$t ($(1))"; start=$$(date +%s); \
  $($(1)_ENV) PYCOMM_TEST_SLACK=10 PYCOMM_SCALE_RANKS=32 timeout -k 10 $(SANITIZE_TIMEOUT) $$run $$t; rc=$$?; \
  echo "$$t ($(1)): exit status $$rc, $$(( $$(date +%s) - start )) s"; \
  if [ $$rc -ne 0 ]; then \
    [ $$rc -eq 124 ] && echo "make sanitize: $$t ran past $(SANITIZE_TIMEOUT) s" >&2; \
    exit 1; \
  fi; \
done
endef
.PHONY: sanitize $(addprefix sanitize-,$(SAN_FLAVOURS))
$(foreach f,$(SAN_FLAVOURS),$(eval sanitize-$(f): $$($(f)_TESTS) ; @$$(call run_sanitized,$(f))))
# Every flavour is built before the first runs (make -j builds them in parallel); the
# tests run one at a time, never two flavours at once, for the timing bounds.
sanitize: $(foreach f,$(SAN_FLAVOURS),$($(f)_TESTS))
	@$(foreach f,$(SAN_FLAVOURS),$(call run_sanitized,$(f));)

# Layers of csrc/, lowest first: a file includes headers of its own layer and of those
# below it, never above (tests/check_layers.py).
LAYERS := core device transport algorithms runtime cuda binding
# Layers of pycomm/, lowest first, likewise for imports (at the top of a file or in a
# function), and no import cycle: the extension and the launcher of local worlds; the
# kernels and which of them serves a device; the layered path; the direct API; the exact
# gradient accumulator (pycomm.exact_data_parallel returns it); the package's API
# (pycomm/__init__.py); what is built on that API (DDP hooks, FSDP2's reduce-scatter);
# the benchmark. Modules of one layer are joined by commas.
PY_LAYERS := _C,_launch kernels layered direct data_parallel __init__ fsdp,hooks bench
layer-check:
	@$(PYTHON) tests/check_layers.py --cpp $(LAYERS) --python $(PY_LAYERS)

# lint: ruff over the Python (pyproject.toml's [tool.ruff]) and clang-format over the C++
# (.clang-format); it changes nothing and fails naming what is off. `make format` applies
# clang-format's layout to the C++.
CXX_FORMATTED = $(shell find csrc tests/cpp tests/cuda -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
lint: $(DEPS_STAMP)
	@$(PY) -m ruff check --quiet pycomm tests bench setup.py && echo "lint: ruff: pycomm, tests, bench"
	@$(VENV)/bin/clang-format --dry-run --Werror $(CXX_FORMATTED) && echo "lint: clang-format: csrc, tests/cpp, tests/cuda"
format: $(DEPS_STAMP)
	$(VENV)/bin/clang-format -i $(CXX_FORMATTED)

# pytest exit code 5 means no test was collected: a broken suite, never a pass.
# PYTEST_WORKERS processes run the tests (pytest-xdist), longest first from the timings in
# tests/durations.json; the tests sharing a module's world stay on one worker
# (tests/conftest.py). While one waits on a timeout or a process start, the other
# computes. 0 runs the suite in one process.
PYTEST_WORKERS ?= 2
pytest = @$(PY) -m pytest -q $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS)) $(1) $(PYTEST_ARGS); \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "make $@: pytest collected no tests" >&2; exit 1; fi; exit $$rc
# The compile steps (nvcc checks, C++ tests) run JOBS at a time, then the C++ tests one
# after another (they have timing bounds).
JOBS ?= $(shell nproc)
test: layer-check lint build
	@$(MAKE) --no-print-directory -j$(JOBS) cuda-check $(CPP_TESTS)
	@$(MAKE) --no-print-directory core-test
	$(call pytest,)

# The edit loop: the Python tests that start no world over 4 ranks, train nothing and took
# at most 5 s (tests/conftest.py, --quick); no nvcc check, no C++ test.
test-quick: layer-check build
	$(call pytest,--quick)

# Every test's time into tests/durations.json, which orders make test and selects make
# test-quick: run on 2 cores after a change to what the tests do.
test-durations: build
	$(call pytest,--record-durations tests/durations.json)

# Throughput (back-to-back calls) over the whole range, then per-call latency of small ones
# for every collective: bench/out/{throughput,latency}/ (run.json, run.jsonl, report.md, plots).
bench: build
	$(PY) -m pycomm.bench $(BENCH_ARGS) --out bench/out/throughput
	$(PY) -m pycomm.bench $(LATENCY_ARGS) --out bench/out/latency

$(BENCH_DEPS_STAMP): requirements-bench.txt requirements-deepspeed.txt | $(DEPS_STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-bench.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-deepspeed.txt
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
# $(RESULTS)/cpu/cpu-allreduce-mpi-np<N>-<mode>.{txt,json}.
bench-mpi: build openmpi $(BENCH_DEPS_STAMP)
	@mkdir -p $(RESULTS)/cpu; for np in 2 4; do for mode in b2b blocking; do \
	  out=$(RESULTS)/cpu/cpu-allreduce-mpi-np$$np-$$mode; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np --mode $$mode $(MPI_BENCH_ARGS) --json $$out.json) || exit 1; \
	  $(INDEX) $$out.txt > /dev/null || exit 1; \
	done; done

# pycomm against the CPU peers users would pick instead, in the same processes: its direct
# API, the same through torch.distributed, DeepSpeed's shared-memory all-reduce, Open MPI
# and Gloo; 2 and 4 ranks, blocking and back to back: $(RESULTS)/cpu/cpu-peers-np<N>-<mode>.{txt,json}.
bench-peers: build openmpi $(BENCH_DEPS_STAMP)
	@mkdir -p $(RESULTS)/cpu; for np in 2 4; do for mode in blocking b2b; do \
	  out=$(RESULTS)/cpu/cpu-peers-np$$np-$$mode; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np --mode $$mode $(PEERS_BENCH_ARGS) --json $$out.json \
	    --markdown $$out.md) || exit 1; \
	done; cat $(RESULTS)/cpu/cpu-peers-np$$np-blocking.md $(RESULTS)/cpu/cpu-peers-np$$np-b2b.md > $(RESULTS)/cpu/cpu-peers-np$$np.md; \
	rm $(RESULTS)/cpu/cpu-peers-np$$np-blocking.md $(RESULTS)/cpu/cpu-peers-np$$np-b2b.md; \
	$(INDEX) $(RESULTS)/cpu/cpu-peers-np$$np.md $(RESULTS)/cpu/cpu-peers-np$$np-*.txt > /dev/null || exit 1; done

# Every pycomm all-reduce algorithm against the automatic choice, 2 and 4 ranks:
# $(RESULTS)/cpu/cpu-allreduce-algos-np<N>.{txt,json,png}; the .txt ends with the best per size.
bench-algos: build $(BENCH_DEPS_STAMP)
	@mkdir -p $(RESULTS)/cpu; for np in 2 4; do \
	  out=$(RESULTS)/cpu/cpu-allreduce-algos-np$$np; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np $(ALGOS_BENCH_ARGS) --json $$out.json) || exit 1; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench.plot $$out.json -o $$out.png) || exit 1; \
	  $(INDEX) $$out.txt $$out.png > /dev/null || exit 1; \
	done

# The torch-free core over TCP on loopback at 128 ranks (threads of one process, as in
# make test) and 256 (4 processes of 64): set-up, an all-to-all burst in which every
# unconnected pair connects at once, twoshot and tree all-reduces, descriptors and threads
# per rank: $(RESULTS)/scale/cpu-scale-core.txt.
bench-scale-core: build/cpp/test_scale
	@mkdir -p $(RESULTS)/scale; out=$(RESULTS)/scale/cpu-scale-core.txt; rm -f $$out; \
	for world in 128:1 256:4; do \
	  $(call saved,$$out,PYCOMM_SCALE_RANKS=$${world%%:*} PYCOMM_SCALE_PROCESSES=$${world##*:} timeout 300 build/cpp/test_scale) || exit 1; \
	done; $(INDEX) $$out > /dev/null

# gpu-check: everything of the CUDA path in one command on a GPU machine (bench/gpu_check.py),
# with that machine's python and torch (it builds pycomm there first, no .venv);
# GPU_CHECK_DRY=1 rehearses it on any machine.
GPU_PY ?= python3
GPU_CHECK_OUT ?= bench/out/gpu-check
gpu-check:
	$(GPU_PY) bench/gpu_check.py --out $(GPU_CHECK_OUT)

# bench-gpu: the kernels and one-GPU all-reduce (bench/gpu.py); a CUDA build on a GPU machine.
bench-gpu: build
	$(PY) bench/gpu.py --out bench/out

# PyTorch's own distributed suite (from the installed torch wheel) for Gloo and for pycomm
# at 2, 3 and 4 ranks: $(RESULTS)/conformance/conformance.md lists what passes on Gloo and not on
# pycomm, and the tests whose Gloo-only gate was lifted for pycomm; the command fails when
# anything passes on Gloo only, beyond the justified list. The two backends run at once:
# about 50 minutes on 2 cores at 2 and 3 ranks (16 at 2 ranks, 33 at 3), and more at 4;
# CONFORMANCE_ARGS="--jobs 2 -k PATTERN" runs a subset.
CONFORMANCE_ARGS ?= --jobs 2
conformance: build
	$(PY) bench/conformance.py --world-sizes 2,3,4 --out $(RESULTS)/conformance/conformance.md $(CONFORMANCE_ARGS); \
	rc=$$?; $(INDEX) $(RESULTS)/conformance/conformance.md > /dev/null; exit $$rc

# pycomm's determinism modes against its default, 2 and 4 ranks:
# $(RESULTS)/cpu/cpu-allreduce-determinism-np<N>.{txt,json}.
bench-determinism: build
	@mkdir -p $(RESULTS)/cpu; for np in 2 4; do \
	  out=$(RESULTS)/cpu/cpu-allreduce-determinism-np$$np; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np $(DETERMINISM_BENCH_ARGS) --json $$out.json) || exit 1; \
	  $(INDEX) $$out.txt > /dev/null || exit 1; \
	done

# pycomm's verify mode against none, 2 and 4 ranks: $(RESULTS)/cpu/cpu-allreduce-verify-np<N>.{txt,json}.
bench-verify: build
	@mkdir -p $(RESULTS)/cpu; for np in 2 4; do \
	  out=$(RESULTS)/cpu/cpu-allreduce-verify-np$$np; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np $(VERIFY_BENCH_ARGS) --json $$out.json) || exit 1; \
	  $(INDEX) $$out.txt > /dev/null || exit 1; \
	done

# pycomm's layered path over gloo against gloo's all-reduce, 2 and 4 ranks:
# $(RESULTS)/cpu/cpu-allreduce-layered-np<N>.{txt,json}.
bench-layered: build
	@mkdir -p $(RESULTS)/cpu; for np in 2 4; do \
	  out=$(RESULTS)/cpu/cpu-allreduce-layered-np$$np; rm -f $$out.txt; \
	  $(call saved,$$out.txt,$(PY) -m pycomm.bench --np $$np $(LAYERED_BENCH_ARGS) --json $$out.json) || exit 1; \
	  $(INDEX) $$out.txt > /dev/null || exit 1; \
	done

clean:
	rm -rf build pycomm/_C*.so $(EXT_STAMP) pycomm.egg-info
