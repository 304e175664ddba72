#!/bin/sh
# Build tests/c/test_verbs (the verbs backend + generic layer, no Python) into $1.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-/tmp}
${CC:-cc} -std=gnu11 -O1 -g -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
    -DWX_HAVE_VERBS -I"$root/csrc/core" -o "$out/test_verbs" "$root/tests/c/test_verbs.c" \
    "$root/csrc/core/wx_common.c" "$root/csrc/core/wx_desc.c" "$root/csrc/core/wx_dl.c" \
    "$root/csrc/core/wx_transport.c" "$root/csrc/core/wx_dl_verbs.c" "$root"/csrc/core/wx_verbs*.c \
    -ldl -lpthread
echo "$out/test_verbs"
