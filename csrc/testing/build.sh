#!/bin/sh
# Build the libibverbs EMULATION used by the verbs tests: csrc/testing/libwxemu_verbs.so.
# It is NOT a backend and is never shipped; the verbs backend loads it only when
# WXFER_LIBIBVERBS names it. Usage: csrc/testing/build.sh [outdir]   (prints the .so path)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
cc=${CC:-cc}
mkdir -p "$out"
so="$out/libwxemu_verbs.so"
if [ ! -f /usr/include/infiniband/verbs.h ] && ! echo '#include <infiniband/verbs.h>' | $cc -E -x c - >/dev/null 2>&1; then
    echo "build.sh: infiniband/verbs.h not found (install libibverbs-dev)" >&2
    exit 2
fi
newest=$(ls -t "$here"/wxemu_verbs*.c "$here"/wxemu_verbs.h "$here"/../core/wx_cuda_abi.h "$so" 2>/dev/null | head -n1)
if [ "$newest" != "$so" ]; then
    $cc -std=gnu11 -O2 -g -Wall -Wextra -Wno-unused-parameter ${WXEMU_CFLAGS:-} -fPIC -shared \
        -I"$here/../core" -o "$so.tmp.$$" "$here"/wxemu_verbs.c "$here"/wxemu_verbs_hca.c \
        "$here"/wxemu_verbs_mr.c "$here"/wxemu_verbs_cuda.c -lpthread -ldl
    mv -f "$so.tmp.$$" "$so"
fi
echo "$so"
