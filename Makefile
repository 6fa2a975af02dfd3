# The commands of the README.  Every target creates or reuses .venv/ and rebuilds the
# extension first where its sources changed, so they work on a fresh clone with nothing
# installed by hand.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
HF4    := $(VENV)/hf4
# transformers 5.x releases beside .venv's 5.17.0, each an overlay like HF4
HF5_18     := $(VENV)/hf5_18
HF5_LATEST := $(VENV)/hf5_latest
# The kernels package (hub kernels) that the newest 5.x accepts, an overlay put on the
# path after HF5_LATEST (pytest-hub-kernels)
HUB_KERNELS := $(VENV)/hub_kernels
STAMP  := $(VENV)/.installed
# The wheel `make wheel` builds (abi3, against .venv's torch; WHEEL is a shell glob that
# matches it alone) and the environment that runs it under another torch release.
WHEEL_DIR := dist
WHEEL     := $(WHEEL_DIR)/posenc_torch-*-abi3-*.whl
COMPAT    := .venv-compat
CPY       := $(COMPAT)/bin/python
COMPAT_STAMP := $(COMPAT)/.installed
# The newest torch on the package registry, in an environment of its own (compat-newest).
COMPAT_NEWEST := .venv-compat-newest
NPY           := $(COMPAT_NEWEST)/bin/python
COMPAT_NEWEST_STAMP := $(COMPAT_NEWEST)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)
PYTEST := $(abspath $(VPY)) -m pytest -q -p no:cacheprovider
# ninja (run by meson and meson-python) would take make's jobserver from MAKEFLAGS, whose
# descriptors a recipe line does not get (make test runs parts side by side) and it says so
# with an error; with this before it, it keeps its own job count.
NOJOBSERVER := MAKEFLAGS=

.PHONY: all venv wheel build test test-parts compat-install pytest pytest-hf4 pytest-hf5_18 pytest-hf5_latest pytest-hub-kernels \
	compat compat-min \
	compat-newest abi-audit ctest sanitize fuzz ctest-aarch64 cuda-compile gpu-check bench bench-full \
	notebooks clean insns

all: build

$(STAMP): requirements-dev.txt requirements-hf4.txt requirements-hf5_18.txt requirements-hf5_latest.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -r requirements-dev.txt
	$(VPY) -m pip install -q --no-deps --upgrade --target $(HF4) -r requirements-hf4.txt
	$(VPY) -m pip install -q --no-deps --upgrade --target $(HF5_18) -r requirements-hf5_18.txt
	$(VPY) -m pip install -q --no-deps --upgrade --target $(HF5_LATEST) -r requirements-hf5_latest.txt
	touch $@

venv: $(STAMP)

# One abi3 wheel for CPython >= 3.11 and torch >= 2.11, built through a persistent build
# dir: incremental, no build isolation (isolation would fetch another torch to build with).
# Built again when a file it is made from is newer than it (WHEEL_STAMP).
WHEEL_SOURCES := meson.build meson.options pyproject.toml README.md scripts/cuda_libdir.py \
	$(shell find csrc posenc_torch -type f -not -path '*/__pycache__/*')
WHEEL_STAMP := $(WHEEL_DIR)/.built
INSTALL_STAMP := $(VENV)/.posenc-installed
$(WHEEL_STAMP): $(STAMP) $(WHEEL_SOURCES)
	rm -f $(WHEEL_DIR)/posenc_torch-*.whl
	$(NOJOBSERVER) $(VPY) -m pip wheel -q --no-build-isolation --no-deps . -w $(WHEEL_DIR) -Cbuild-dir=build
	ls $(WHEEL)
	touch $@

wheel: $(WHEEL_STAMP)

# The tests run that wheel, installed as users install it (not an editable build).
$(INSTALL_STAMP): $(WHEEL_STAMP)
	$(VPY) -m pip install -q --no-deps --force-reinstall $(WHEEL)
	touch $@

build: $(INSTALL_STAMP)

