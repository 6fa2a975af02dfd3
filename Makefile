# The commands of the README.  Every target creates or reuses .venv/ and rebuilds the
# extension first, so they work on a fresh clone with nothing installed by hand.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
HF4    := $(VENV)/hf4
STAMP  := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)
PYTEST := $(abspath $(VPY)) -m pytest -q -p no:cacheprovider

.PHONY: all venv build test pytest pytest-hf4 ctest sanitize cuda-compile gpu-check bench bench-full notebooks clean

all: build

$(STAMP): requirements-dev.txt requirements-hf4.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -r requirements-dev.txt
	$(VPY) -m pip install -q --no-deps --upgrade --target $(HF4) -r requirements-hf4.txt
	touch $@

venv: $(STAMP)

# Non-editable install through a persistent build dir: incremental, no build isolation
# (isolation would fetch another torch and link against it).
build: $(STAMP)
	$(VPY) -m pip install -q --no-build-isolation --no-deps . -Cbuild-dir=build

# Everything: C tests, the same under ASan + UBSan, Python tests on transformers 5.x and
# the transformers-4.x tests against the 4.57.6 overlay.
test: build ctest sanitize cuda-compile pytest pytest-hf4

pytest: build
	cd tests && $(PYTEST) .

pytest-hf4: build
	cd tests && PYTHONPATH=$(abspath $(HF4)) POSENC_EXPECT_TRANSFORMERS=4 $(PYTEST) -m "transformers4 or any_transformers" .

ctest: $(STAMP)
	$(VENV)/bin/meson setup builddir-c -Dpython_extension=false --reconfigure >/dev/null
	$(VENV)/bin/meson test -C builddir-c --print-errorlogs

sanitize: $(STAMP)
	$(VENV)/bin/meson setup builddir-asan -Dpython_extension=false -Dbuildtype=debug \
		-Db_sanitize=address,undefined -Db_lundef=false --reconfigure >/dev/null
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
		$(VENV)/bin/meson test -C builddir-asan --print-errorlogs

# The CUDA sources compiled with this machine's nvcc for sm_80 and sm_90 (nothing runs; a
# loud skip without nvcc), so they cannot rot on machines without a GPU.
cuda-compile: $(STAMP)
	scripts/cuda_compile.sh

# On a machine with an NVIDIA GPU: build against its torch, run the GPU tests and the GPU
# benchmark, everything into one folder (scripts/gpu_check.sh; README, section GPU).
gpu-check:
	scripts/gpu_check.sh

bench: build
	$(VPY) benchmarks/run.py --quick

bench-full: build
	$(VPY) benchmarks/run.py --full

# Re-run the notebooks and store their outputs (figures included) in the .ipynb files;
# tests/test_notebooks.py (part of `make pytest`) checks that they run and were committed so.
notebooks: build
	$(VPY) notebooks/execute.py

clean:
	rm -rf build builddir-c builddir-asan builddir-cuda builddir-gpu
