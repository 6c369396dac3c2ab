#!/usr/bin/env bash
# Set up a fresh virtual environment and run the whole test suite (mypy and ruff included, and every benchmark
# script under scripts/bench in its --smoke mode: tests/test_bench_smoke.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip >/dev/null
.venv/bin/pip install -q -e ".[dev]"
# mlx's CPU wheel ships a reference BLAS; OpenBLAS makes tiny-model tests ~10x faster (same results).
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
if [ "$(uname -s)" = Linux ] && [ ! -e "$BLAS" ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) || true
fi
# The remote-tier tests (tests/test_remote.py) start real redis-server processes, and a Redis Cluster with redis-cli.
if [ "$(uname -s)" = Linux ] && ! command -v redis-server >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -q redis-server >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q redis-server >/dev/null 2>&1)) || true
fi
if [ -e "$BLAS" ]; then export LD_PRELOAD="$BLAS"; fi
exec .venv/bin/python -m pytest -q "$@"
