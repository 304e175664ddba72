#!/bin/sh
# Build tests/c/test_verbs (the verbs backend + generic layer, no Python) into $1.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-/tmp}
c=$root/csrc
${CC:-cc} -std=gnu11 -O1 -g -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers \
    -I"$c/core" -I"$c/transport" -I"$c/backends/verbs" \
    -o "$out/test_verbs" "$root/tests/c/test_verbs.c" \
    "$c"/core/wx_common.c "$c"/core/wx_param.c "$c"/core/wx_dl.c "$c"/core/wx_dl_cuda.c \
    "$c"/transport/*.c "$c"/backends/verbs/*.c \
    ${WXFER_C_FLAGS:-} -ldl -lpthread
echo "$out/test_verbs"