# Everything: C tests, the same under ASan + UBSan (in the fuzzing build, or `sanitize`'s
# own where the fuzzer's compiler cannot be installed), a bounded fuzzing run, the C tests on
# aarch64 under emulation, the CUDA sources compiled (cuda-compile), Python tests on
# transformers 5.x and the transformers-4.x tests against the 4.57.6 overlay, the
# position-id tests against the 5.18.0 and newest 5.x overlays, the patch beside the newest
# 5.x's hub kernels, then the same wheel's ABI audit and op tests under torch 2.14.1, under
# the oldest supported, 2.11.0, and under the newest on the package registry
# (compat-newest).
#
# The parts run TEST_JOBS at a time (default: the machine's cores): most of them are Python
# tests that keep about one core busy, so two at a time on 2 cores take about 2/3 of the
# time one after another (docs/building.md, "How long make test takes").  Each part's
# output appears whole when it ends (--output-sync); a failing part stops the run after
# the parts already running.  Parts that share an environment only read it: the wheel goes
# into .venv-compat once (compat-install), Debian packages are installed under a lock.
# First the environments and the wheel, then the parts, the longest first; TEST_JOBS=1
# runs them one after another in that order.
TEST_PARTS := fuzz pytest pytest-hf4 pytest-hf5_18 pytest-hf5_latest compat-newest compat-min \
	compat pytest-hub-kernels cuda-compile ctest-aarch64 ctest abi-audit
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
test:
	@echo "make test: the environments and the wheel, then $(words $(TEST_PARTS)) parts, $(TEST_JOBS) at a time; each part's output appears when it ends"
	+@$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target build $(COMPAT_STAMP) \
		$(COMPAT_NEWEST_STAMP)
	+@$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target test-parts

test-parts: $(TEST_PARTS)

# The verified table against the installed transformers (python -m posenc_torch.hf.verify
# --check): fails when a type of the release's written patched set has a function without a
# row for the release, or a shipped row no longer verifies; run before each test pass below
# with that pass's transformers.
VERIFY := $(abspath $(VPY)) -m posenc_torch.hf.verify --check

pytest: build
	cd tests && $(VERIFY) >/dev/null
	cd tests && $(PYTEST) .

pytest-hf4: build
	cd tests && PYTHONPATH=$(abspath $(HF4)) $(VERIFY) >/dev/null
	cd tests && PYTHONPATH=$(abspath $(HF4)) POSENC_EXPECT_TRANSFORMERS=4 $(PYTEST) -m "transformers4 or any_transformers" .

# Position ids (packed rows and batches too), the get_rope_index patch, which functions are
# patched (test_hf_decisions; the verified digests: test_hf_digests), the vision towers'
# helpers (test_vision), generation patched against plain (test_hf_generate), the q/k
# norm + rotary against transformers' norm classes (test_qk_norm) and in patched models
# (test_hf_qk_attention) against the other
# transformers 5.x releases (the version of each requirements file exactly); the newest
# also runs the tiny model of every supported type.
HF5_TESTS := test_positions.py test_hf_positions.py test_packed_positions.py test_packing.py \
	test_hf_decisions.py test_hf_digests.py test_vision.py test_vision_hf.py test_hf_generate.py \
	test_qk_norm.py test_hf_qk_attention.py
HF5_LATEST_TESTS := $(HF5_TESTS) test_hf_models.py
pytest-hf5_18: build
	cd tests && PYTHONPATH=$(abspath $(HF5_18)) $(VERIFY) >/dev/null
	cd tests && PYTHONPATH=$(abspath $(HF5_18)) \
		POSENC_EXPECT_TRANSFORMERS=$$(sed -n 's/^transformers==//p' ../requirements-hf5_18.txt) \
		$(PYTEST) -m "not transformers4" $(HF5_TESTS)

pytest-hf5_latest: build
	cd tests && PYTHONPATH=$(abspath $(HF5_LATEST)) $(VERIFY) >/dev/null
	cd tests && PYTHONPATH=$(abspath $(HF5_LATEST)) \
		POSENC_EXPECT_TRANSFORMERS=$$(sed -n 's/^transformers==//p' ../requirements-hf5_latest.txt) \
		$(PYTEST) -m "not transformers4" $(HF5_LATEST_TESTS)

# posenc_torch.hf.patch and transformers' hub kernels (tests/test_hf_kernels.py): the newest
# 5.x overlay with the kernels release it accepts beside it, which turns its rotary
# functions into hub-kernel layers and from_pretrained's kernelize on; on the CPU, with a
# local kernel mapping (POSENC_EXPECT_KERNELS: the tests fail rather than skip without it),
# the patch tests of the original types (logits, gradients, generate, torch.compile),
# generation patched against plain (test_hf_generate) and the fused q/k norm + rotary
# (test_hf_qk_attention) with those layers in place, after verify --check (with kernels
# importable the attention forwards are kernels' wrappers, which have rows of their own).
$(HUB_KERNELS)/.installed: requirements-hub-kernels.txt | $(STAMP)
	$(VPY) -m pip install -q --no-deps --upgrade --target $(HUB_KERNELS) -r requirements-hub-kernels.txt
	touch $@

