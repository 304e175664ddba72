#!/usr/bin/env bash
# The package as a user installs it (`make test` runs this after the suite): build the
# portable wheel (.ci/wheel.sh: sdist, then a manylinux_2_28 wheel from it, compiled by zig cc
# for glibc 2.28 with the -dev headers hidden), install it into a fresh virtual environment,
# and run a named subset of the suite from a folder outside the checkout, with the checkout
# not on sys.path:
#   tests/test_portable.py  every backend built in; fabric over the real libfabric, verbs over
#                           the emulation; no foreign library linked; glibc symbols <= 2.28
#   tests/test_doctor.py    `python -m wxfer doctor` against what is there
#   tests/test_package.py   every module imports from site-packages, the version, not the checkout
#   tests/test_mapping.py, tests/test_mapping_hf5.py   the mapping (transformers 4 and 5 layouts, FP8)
#   tests/test_plan_small.py                          the plan and its checks
#   tests/test_import.py                              backends and the CLI without libcuda / libibverbs
#   tests/test_e2e.py::test_demo_cli_bf16_json_and_unchanged_step
#       `python -m wxfer demo`: FSDP2 trainer processes push into inference worker processes over
#       fabric tcp; every byte and the logits checked
# The fresh venv holds only the wheel; its dependencies (torch, numpy, transformers, pytest)
# come from the project's venv ($PY) through a .pth file, so nothing is downloaded.
set -euo pipefail
CO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$CO/.venv/bin/python}"
case "$PY" in /*) ;; *) PY="$CO/$PY" ;; esac
W="$(mktemp -d "${TMPDIR:-/tmp}/wxfer-installed.XXXXXX")"
trap 'rm -rf "$W"' EXIT
t0=$(date +%s)

echo "installed-package test: building the portable wheel (.ci/wheel.sh)"
PY="$PY" bash "$CO/.ci/wheel.sh" "$W/dist"

"$PY" -m venv --without-pip "$W/venv"
VPY="$W/venv/bin/python"
DEPS="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$DEPS" >"$SITE/zz_wxfer_test_deps.pth"        # after the venv's own site-packages
"$PY" -m pip --python "$VPY" install -q --no-deps --no-index "$W/dist"/wxfer-*.whl

mkdir -p "$W/run/tests"
for f in conftest.py helpers.py test_package.py test_mapping.py test_mapping_hf5.py test_plan_small.py test_import.py \
         test_e2e.py test_portable.py test_doctor.py; do
  cp "$CO/tests/$f" "$W/run/tests/"
done
cat >"$W/run/pytest.ini" <<'INI'
[pytest]
testpaths = tests
timeout = 300
markers =
    gpu: needs an NVIDIA GPU (skips cleanly without one)
    gpu2: needs two NVIDIA GPUs
    rdma: needs a real RDMA device (skips cleanly without one)
INI
cd "$W/run"
env -u PYTHONPATH "$VPY" -c "import wxfer, sys; print('installed-package test: wxfer', wxfer.__version__, 'from', wxfer.__file__)"
env -u PYTHONPATH WXFER_INSTALLED="$CO" WXFER_DEMO_CPU=1 WXFER_WHEEL_GLIBC=2.28 "$VPY" -m pytest -q -ra -p no:cacheprovider \
  tests/test_package.py tests/test_mapping.py tests/test_mapping_hf5.py tests/test_plan_small.py tests/test_import.py \
  tests/test_portable.py tests/test_doctor.py \
  "tests/test_e2e.py::test_demo_cli_bf16_json_and_unchanged_step"
echo "installed-package test: passed in $(( $(date +%s) - t0 )) s"
