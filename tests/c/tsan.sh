#!/bin/sh
# `make tsan-test`: the native test programs built with ThreadSanitizer and run, with no
# Python in the process (the engine's two stage threads, the transports' progress threads
# and the caller's). Any race report fails the run (TSan exits 66). Usage: tsan.sh OUTDIR
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-build/tsan}
mkdir -p "$out"
c=$root/csrc
cc=${CC:-cc}
flags="-std=gnu11 -O1 -g -fsanitize=thread -fno-omit-frame-pointer -DWX_TESTING=1 -Wall -Wextra
       -Wno-unused-parameter -Wno-missing-field-initializers"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1 second_deadlock_stack=1}"
status=0
# fabric_pair and test_verbs need no library headers (csrc/core/wx_*_abi.h); they need
# libfabric.so.1 at run time, and the emulation (built from infiniband/verbs.h) for verbs.
if [ -e /usr/lib/x86_64-linux-gnu/libfabric.so.1 ] || ldconfig -p 2>/dev/null | grep -q libfabric.so.1; then
    # shellcheck disable=SC2086
    $cc $flags -I"$c/core" -I"$c/transport" -I"$c/engine" -I"$c/backends/fabric" \
        -o "$out/fabric_pair" "$root/tests/c/fabric_pair.c" "$c"/core/*.c "$c"/transport/*.c \
        "$c"/engine/*.c "$c"/backends/fabric/*.c -ldl -lpthread
    for prov in tcp shm; do
        for sc in engine external basic small closeout dead; do
            if timeout 120 "$out/fabric_pair" "$prov" "$sc" timeout=3 >"$out/fabric_$prov.$sc.log" 2>&1; then
                echo "tsan: fabric_pair $prov $sc ok"
            else
                echo "tsan: fabric_pair $prov $sc FAILED:"; tail -n 60 "$out/fabric_$prov.$sc.log"; status=1
            fi
        done
    done
else
    echo "tsan: libfabric.so.1 missing: fabric_pair skipped"
fi
if [ -f /usr/include/infiniband/verbs.h ]; then
    emu=$(sh "$c/testing/build.sh" | tail -n1)
    WXFER_C_FLAGS="-fsanitize=thread -DWX_TESTING=1" sh "$root/tests/c/build_test_verbs.sh" "$out" >/dev/null
    for sc in basic selective; do
        if WXFER_LIBIBVERBS=$emu WXEMU_VERBS_RETRY_CAP_MS=1000 timeout 120 "$out/test_verbs" "$sc" \
            >"$out/verbs.$sc.log" 2>&1; then
            echo "tsan: test_verbs $sc ok"
        else
            echo "tsan: test_verbs $sc FAILED:"; tail -n 60 "$out/verbs.$sc.log"; status=1
        fi
    done
else
    echo "tsan: rdma-core headers missing (the emulation is built from them): test_verbs skipped"
fi
exit $status