pytest-hub-kernels: build $(HUB_KERNELS)/.installed
	cd tests && PYTHONPATH=$(abspath $(HF5_LATEST)):$(abspath $(HUB_KERNELS)) $(VERIFY) >/dev/null
	cd tests && PYTHONPATH=$(abspath $(HF5_LATEST)):$(abspath $(HUB_KERNELS)) POSENC_EXPECT_KERNELS=1 \
		POSENC_EXPECT_TRANSFORMERS=$$(sed -n 's/^transformers==//p' ../requirements-hf5_latest.txt) \
		$(PYTEST) test_hf_kernels.py test_hf_patch.py test_hf_generate.py test_hf_qk_attention.py

$(COMPAT_STAMP): requirements-compat.txt
	$(PYTHON) -m venv $(COMPAT)
	$(CPY) -m pip install -q -r requirements-compat.txt
	touch $@

# The op tests of another torch release: parity, gradcheck, opcheck, torch.compile, the
# extension's build and ABI facts, and the error table (the classes of the README's
# "Errors" on every torch, whatever exception type torch delivers from the shim), and the
# q/k norm's bit-identity with that torch's own reduction order.
COMPAT_TESTS := test_rope.py test_mrope.py test_positions.py test_sinusoidal.py test_shim.py \
	test_errors.py test_qk_norm.py

# The wheel built against .venv's torch, installed without dependencies (it must not
# replace torch) beside torch 2.14.1 (compat-install, once for compat and compat-min, which
# may run at the same time), and the op tests run there, with the OpenMP-runtime test.
compat-install: wheel $(COMPAT_STAMP)
	$(CPY) -m pip install -q --no-deps --force-reinstall $(WHEEL)

compat: compat-install
	cd tests && $(abspath $(CPY)) -c "import torch, posenc_torch; print('torch', torch.__version__)"
	cd tests && $(abspath $(CPY)) -m pytest -q -p no:cacheprovider -m "not transformers4" \
		$(COMPAT_TESTS) test_runtime.py

# The newest torch on the package registry (requirements-compat-newest.txt), past the torch
# cap of a pip constraints file on the machine (these machines carry one): the cap is lifted
# for this one install alone (PIP_CONSTRAINT=/dev/null; pip 23 reads an empty value as
# unset).  The same wheel, the op tests, the OpenMP-runtime test, the tests in which
# posenc_torch.hf hands a call posenc refuses to transformers (get_rope_index, the rotary
# functions, the vision routes), generation patched against plain (test_hf_generate) and
# the fused q/k norm + rotary in patched models (test_hf_qk_attention).
COMPAT_NEWEST_HF_TESTS := test_hf_positions.py test_hf_generate.py test_hf_qk_attention.py \
	test_hf_patch.py::test_unsupported_inputs_go_to_transformers \
	test_vision_hf.py::test_a_route_whose_function_changed_falls_back
$(COMPAT_NEWEST_STAMP): requirements-compat-newest.txt
	$(PYTHON) -m venv $(COMPAT_NEWEST)
	PIP_CONSTRAINT=/dev/null $(NPY) -m pip install -q -r requirements-compat-newest.txt
	touch $@

compat-newest: wheel $(COMPAT_NEWEST_STAMP)
	$(NPY) -m pip install -q --no-deps --force-reinstall $(WHEEL)
	cd tests && $(abspath $(NPY)) -c "import torch, posenc_torch; print('torch', torch.__version__)"
	cd tests && $(abspath $(NPY)) -m pytest -q -p no:cacheprovider -m "not transformers4" \
		$(COMPAT_TESTS) test_runtime.py $(COMPAT_NEWEST_HF_TESTS)

# The oldest torch the README promises, 2.11.0 (the package registry's wheel, its NVIDIA
# libraries taken from .venv-compat's, which have the same sonames), as an overlay put first
# on .venv-compat's path: the shim compiled against its headers (CPU, and with the CUDA
# parts when nvcc's headers are there), then the compat op tests on the wheel built in .venv.
TORCH_MIN     := 2.11.0
TORCH_MIN_DIR := $(COMPAT)/torch$(subst .,_,$(TORCH_MIN))
$(TORCH_MIN_DIR)/.installed: | $(COMPAT_STAMP)
	$(CPY) -m pip install -q --no-deps --upgrade --target $(TORCH_MIN_DIR) torch==$(TORCH_MIN)
	ln -sfn $$($(CPY) -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))")/nvidia \
		$(TORCH_MIN_DIR)/nvidia
	touch $@

