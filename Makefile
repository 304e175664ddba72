# wxfer - the two commands a new user needs are `make demo` and `make test`.
# `make setup` (run by both) installs the Debian packages, creates .venv with a CPU torch,
# and builds the extension in place. It is idempotent.

PY        ?= .venv/bin/python
VENV_STAMP = .venv/.wxfer-deps-5
APT_PKGS   = libfabric-dev libfabric-bin libibverbs-dev rdma-core build-essential python3-dev
PIP_PKGS   = torch==2.13.0 numpy pytest pytest-timeout hypothesis pandas matplotlib nbformat nbclient ipykernel setuptools wheel atheris build transformers
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_FLAGS ?= -q -ra
GPU_ENV    = NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

.PHONY: setup apt venv build test test-installed demo gpu-test gpu-bench asan-test clean

setup: apt venv build

apt:
	@dpkg -s $(APT_PKGS) >/dev/null 2>&1 || { \
	  echo "make setup: installing Debian packages: $(APT_PKGS)"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PKGS) >/dev/null; }

venv: $(VENV_STAMP)

$(VENV_STAMP):
	@test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_PKGS)
	@touch $@

build: $(VENV_STAMP)
	$(PY) setup.py -q build_ext --inplace

# the suite from the checkout, then the installed wheel from outside it (.ci/installed.sh)
test: setup
	$(PY) -m pytest $(PYTEST_FLAGS) tests
	$(MAKE) --no-print-directory test-installed

test-installed: setup
	PY=$(PY) bash .ci/installed.sh

demo: setup
	$(PY) -m wxfer demo

# On a GPU machine (its python3 already has torch): build in place and run the gpu tests.
# `make gpu-bench` then runs the GPU benchmarks; logs go to $$OUT (or ./.out) when set.
LOGDIR ?= $(if $(OUT),$(OUT),.out)
gpu-test:
	$(GPU_ENV) python3 setup.py -q build_ext --inplace
	$(GPU_ENV) python3 -m pytest -q -ra -m "gpu or gpu2" tests

gpu-bench:
	mkdir -p $(LOGDIR)
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_cuda_ipc.py --json 2>&1 | tee $(LOGDIR)/bench_cuda_ipc.log
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 -m wxfer demo --json 2>&1 | tee $(LOGDIR)/demo_gpu.log

asan-test: setup
	WXFER_SANITIZE=1 $(PY) setup.py -q build_ext --inplace --force
	PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0 \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  $(PY) -m pytest $(PYTEST_FLAGS) tests/test_desc.py tests/test_engine.py tests/test_fabric.py tests/test_verbs.py tests/test_faults.py
	$(PY) setup.py -q build_ext --inplace --force

clean:
	rm -rf build dist wxfer/*.so *.egg-info
