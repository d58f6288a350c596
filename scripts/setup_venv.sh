#!/usr/bin/env bash
# Creates (once) the project virtualenv and installs commlib into it; prints the venv's python.
# Reuses a torch that the system already has (the GPU machines ship one), else installs the
# CPU build pinned below. COMMLIB_VENV moves the venv.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${COMMLIB_VENV:-$ROOT/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV" >&2
fi
PY=$VENV/bin/python
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0" >&2
fi
"$PY" -m pip install -q -e "$ROOT[test,mpi]" >&2
echo "$PY"
