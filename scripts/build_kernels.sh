#!/usr/bin/env bash
# Compiles sparse_hvd's native CPU kernels against the TensorFlow of the given Python (default:
# the project's .venv), unless a build for that TensorFlow exists (sparse_hvd.kernels.build).
# Usage: scripts/build_kernels.sh [PYTHON]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
cd "$ROOT"
TF_CPP_MIN_LOG_LEVEL=3 exec "$PY" -m sparse_hvd.kernels.build
