"""Compile the native kernels against the TensorFlow that is imported, once per TensorFlow.

A library compiled for one TensorFlow must not be loaded by another (its C++ ABI and op
registry differ), so the library is looked for, and built, under a key of everything it
depends on: the TensorFlow version, its compile and link flags (they carry the ABI flag and
the library it links to), the Python version and the kernels' sources and headers.

1. :func:`library_path` names where the library for this key lives: next to the sources when
   that directory is writable (the checkout, or a site-packages an administrator installs
   into), else in a per-user cache, ``~/.cache/sparse_hvd/kernels/<key>/``;
   ``$SPARSE_HVD_KERNEL_CACHE``, when set, is used in either case;
2. :func:`ensure_built` compiles it there when it is missing (``g++``, the flags TensorFlow
   reports), under a file lock, so that the ranks of a job that start together build once
   and the others wait, and writes it atomically (a temporary file, then a rename);
3. after a TensorFlow upgrade the key changes: the old library is never loaded, a new one is
   built.

``python -m sparse_hvd.kernels.build`` builds it now (``scripts/setup.sh`` does), and prints
where it is.
"""

import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "_sparse_hvd_kernels.so"


class BuildError(RuntimeError):
    """The kernels could not be compiled (the compiler's output is in the message)."""


def sources():
    return sorted(glob.glob(os.path.join(HERE, "*.cc")))


def headers():
    """The headers the sources include (part of the key, not compiled on their own)."""
    return sorted(glob.glob(os.path.join(HERE, "*.h")))


def _flags():
    import tensorflow as tf

    return tf.__version__, tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags()


# our own compiler flags (-fno-math-errno: std::sqrt may then be vectorised; no kernel reads
# errno; -ffp-contract=off: no fused multiply-add, so that every version of a function gives
# the same bits, vectorised.h)
OWN_FLAGS = ("-shared", "-fPIC", "-O3", "-fno-math-errno", "-ffp-contract=off",
             "-Wno-deprecated-declarations", "-Wno-interference-size")


def build_key() -> str:
    """A short hash of the TensorFlow, its flags and ours, the Python, the sources and
    headers."""
    version, compile_flags, link_flags = _flags()
    digest = hashlib.sha256()
    for part in (version, *compile_flags, *link_flags, *OWN_FLAGS, sys.version,
                 sysconfig.get_platform()):
        digest.update(part.encode() + b"\0")
    for path in sources() + headers():
        with open(path, "rb") as f:
            digest.update(f.read())
    return f"tf{version}-{digest.hexdigest()[:16]}"


def library_path(key=None) -> str:
    """Where the library for this TensorFlow lives (or will be built)."""
    key = key or build_key()
    chosen = os.environ.get("SPARSE_HVD_KERNEL_CACHE")
    if chosen:
        return os.path.join(chosen, key, NAME)
    if os.access(HERE, os.W_OK):
        return os.path.join(HERE, "build", key, NAME)
    user_cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(user_cache, "sparse_hvd", "kernels", key, NAME)


def compile_library(output: str):
    """Compile the sources into ``output`` (atomically); BuildError with the compiler's words."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise BuildError("no C++ compiler (g++) found: install one, or set CXX")
    _, compile_flags, link_flags = _flags()
    directory = os.path.dirname(output)
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".so.tmp", dir=directory)
    os.close(handle)
    command = [compiler, *OWN_FLAGS, *compile_flags, *sources(), "-o", temporary, *link_flags]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        if os.path.exists(temporary):  # the compiler removes its output when it fails
            os.unlink(temporary)
        raise BuildError(f"compiling sparse_hvd's kernels failed ({' '.join(command[:3])} ...):\n"
                         f"{result.stderr[-4000:]}")
    os.replace(temporary, output)


def _to_stderr(message):
    from ..runtime import log

    log.info("%s", message)


def ensure_built(path=None, announce=_to_stderr) -> str:
    """The library's path, compiled first if it is missing (one build per machine at a time);
    ``announce`` says so before a build (on stderr by default)."""
    path = path or library_path()
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it: wait for it
        if not os.path.exists(path):
            announce(f"compiling the native kernels for this TensorFlow into {path} "
                     "(once; about a minute)")
            compile_library(path)
    return path


def main(argv=None):
    try:
        path = ensure_built(announce=lambda message: print(f"sparse_hvd: {message}", flush=True))
    except BuildError as error:
        print(error, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