SHIM_FLAGS = -std=c++20 -fopenmp -Wall -Wextra -Werror -Wno-unused-parameter -Wno-attributes \
	-DPy_LIMITED_API=0x030b0000 -DTORCH_TARGET_VERSION=0x020b000000000000 -Icsrc \
	-isystem $(TORCH_MIN_DIR)/torch/include \
	-I$$($(VPY) -c "import sysconfig; print(sysconfig.get_paths()['include'])")
SHIM_SOURCES := $(wildcard csrc/torch/*.cpp)
compat-min: compat-install $(TORCH_MIN_DIR)/.installed
	mkdir -p build/shim-torch$(TORCH_MIN)
	for f in $(SHIM_SOURCES); do $(CXX) $(SHIM_FLAGS) -c $$f \
		-o build/shim-torch$(TORCH_MIN)/$$(basename $$f .cpp).o || exit 1; done
	@nvcc=$$(command -v nvcc || true); if [ -z "$$nvcc" ]; then \
		echo "!!!! compat-min: nvcc not found, the shim's CUDA parts were NOT compiled !!!!"; \
	else set -x; for f in $(SHIM_SOURCES); do $(CXX) $(SHIM_FLAGS) -DPOSENC_WITH_CUDA -DUSE_CUDA \
		-isystem "$$(dirname "$$($(VPY) scripts/cuda_libdir.py "$$nvcc")")/include" \
		-c $$f -o build/shim-torch$(TORCH_MIN)/$$(basename $$f .cpp)-cuda.o || exit 1; done; fi
	cd tests && PYTHONPATH=$(abspath $(TORCH_MIN_DIR)) $(abspath $(CPY)) -c \
		"import torch, posenc_torch; assert torch.__version__.startswith('$(TORCH_MIN)'), torch.__version__; print('torch', torch.__version__)"
	cd tests && PYTHONPATH=$(abspath $(TORCH_MIN_DIR)) $(abspath $(CPY)) -m pytest -q \
		-p no:cacheprovider -m "not transformers4" $(COMPAT_TESTS)

# The extension must use only the LibTorch stable ABI and the limited Python API (exit 1
# otherwise); tests/test_shim.py (in `compat`) also holds its minimum torch to 2.11.
abi-audit: wheel $(COMPAT_STAMP)
	rm -rf build/wheel-audit
	$(CPY) -m zipfile -e $(WHEEL) build/wheel-audit
	$(COMPAT)/bin/torch-abi-audit --check both -v build/wheel-audit/posenc_torch

# The C tests as the wheel's build compiled them (build/: the kernels the wheel holds, with
# its flags); the torch-free build (-Dpython_extension=false) is the fuzzing and aarch64
# builds'.
ctest: wheel
	$(VENV)/bin/meson test -C build --no-rebuild --print-errorlogs

sanitize: $(STAMP)
	$(NOJOBSERVER) $(VENV)/bin/meson setup builddir-asan -Dpython_extension=false -Dbuildtype=debug \
		-Db_sanitize=address,undefined -Db_lundef=false --reconfigure >/dev/null
	$(NOJOBSERVER) UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
		$(VENV)/bin/meson test -C builddir-asan --print-errorlogs

# Debian packages a target needs: installed when missing (as root, or through sudo; one
# target at a time, under a lock, as make test may run two that need packages).  Only
# where that is impossible (no apt-get) does the target stop, loudly, without failing.
define need_packages
	@missing=""; for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null; then \
		echo "!!!! SKIPPED $@: needs$$missing and this machine has no apt-get to install them !!!!"; \
		touch $(VENV)/.skip-$@; exit 0; fi; \
	sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	echo "$@: installing$$missing"; \
	flock $(VENV)/.apt.lock sh -c "$$sudo apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null"
endef

# libFuzzer with ASan + UBSan over the C entry points (csrc/fuzz), FUZZ_SECONDS per
# harness, starting from the committed seed corpus (new inputs go to builddir-fuzz/).  The
# same build runs the C tests first (the sanitized C tests of `make test`: one ASan + UBSan
# build for both); where clang cannot be installed, `sanitize` runs them instead.
FUZZ_SECONDS ?= 30
FUZZERS := rope positions vision qk_norm
fuzz: $(STAMP)
	@rm -f $(VENV)/.skip-fuzz
	$(call need_packages,clang libclang-rt-14-dev libomp-14-dev)
	@if [ -e $(VENV)/.skip-fuzz ]; then $(MAKE) --no-print-directory sanitize; exit $$?; fi; \
	set -e; \
	$(NOJOBSERVER) CC=clang $(VENV)/bin/meson setup builddir-fuzz -Dpython_extension=false -Dfuzz=true \
		-Dbuildtype=debugoptimized -Db_sanitize=address,undefined -Db_lundef=false \
		--reconfigure >/dev/null; \
	$(NOJOBSERVER) $(VENV)/bin/meson compile -C builddir-fuzz >/dev/null; \
	$(NOJOBSERVER) UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
		$(VENV)/bin/meson test -C builddir-fuzz --print-errorlogs; \
	for f in $(FUZZERS); do \
		mkdir -p builddir-fuzz/corpus-$$f; \
		UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
		builddir-fuzz/csrc/fuzz/fuzz_$$f -max_total_time=$(FUZZ_SECONDS) -max_len=512 \
			-timeout=20 -print_final_stats=1 -artifact_prefix=builddir-fuzz/crash-$$f- \
			builddir-fuzz/corpus-$$f csrc/fuzz/corpus/$$f >builddir-fuzz/fuzz-$$f.log 2>&1 \
			|| { tail -n 80 builddir-fuzz/fuzz-$$f.log; exit 1; }; \
		echo "fuzz_$$f:"; grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::number_of_executed_units" \
			builddir-fuzz/fuzz-$$f.log; \
	done

# The C kernels and their tests built for aarch64 (cross/aarch64-linux-gnu.ini) and run
# under qemu-user.
ctest-aarch64: $(STAMP)
	@rm -f $(VENV)/.skip-ctest-aarch64
	$(call need_packages,gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)
	@if [ -e $(VENV)/.skip-ctest-aarch64 ]; then exit 0; fi; set -e; \
	$(NOJOBSERVER) $(VENV)/bin/meson setup builddir-aarch64 --cross-file cross/aarch64-linux-gnu.ini \
		-Dpython_extension=false --reconfigure >/dev/null; \
	$(NOJOBSERVER) $(VENV)/bin/meson test -C builddir-aarch64 --print-errorlogs

# The CUDA sources compiled with this machine's nvcc for sm_80 and sm_90 (nothing runs; a
# loud skip without nvcc), so they cannot rot on machines without a GPU; their machine code
# checked (scripts/cuda_sass_check.py, with cuobjdump from the wheels in CUDA_TOOLS), and
# their host emulation linked with the C kernels of the wheel's build.
CUDA_TOOLS := $(VENV)/cuda-tools
$(CUDA_TOOLS)/.installed: requirements-cuda-tools.txt | $(STAMP)
	$(VPY) -m pip install -q --no-deps --upgrade --target $(CUDA_TOOLS) -r requirements-cuda-tools.txt
	touch $@

cuda-compile: wheel $(CUDA_TOOLS)/.installed
	$(NOJOBSERVER) PYTHON=$(abspath $(VPY)) KERNELS_BUILD=build scripts/cuda_compile.sh

# On a machine with an NVIDIA GPU: build against its torch, run the GPU tests and the GPU
# benchmark, everything into one folder (scripts/gpu_check.sh; docs/gpu.md).
# PHASE=first (the default: preflight, build, math, tests), bench, or one of preflight,
# build, math, tests, sanitize, all.
gpu-check:
	scripts/gpu_check.sh $(or $(PHASE),first)

bench: build
	$(VPY) benchmarks/run.py --quick

bench-full: build
	$(VPY) benchmarks/run.py --full

# Instructions per element of the row loops, from the machine code of scripts/loop_probe.c
# (docs/benchmarks.md, "Instructions per element"); needs gcc and objdump, llvm-mca if any.
insns:
	$(PYTHON) scripts/loop_insns.py --time

# Re-run the notebooks and store their outputs (figures included) in the .ipynb files;
# tests/test_notebooks.py (part of `make pytest`) checks that they run and were committed so.
notebooks: build
	$(VPY) notebooks/execute.py

clean:
	rm -rf build builddir-c builddir-asan builddir-fuzz builddir-aarch64 builddir-cuda builddir-gpu \
		$(WHEEL_DIR)
