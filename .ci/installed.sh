#!/usr/bin/env bash
# The package as a user installs it (`make test` runs this after the suite): build the wheel,
# install it into a fresh virtual environment, and run a named subset of the suite from a
# folder outside the checkout, with the checkout not on sys.path:
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

echo "installed-package test: building the wheel"
if ! "$PY" -m build --wheel --no-isolation --outdir "$W/dist" "$CO" >"$W/build.log" 2>&1; then
  tail -40 "$W/build.log"; exit 1
fi

"$PY" -m venv --without-pip "$W/venv"
VPY="$W/venv/bin/python"
DEPS="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$DEPS" >"$SITE/zz_wxfer_test_deps.pth"        # after the venv's own site-packages
"$PY" -m pip --python "$VPY" install -q --no-deps --no-index "$W/dist"/wxfer-*.whl

mkdir -p "$W/run/tests"
for f in conftest.py test_package.py test_mapping.py test_mapping_hf5.py test_plan_small.py test_import.py \
         test_e2e.py; do
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
env -u PYTHONPATH WXFER_INSTALLED="$CO" WXFER_DEMO_CPU=1 "$VPY" -m pytest -q -ra -p no:cacheprovider \
  tests/test_package.py tests/test_mapping.py tests/test_mapping_hf5.py tests/test_plan_small.py tests/test_import.py \
  "tests/test_e2e.py::test_demo_cli_bf16_json_and_unchanged_step"
echo "installed-package test: passed in $(( $(date +%s) - t0 )) s"
