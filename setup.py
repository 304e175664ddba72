"""Build the private extension wxfer._wxfer (plain setuptools, C only).

Build switches (environment variables):
  WXFER_DEBUG=1     -O0 -g, assertions on
  WXFER_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer (run with
                    LD_PRELOAD of libasan and PYTHONMALLOC=malloc; see `make asan-test`)
  WXFER_WERROR=1    warnings are errors
  CUDA_HOME         where cuda.h lives (default /usr/local/cuda)

Each backend whose headers are missing is compiled out and reported unavailable by
wxfer.backends(); the libraries themselves are dlopened at run time.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def have_header(header, include_dirs=()):
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(cc):
        cc = "cc"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write("#include <%s>\nint main(void){return 0;}\n" % header)
        cmd = [cc, "-fsyntax-only", src] + ["-I" + i for i in include_dirs]
        return subprocess.call(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) == 0


define_macros = []
include_dirs = [os.path.join("csrc", "core")]
compiled_out = {}

if have_header("rdma/fabric.h"):
    define_macros.append(("WX_HAVE_FABRIC", "1"))
else:
    compiled_out["fabric"] = "libfabric headers (rdma/fabric.h) were missing at build time"
if have_header("infiniband/verbs.h"):
    define_macros.append(("WX_HAVE_VERBS", "1"))
else:
    compiled_out["verbs"] = "rdma-core headers (infiniband/verbs.h) were missing at build time"
cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
cuda_inc = os.path.join(cuda_home, "include")
if have_header("cuda.h", [cuda_inc]):
    define_macros.append(("WX_HAVE_CUDA", "1"))
    include_dirs.append(cuda_inc)
else:
    compiled_out["cuda_ipc"] = "CUDA headers (cuda.h) were missing at build time (CUDA_HOME=%s)" % cuda_home

for name, why in compiled_out.items():
    define_macros.append(("WX_OUT_" + name.upper(), '"%s"' % why.replace('"', "'")))
    print("wxfer: compiling out %s: %s" % (name, why), file=sys.stderr)

extra_compile_args = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                      "-Wno-missing-field-initializers", "-fvisibility=hidden"]
extra_link_args = ["-ldl", "-lpthread"]
if _flag("WXFER_DEBUG"):
    extra_compile_args += ["-O0", "-g3", "-UNDEBUG"]
else:
    extra_compile_args += ["-O2", "-g"]
if _flag("WXFER_SANITIZE"):
    san = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=undefined"]
    extra_compile_args += san + ["-O1", "-g"]
    extra_link_args += san
if _flag("WXFER_WERROR"):
    extra_compile_args.append("-Werror")

sources = sorted(glob.glob("csrc/core/*.c")) + sorted(glob.glob("csrc/py/*.c"))

setup(
    ext_modules=[
        Extension(
            "wxfer._wxfer",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            depends=sorted(glob.glob("csrc/core/*.h")) + sorted(glob.glob("csrc/py/*.h")),
        )
    ],
)
