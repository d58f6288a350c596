#!/usr/bin/env bash
# What the host of a GPU machine gives a run (CPU quota, cores, who takes the CPU while the internode
# engine's 2-rank world runs), and the engine's host-time trace with NCCL's socket threads cut down:
# whether the host time measured on one GPU is the engine's or the machine's.
#   bash scripts/host_env_probe.sh OUTDIR
set -u
OUT=${1:-/tmp/host_env_probe}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  echo "nproc $(nproc)"; echo "cpu.max $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo n/a)"
  grep -m1 "model name" /proc/cpuinfo; grep -c ^processor /proc/cpuinfo
  for cfg in "" "NCCL_SOCKET_NTHREADS=1 NCCL_NSOCKS_PERTHREAD=1"; do
    echo "=== profile with: ${cfg:-defaults}"
    env $cfg $PY -m benchmarks.bench_internode --ranks 2 --ranks-per-node 1 --emulate-hosts --chunks 1 --iters 5 \
      --warmup 2 --profile > "$OUT/run.txt" 2>&1 &
    pid=$!
    sleep 25; echo "--- threads by CPU 25 s in"; top -b -H -n 1 -w 200 | head -32
    wait $pid
    grep -A16 "profile dispatch_bf16:" "$OUT/run.txt"; grep "host us behind" "$OUT/run.txt"
  done
  if [ -f /sys/fs/cgroup/cpu.stat ]; then echo "cpu.stat"; cat /sys/fs/cgroup/cpu.stat; fi
} 2>&1 | tee "$OUT/host_env_probe.log"
