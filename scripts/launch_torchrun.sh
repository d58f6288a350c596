#!/usr/bin/env bash
# Launch a commlib program under torchrun: one node, or several (run this once on every node).
#
#   one node, one rank per GPU (or 4 CPU ranks without GPUs), the bandwidth benchmark:
#       scripts/launch_torchrun.sh
#   one node, your own arguments:
#       NPROC_PER_NODE=8 scripts/launch_torchrun.sh -m benchmarks.alltoall_perf -b 128 -e 4K -f 2 --fp8 --json
#   two nodes x 8 GPUs (same command on both, NODE_RANK differs; MASTER_ADDR = node 0's address):
#       NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/launch_torchrun.sh   # on node 0
#       NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/launch_torchrun.sh   # on node 1
#   emulate 2 nodes x 2 on one machine (CPU or GPU): the topology is data, see docs/launch.md
#       NPROC_PER_NODE=4 COMMLIB_RANKS_PER_NODE=2 scripts/launch_torchrun.sh
#
# Environment: NNODES (1), NODE_RANK (0), NPROC_PER_NODE (GPUs, else 4), MASTER_ADDR (127.0.0.1),
# MASTER_PORT (29500), PYTHON (python). Arguments: -m module (or a script, *.py), then its
# arguments; with none, -m benchmarks.alltoall_perf. Every COMMLIB_* variable is passed through.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    [[ "${NPROC_PER_NODE}" -gt 0 ]] || NPROC_PER_NODE=4
fi

# NVLink multicast stays off (it can take shared GPUs down); one OpenMP thread per rank.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

if [[ $# -eq 0 || ( "$1" != *.py && "$1" != "-m" ) ]]; then
    set -- -m benchmarks.alltoall_perf "$@"
fi

set -x
exec "${PYTHON}" -m torch.distributed.run \
    --nnodes "${NNODES}" --node-rank "${NODE_RANK}" --nproc-per-node "${NPROC_PER_NODE}" \
    --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}" \
    "$@"
