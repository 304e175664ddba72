"""Compare wxfer's own declarations of libibverbs, libfabric, the CUDA driver API and NVRTC
(csrc/core/wx_ibv_abi.h, wx_fi_abi.h, wx_cuda_abi.h, wx_nvrtc_abi.h) with the system headers.

For each library whose header is installed (infiniband/verbs.h, rdma/fabric.h,
$CUDA_HOME/include/cuda.h, nvrtc.h there or in the nvidia pip wheels), wx_abi_dump.c is
compiled twice, over the system header and over ours, run, and the "name value" lines
(every size, offset, constant and CUDA symbol name of wx_abi_list.h) compared. Any
difference fails with the lines that differ. A library whose header is absent is reported
as skipped (never as passed).

  python csrc/abi/abi_check.py [--cuda-home DIR] [--cc CC] [--require verbs,fabric,cuda,nvrtc]

`make abi-check` and `make build` run it (setup.py with WXFER_ABI_CHECK=1); CI requires
verbs and fabric (Debian's libibverbs-dev, libfabric-dev), `make gpu-test` requires cuda.
"""

import argparse
import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORE = os.path.join(os.path.dirname(HERE), "core")
# Differences that are deliberate, with the reason (printed, never silently passed).
KNOWN = {
    "symbol cuEventElapsedTime": "wx_dl_cuda.c takes the unversioned symbol, which CUDA 12 "
    "drivers (no _v2) and CUDA 13 drivers both export; timing-only use",
    "symbol cuMemcpyBatchAsync_v1": "not a cuda.h name: wx_dl_cuda.c's fallback to the CUDA 12.8 ABI "
    "(with failIdx) under its unversioned symbol, for 12.8 / 12.9 drivers that lack cuMemcpyBatchAsync_v2",
}
# Structs the library may grow at the end: ours may be a prefix of the system's (every offset
# still checked), because we hand the library our size and it fills no more than that.
GROWS = {
    "sizeof(struct ibv_port_attr)": "passed with its size to the query_port op, which fills at most "
    "that much; newer rdma-core appends active_speed_ex (56 bytes), rdma-core 44 has 52",
}
FI_HEADERS = ("fabric", "fi_cm", "fi_domain", "fi_endpoint", "fi_eq", "fi_errno", "fi_rma")
LIBS = [
    # name, section macro, system headers (the first: the one looked for), what it was written
    # against; wx_abi_dump.c gets one side's headers with -include
    ("verbs", "WX_ABI_VERBS", ("infiniband/verbs.h",), "wx_ibv_abi.h"),
    ("fabric", "WX_ABI_FABRIC", tuple("rdma/%s.h" % h for h in FI_HEADERS), "wx_fi_abi.h"),
    ("cuda", "WX_ABI_CUDA", ("cuda.h",), "wx_cuda_abi.h"),
    ("nvrtc", "WX_ABI_NVRTC", ("nvrtc.h",), "wx_nvrtc_abi.h"),
]


def _grown(what, system, ours):
    """A struct of GROWS that is larger in the system's header than ours (a prefix of it)."""
    try:
        return what in GROWS and int(system) > int(ours)
    except ValueError:
        return False


def _incs(name, cuda_home):
    """Where to look for the library's header beyond the compiler's default path."""
    if name == "cuda":
        return [os.path.join(cuda_home, "include")]
    if name == "nvrtc":  # the toolkit, or the nvidia pip wheels (torch's CUDA wheels bring them)
        out = [os.path.join(cuda_home, "include")]
        for base in sys.path:
            for sub in ("cu13", "cu12", "cuda_nvrtc"):
                d = os.path.join(base or ".", "nvidia", sub, "include")
                if os.path.isfile(os.path.join(d, "nvrtc.h")):
                    out.append(d)
        return out
    return []


def _cc(cc):
    return shlex.split(cc or os.environ.get("CC") or "cc")


def _have(cc, header, incs):
    src = "#include <%s>\nint main(void){return 0;}\n" % header
    cmd = cc + ["-fsyntax-only", "-x", "c", "-"] + ["-I" + i for i in incs]
    r = subprocess.run(cmd, input=src, text=True, capture_output=True)
    return r.returncode == 0


def _dump(cc, section, headers, system, incs, tmp, core=CORE):
    exe = os.path.join(tmp, "dump_%s_%s" % (section, "sys" if system else "ours"))
    cmd = cc + ["-std=gnu11", "-w", "-D" + section, "-I" + core, "-I" + HERE]
    if system:
        cmd += ["-DWX_ABI_SYSTEM"] + ["-I" + i for i in incs]
    for h in headers:
        cmd += ["-include", h]
    cmd += ["-o", exe, os.path.join(HERE, "wx_abi_dump.c")]
    r = subprocess.run(cmd, text=True, capture_output=True)
    if r.returncode != 0:
        raise RuntimeError("abi-check: compiling %s failed:\n%s" % (" ".join(cmd), r.stderr[-4000:]))
    out = subprocess.run([exe], text=True, capture_output=True, check=True).stdout
    return [ln.rsplit(" ", 1) for ln in out.splitlines()]


def check(cc=None, cuda_home="/usr/local/cuda", require=(), out=sys.stdout, core=CORE, only=None):
    cc = _cc(cc)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name, section, headers, ours in LIBS:
            if only and name not in only:
                continue
            header, incs = headers[0], _incs(name, cuda_home)
            if not _have(cc, header, incs):
                where = " (searched %s)" % ", ".join(incs) if incs else ""
                msg = "abi-check: %s: %s not found%s: skipped" % (name, header, where)
                if name in require:
                    print(msg + ", but it is required here", file=out)
                    failed = True
                else:
                    print(msg, file=out)
                continue
            sysv = _dump(cc, section, headers, True, incs, tmp)
            oursv = _dump(cc, section, (ours,), False, incs, tmp, core)
            if len(sysv) != len(oursv):
                raise RuntimeError("abi-check: %s: the two dumps differ in length" % name)
            diff = [(a[0], a[1], b[1]) for a, b in zip(sysv, oursv) if a != b]
            bad = [d for d in diff if d[0] not in KNOWN and not _grown(*d)]
            for what, s, o in diff:
                if what in KNOWN or _grown(what, s, o):
                    why = KNOWN.get(what) or GROWS[what]
                    print("abi-check: %s: %s: system %s, ours %s (known: %s)" % (name, what, s, o, why), file=out)
            if bad:
                failed = True
                print(
                    "abi-check: %s: %d of %d items differ between <%s> and %s:"
                    % (name, len(bad), len(sysv), header, ours),
                    file=out,
                )
                for what, s, o in bad:
                    print("  %-60s system %-20s ours %s" % (what, s, o), file=out)
            else:
                print(
                    "abi-check: %s: %d sizes, offsets, constants and names match <%s> (%s)"
                    % (name, len(sysv), header, ours),
                    file=out,
                )
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default=None)
    ap.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    ap.add_argument("--require", default="", help="comma-separated libraries whose headers must be there")
    ap.add_argument("--only", default="", help="comma-separated libraries to check (default: all)")
    ap.add_argument("--core", default=CORE, help="the folder with our wx_*_abi.h (tests point it at a changed copy)")
    a = ap.parse_args(argv)
    req = [r for r in a.require.split(",") if r]
    only = [r for r in a.only.split(",") if r] or None
    return check(a.cc, a.cuda_home, req, core=a.core, only=only)


if __name__ == "__main__":
    sys.exit(main())
