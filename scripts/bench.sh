#!/usr/bin/env bash
# The main job (README quick start): set up the venv, run `python -m commlib.bench`:
# one rank per GPU when GPUs are present, otherwise 4 CPU ranks as 2 emulated nodes x 2.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$(bash "$ROOT/scripts/setup_venv.sh")
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$ROOT"
exec "$PY" -m commlib.bench "$@"
