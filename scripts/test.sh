#!/usr/bin/env bash
# The test command (README quick start, and what CI runs): set up the venv, run the CPU suite.
# GPU tests under tests/gpu skip themselves without CUDA. Extra arguments go to pytest.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$(bash "$ROOT/scripts/setup_venv.sh")
cd "$ROOT"
exec "$PY" -m pytest -q -p no:cacheprovider "$@" tests
