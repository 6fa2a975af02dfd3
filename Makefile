# The commands of the README.  Every target creates or reuses .venv/ and rebuilds the
# extension first, so they work on a fresh clone with nothing installed by hand.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
HF4    := $(VENV)/hf4
STAMP  := $(VENV)/.installed
# The wheel `make wheel` builds (abi3, against .venv's torch; WHEEL is a shell glob that
# matches it alone) and the environment that runs it under another torch release.
WHEEL_DIR := dist
WHEEL     := $(WHEEL_DIR)/posenc_torch-*-abi3-*.whl
COMPAT    := .venv-compat
CPY       := $(COMPAT)/bin/python
COMPAT_STAMP := $(COMPAT)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)
PYTEST := $(abspath $(VPY)) -m pytest -q -p no:cacheprovider

.PHONY: all venv wheel build test pytest pytest-hf4 compat abi-audit ctest sanitize cuda-compile \
	gpu-check bench bench-full notebooks clean

all: build

$(STAMP): requirements-dev.txt requirements-hf4.txt
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q -r requirements-dev.txt
	$(VPY) -m pip install -q --no-deps --upgrade --target $(HF4) -r requirements-hf4.txt
	touch $@

venv: $(STAMP)

# One abi3 wheel for CPython >= 3.11 and torch >= 2.11, built through a persistent build
# dir: incremental, no build isolation (isolation would fetch another torch to build with).
wheel: $(STAMP)
	rm -f $(WHEEL_DIR)/posenc_torch-*.whl
	$(VPY) -m pip wheel -q --no-build-isolation --no-deps . -w $(WHEEL_DIR) -Cbuild-dir=build
	ls $(WHEEL)

# The tests run that wheel, installed as users install it (not an editable build).
build: wheel
	$(VPY) -m pip install -q --no-deps --force-reinstall $(WHEEL)

# Everything: C tests, the same under ASan + UBSan, Python tests on transformers 5.x and
# the transformers-4.x tests against the 4.57.6 overlay, then the same wheel's ABI audit
# and op tests under another torch release; the CUDA sources compiled (cuda-compile).
test: build ctest sanitize cuda-compile pytest pytest-hf4 abi-audit compat

pytest: build
	cd tests && $(PYTEST) .

pytest-hf4: build
	cd tests && PYTHONPATH=$(abspath $(HF4)) POSENC_EXPECT_TRANSFORMERS=4 $(PYTEST) -m "transformers4 or any_transformers" .

$(COMPAT_STAMP): requirements-compat.txt
	$(PYTHON) -m venv $(COMPAT)
	$(CPY) -m pip install -q -r requirements-compat.txt
	touch $@

# The wheel built against .venv's torch, installed without dependencies (it must not
# replace torch) beside torch 2.14.1, and the op tests run there: parity, gradcheck,
# opcheck, torch.compile.
compat: wheel $(COMPAT_STAMP)
	$(CPY) -m pip install -q --no-deps --force-reinstall $(WHEEL)
	cd tests && $(abspath $(CPY)) -c "import torch, posenc_torch; print('torch', torch.__version__)"
	cd tests && $(abspath $(CPY)) -m pytest -q -p no:cacheprovider -m "not transformers4" \
		test_rope.py test_mrope.py test_positions.py test_sinusoidal.py test_shim.py

# The extension must use only the LibTorch stable ABI and the limited Python API (exit 1
# otherwise); tests/test_shim.py (in `compat`) also holds its minimum torch to 2.11.
abi-audit: wheel $(COMPAT_STAMP)
	rm -rf build/wheel-audit
	$(CPY) -m zipfile -e $(WHEEL) build/wheel-audit
	$(COMPAT)/bin/torch-abi-audit --check both -v build/wheel-audit/posenc_torch

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
	rm -rf build builddir-c builddir-asan builddir-cuda builddir-gpu $(WHEEL_DIR)
