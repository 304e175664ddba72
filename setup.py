"""Build the private extension wxfer._wxfer (plain setuptools, C only).

Build switches (environment variables):
  WXFER_DEBUG=1     -O0 -g, assertions on
  WXFER_SANITIZE=1  AddressSanitizer + UndefinedBehaviorSanitizer (run with
                    LD_PRELOAD of libasan and PYTHONMALLOC=malloc; see `make asan-test`)
  WXFER_WERROR=1    warnings are errors
  WXFER_TESTING=1   compile in the fault-injection options the tests use (_test_refuse_peer,
                    _test_rkey_xor, _test_raddr_add; wxfer._wxfer.TESTING is then 1). `make
                    build` / `make test` set it; a wheel or `pip install` never does.
  CUDA_HOME         where cuda.h lives (default /usr/local/cuda)

Each backend whose headers are missing is compiled out and reported unavailable by
wxfer.backends(); the libraries themselves are dlopened at run time.
"""
import glob
import os
import re
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


# The native parts, one folder each (csrc/backends/<name>/ per transport); csrc/testing
# (the libibverbs emulation) is built by the tests, never into the extension.
NATIVE_DIRS = ["csrc/core", "csrc/transport", "csrc/engine",
               *sorted(glob.glob("csrc/backends/*")), "csrc/py"]


def backends():
    """(name, NAME, SWITCH, header) for each line of csrc/transport/wx_backends.def."""
    pat = re.compile(r'^WX_BACKEND\((\w+),\s*(\w+),\s*\d+,\s*(\w+),\s*"([^"]+)"\)', re.M)
    with open(os.path.join(HERE, "csrc", "transport", "wx_backends.def")) as f:
        return pat.findall(f.read())


define_macros = []
include_dirs = list(NATIVE_DIRS)
compiled_out = {}
cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
cuda_inc = os.path.join(cuda_home, "include")
have = {}
for name, upper, switch, header in backends():
    extra = [cuda_inc] if header == "cuda.h" else []
    if switch not in have:
        have[switch] = have_header(header, extra)
        if have[switch]:
            define_macros.append(("WX_HAVE_" + switch, "1"))
            include_dirs += extra
    if have[switch]:
        define_macros.append(("WX_OUT_" + upper, '""'))
    else:
        why = "%s was missing at build time" % header
        if header == "cuda.h":
            why += " (CUDA_HOME=%s)" % cuda_home
        compiled_out[name] = why
        define_macros.append(("WX_OUT_" + upper, '"%s"' % why.replace('"', "'")))
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
if _flag("WXFER_TESTING"):
    define_macros.append(("WX_TESTING", "1"))
if _flag("WXFER_WERROR"):
    extra_compile_args.append("-Werror")

sources = [c for d in NATIVE_DIRS for c in sorted(glob.glob(os.path.join(d, "*.c")))]

setup(
    ext_modules=[
        Extension(
            "wxfer._wxfer",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            depends=[h for d in NATIVE_DIRS for h in sorted(glob.glob(os.path.join(d, "*.h")))]
            + ["csrc/transport/wx_backends.def"],
        )
    ],
)
