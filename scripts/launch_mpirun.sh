#!/usr/bin/env bash
# Launch a commlib program under Open MPI's mpirun: one node, or several with a hostfile.
#
#   one node, 4 ranks (CPU ranks on gloo without GPUs, one GPU each with them):
#       NP=4 scripts/launch_mpirun.sh
#   the CI check (4 CPU ranks as 2 emulated nodes x 2, every row verified):
#       NP=4 COMMLIB_RANKS_PER_NODE=2 scripts/launch_mpirun.sh -m benchmarks.alltoall_perf -b 32 -e 128 -n 3
#   several nodes, listed in a hostfile (see scripts/hostfile.example):
#       NP=16 HOSTFILE=scripts/hostfile.example scripts/launch_mpirun.sh -m benchmarks.alltoall_perf --fp8 --json
#
# Environment: NP (4), HOSTFILE (none: this machine), NPERNODE (ranks per node with a hostfile;
# default: the slots of each host), MASTER_ADDR (with a hostfile: its first host; the address
# rank 0 listens on for torch.distributed's rendezvous), MASTER_PORT, MPIRUN (mpirun),
# PYTHON (python). Arguments: -m module (or a script, *.py) and its arguments; with none,
# -m benchmarks.alltoall_perf. The checkout is put on PYTHONPATH, so modules resolve from anywhere.
#
# Flags added for you: --allow-run-as-root when run as root (Open MPI refuses root otherwise),
# --oversubscribe when NP exceeds this machine's cores (e.g. 4 ranks on a 2-core CI box),
# --bind-to none (ranks are GPU- or gloo-bound, not core-bound), -x for the variables below.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
MPIRUN="${MPIRUN:-mpirun}"
NP="${NP:-4}"
HOSTFILE="${HOSTFILE:-}"

export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

flags=(-np "${NP}" --bind-to none)
[[ "$(id -u)" -eq 0 ]] && flags+=(--allow-run-as-root)
if [[ -n "${HOSTFILE}" ]]; then
    flags+=(--hostfile "${HOSTFILE}")
    [[ -n "${NPERNODE:-}" ]] && flags+=(--map-by "ppr:${NPERNODE}:node")
    # Rank 0 runs on the first host; torch.distributed's rendezvous must listen on an address
    # the other nodes reach (127.0.0.1 only works on one machine).
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        MASTER_ADDR="$(grep -v '^[[:space:]]*#' "${HOSTFILE}" | awk 'NF {print $1; exit}')"
        export MASTER_ADDR
    fi
elif [[ "${NP}" -gt "$(nproc)" ]]; then
    flags+=(--oversubscribe)
fi

# Pass the launcher-independent settings to every rank (only those that are set).
for name in PATH LD_LIBRARY_PATH PYTHONPATH MASTER_ADDR MASTER_PORT OMP_NUM_THREADS \
            NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS \
            NCCL_DEBUG NCCL_SOCKET_IFNAME NCCL_IB_HCA GLOO_SOCKET_IFNAME CUDA_VISIBLE_DEVICES; do
    [[ -n "${!name:-}" ]] && flags+=(-x "${name}")
done
while IFS='=' read -r name _; do
    [[ "${name}" == COMMLIB_* ]] && flags+=(-x "${name}")
done < <(env)

if [[ $# -eq 0 || ( "$1" != *.py && "$1" != "-m" ) ]]; then
    set -- -m benchmarks.alltoall_perf "$@"
fi

set -x
exec "${MPIRUN}" "${flags[@]}" "${PYTHON}" "$@"
