#!/usr/bin/env bash
# One command for the GPU machine: install, compile, test and benchmark the NVLink engine.
#
#   bash scripts/gpu_check.sh OUTDIR
#
# Stages (each under a hard `timeout`, clamped to what is left of GPU_CHECK_BUDGET_S, so a hang can
# never eat the device lease): env (nvidia-smi topo, versions), compile (every kernel family, both
# load/store modes), smoke (2 ranks, one case), tests2 (2-rank world, every case), bench
# (python -m benchmarks.bench_intranode --json), shared (4 and 8 ranks on 2 GPUs), hier (the internode engine
# against the reference over NCCL, ranks as emulated hosts sharing the GPUs), fanout (the forwarder kernel over
# CUDA IPC, 2 and 4 processes on one GPU), hierworst (num_worst_tokens with a bad expert id: every rank stops on the
# device-side assert), inhost (its host time per call at 2 x 1, where a call is one chunk
# on one GPU), hostbuf (experiments/host_cost_buffer.py), timeout (device-timeout test),
# faults (fault injection: disagreeing ranks, signature mismatches, skipped/extra calls, a rank exiting),
# cpu (the CPU-side checks of tests/gpu), moegpu (the expert stage through grouped GEMMs against a float64 loop, the slot-sum kernel bit for bit),
# overlapab (benchmarks.bench_overlap with --sm-carveout off / auto for each argument set in OVERLAP_AB),
# overlapfb (2 GPUs: forward+backward on --preset network --ce-staging host, the split schedule against
# dual_forward_backward, BF16 at expert intermediate 2816 and FP8 dispatch at 2048 / 1536, the backward's
# carveout off, the sum on the compute stream; then the three phases with the compute-dense reference),
# neighbour (experiments.bench_gemm_carveout --neighbour), interference (experiments.bench_comm_interference),
# overlapce (benchmarks.bench_overlap balanced with the copy-engine path, COMMLIB_CE_BYTES, then with the SM kernels on
# 4 and on 20 SMs).
# tests2 and shared include the copy-engine cases (test_*_copy_engines).
# Everything is logged to OUTDIR/gpu_check.log; the bench JSON (+ PNG) lands in OUTDIR and
# benchmarks/results/.
#
# Subsets: GPU_CHECK_ONLY=all (default) | quick (compile, smoke, bench at 4096 tokens) | tests | bench | host | ce,
# or a comma list of stage names. BENCH_ARGS adds/overrides benchmark flags; BENCH_FLAGS replaces the
# default sweep flags (--plot --plain --sms ... --chunks ...).
# COMMLIB_TEST_CASES=a,b limits the 2-rank world to some cases (tests/gpu/nvlink_cases.py).
set -u
OUTDIR=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
cd "$(dirname "$0")/.."
REPO=$(pwd)

# NVLink multicast stays off in everything started here (it can take shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export COMMLIB_TIMEOUT_S=${COMMLIB_TIMEOUT_S:-20}
# The device gets the tree without .git: write `git rev-parse --short HEAD > .git_commit` before the
# run so the results record the commit they measured.
export COMMLIB_GIT_COMMIT=${COMMLIB_GIT_COMMIT:-$(cat .git_commit 2>/dev/null || true)}
PY=${PYTHON:-python3}
ONLY=${GPU_CHECK_ONLY:-all}
BUDGET=${GPU_CHECK_BUDGET_S:-520}
START=$(date +%s)
SUMMARY=()

case "$ONLY" in
  all) STAGES="env,compile,smoke,tests2,bench,shared,hier,timeout,faults,cpu" ;;
  quick) STAGES="env,compile,smoke,bench"; BENCH_ARGS="--tokens 4096 ${BENCH_ARGS:-}" ;;
  tests) STAGES="env,compile,smoke,tests2,shared,hier,timeout,faults,cpu,moegpu" ;;
  bench) STAGES="env,compile,bench" ;;
  final) STAGES="env,compile,smoke,main,a2a,long,overlap,tune" ;;
  next) STAGES="env,compile,hier,internode" ;;
  host) STAGES="env,compile,smoke,tests2,profile,bench,hier,internode" ;;
  ll) STAGES="env,compile,llgpu,llfault,lltrace,llbench" ;;   # low-latency mode: GPU tests, bad-id trap, benchmark
  ce) STAGES="env,compile,tests2,shared,moegpu,overlapce" ;;   # copy-engine path: every case, the pipeline A/B
  fb) STAGES="env,overlapfb" ;;   # two forwards then two backwards on the network hop: split vs joint schedule
  # the one-GPU kind after a change of layout: every GPU test world (ranks share the GPU where there is
  # one), the kernels from a non-editable wheel install, the main job
  onegpu) STAGES="env,compile,wheel,tests2,rings,deepep,llgpu,moegpu,timeout,faults,cpu,shared" ;;
  # the internode engine on one GPU (ranks as emulated hosts over NCCL): its GPU tests, host time per call
  internode1) STAGES="env,hier,inhost" ;;
  # the same plus what the engine's host time is made of (host time of each torch / NCCL primitive)
  host1) STAGES="env,hostcost,hier,inhost" ;;
  # the forwarder kernel (csrc/fanout.cu) alone, then the internode engine with it (2 x 2 on one GPU)
  fan1) STAGES="env,fanout,hier,inhost,inhost4" ;;
  # the internode engine's closing run on one GPU: kernel, benches first, then the worlds (1,000 routings)
  final1) STAGES="env,fanout,inhost,inhost4,hierworst,hier" ;;
  # the two-GPU kind (nvidia-h200-x2), 2 nodes x 1: the internode targets over NCCL's NVLink and socket
  # transports against the flat all-to-all (bench_internode prints each target met / NOT met), then the
  # device worlds with the ranks on their own GPUs
  x2internode) STAGES="env,internode,internodesock,fanout,hier" ;;
  # the internode engine's per-token kernels (csrc/internode.cu) on one GPU: the device worlds against the
  # reference, host time per call with the kernels and with the torch steps, planted bugs caught, 2 x 2
  kern1) STAGES="env,compile,hier,inhost,inplant,inhost4" ;;
  # the same kernels: planted bugs, then where a call's host time goes (step by step, rank 0)
  kern2) STAGES="env,compile,inplant,inprofile" ;;
  kern3) STAGES="env,compile,hier,inhost,inprofile,inplant,inhost4" ;;   # kern1 + kern2
  *) STAGES="$ONLY" ;;
esac
want() { [[ ",$STAGES," == *",$1,"* ]]; }
# H200x1: the GPU model and how many there are (result file names: docs/results.md)
gpu_tag() { $PY -c "import torch; from commlib.bench.results import gpu_short_name as g; print(f'{g(torch.cuda.get_device_name(0))}x{torch.cuda.device_count()}')"; }

log() { echo "$@" | tee -a "$LOG"; }

# stage NAME TIMEOUT_S CMD...: run CMD under timeout (clamped to the remaining budget), log it.
stage() {
  local name=$1 limit=$2; shift 2
  want "$name" || return 0
  local now left t0 rc
  now=$(date +%s); left=$((BUDGET - (now - START)))
  if (( left < 15 )); then SUMMARY+=("$name: SKIPPED (budget spent)"); log "[gpu_check] skip $name: budget spent"; return 0; fi
  (( limit > left )) && limit=$left
  log "[gpu_check] === $name (timeout ${limit}s) $(date +%T): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  if (( rc == 0 )); then SUMMARY+=("$name: ok (${dt}s)"); elif (( rc == 124 || rc == 137 )); then
    SUMMARY+=("$name: TIMEOUT after ${dt}s"); else SUMMARY+=("$name: FAILED rc=$rc (${dt}s)"); fi
  return 0
}

env_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  $PY - <<'EOF'
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count())
try:
    import cupy
    print("cupy", cupy.__version__, "nvrtc", cupy.cuda.nvrtc.getVersion())
except Exception as e:
    print("cupy missing:", e)
EOF
  $PY -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 && echo "pip install -e . ok" \
    || echo "pip install -e . failed (using PYTHONPATH=$REPO)"
}

compile_kernels() {
  $PY - <<'EOF'
import time, torch
from commlib.cuda import loader as kernels
torch.cuda.init()
for plain in (False, True):
    t0 = time.perf_counter()
    kernels.compile_all(plain)
    print(f"[compile] plain={plain}: {len(kernels.FAMILIES)} families in {time.perf_counter() - t0:.2f} s")
EOF
}


# A wheel built from this tree, installed (not editable) into its own folder and imported from
# outside the checkout: the kernels must compile from the package data and the main job must pass.
wheel_check() {
  local W=/tmp/cl_wheel S=/tmp/cl_site
  rm -rf "$W" "$S"; mkdir -p "$W"
  $PY -m pip wheel --no-deps --no-build-isolation -q -w "$W" . || return 1
  $PY -m pip install -q --no-deps --no-compile --target "$S" "$W"/commlib-*.whl || return 1
  (cd /tmp && PYTHONPATH="$S" $PY -c "import commlib, commlib.cuda.loader as L; print('[wheel]', commlib.__file__, L.CSRC); assert str(L.CSRC).startswith('$S')" &&
   PYTHONPATH="$S" $PY -m commlib.bench --ranks 2 --tokens 1024 --iters 3 --warmup 1 --json "$W/results")
}
export -f env_info compile_kernels wheel_check
export PY
stage env 60 bash -c env_info
stage compile 90 bash -c compile_kernels
stage wheel 200 bash -c wheel_check
stage smoke 90 env COMMLIB_TEST_CASES=smoke $PY -m pytest tests/gpu/test_nvlink.py -x -q -k "two_ranks" -p no:cacheprovider
stage tests2 200 $PY -m pytest tests/gpu/test_nvlink.py -q -s -k "two_ranks" -p no:cacheprovider
# host time per call, fast launch path vs CuPy's (COMMLIB_FAST_LAUNCH=0)
stage profile 90 $PY -m benchmarks.profile_host --fp8 --calls 300
stage profile 90 env COMMLIB_FAST_LAUNCH=0 $PY -m benchmarks.profile_host --fp8 --calls 300
stage bench 200 $PY -m benchmarks.bench_intranode --json "$OUTDIR" ${BENCH_FLAGS:---plot --plain --sms 8,12,16,24,32 --chunks 64,128} ${BENCH_ARGS:-}
# the same world under other kernel builds (space-separated KEY=V,KEY=V lists), to qualify them; by
# default the kept non-default paths: plain CTAs, no work sharing, and the trace
want tests2 && for v in ${GPU_CHECK_TEST_VARIANTS-COMM_CLUSTER=1 SHARE_WORK=0 COMM_TRACE=1}; do
  stage tests2 120 env COMMLIB_TEST_KERNEL_VARIANT="$v" $PY -m pytest tests/gpu/test_nvlink.py -q -k "two_ranks" -p no:cacheprovider
  SUMMARY[-1]="${SUMMARY[-1]} [variant $v]"
done
stage shared 150 $PY -m pytest tests/gpu/test_nvlink.py -x -q -k "shared_gpus" -p no:cacheprovider
stage fanout 240 $PY -m pytest tests/gpu/test_fanout_gpu.py -x -q -p no:cacheprovider
stage hierworst 120 $PY -m pytest tests/gpu/test_internode_gpu.py -x -q -p no:cacheprovider -k worst_mode
stage hier 420 $PY -m pytest tests/gpu/test_internode_gpu.py -x -q -p no:cacheprovider -k "not worst_mode"
stage timeout 90 $PY -m pytest tests/gpu/test_nvlink.py -x -q -k "device_timeout" -p no:cacheprovider
# fault injection: disagreeing ranks (one world), traps / timeouts (one short world each; logs in OUTDIR/faults)
stage faults 150 env COMMLIB_FAULT_LOG_DIR="$OUTDIR/faults" $PY -m pytest tests/gpu/test_gpu_reliability.py -q -s -k "not long_run" -p no:cacheprovider
stage cpu 60 $PY -m pytest tests/gpu/test_nvlink.py -x -q -k "imports or assemble or nvrtc" -p no:cacheprovider
stage rings 200 $PY -m pytest tests/gpu/test_nvlink.py -q -k "rings" -p no:cacheprovider
stage deepep 200 $PY -m pytest tests/gpu/test_deep_ep_gpu.py -x -q -p no:cacheprovider
stage llgpu 150 $PY -m pytest tests/gpu/test_low_latency_gpu.py -x -q -s -p no:cacheprovider
stage moegpu 90 $PY -m pytest tests/gpu/test_moe_gpu.py -x -q -p no:cacheprovider
stage llfault 60 env COMMLIB_FAULT_LOG_DIR="$OUTDIR/faults" $PY -m pytest tests/gpu/test_gpu_reliability.py -q -s -k "ll_bad_expert_id" -p no:cacheprovider
stage lltrace 120 $PY -m benchmarks.bench_low_latency --trace --iters 20

# Whole-library stages: the main job, the mpirun sweep (+ plot), the 10k-round long run, the dual
# pipeline and the tuner; their JSON/PNG go to OUTDIR/results (packed into results.tar.gz).
RES=${RESULTS_DIR:-/tmp/commlib_results}; rm -rf "$RES"; mkdir -p "$RES"
stage main 120 $PY -m commlib.bench --json "$RES"
stage a2a 150 env NP=2 PYTHON=$PY bash scripts/launch_mpirun.sh -m benchmarks.alltoall_perf -b 512 -e 8K -f 2 --fp8 --json "$RES"
stage plot 60 $PY -m benchmarks.plot "$RES"/alltoall_perf_*.json --out "$RES"
stage long 200 env COMMLIB_TEST_LONG_ROUNDS=${LONG_ROUNDS:-10000} $PY -m pytest tests/gpu/test_gpu_reliability.py -q -s -k long_run -p no:cacheprovider
stage overlap 180 $PY -m benchmarks.bench_overlap --preset balanced_sms --tokens 8192 --tag H200_balanced_sms_8192 --out-dir "$RES"
stage overlap 180 $PY -m benchmarks.bench_overlap --preset balanced_fb --out-dir "$RES"
stage overlap 150 $PY -m benchmarks.bench_overlap --preset balanced --out-dir "$RES"
stage overlapce 150 env COMMLIB_CE_BYTES=$((600 << 20)) $PY -m benchmarks.bench_overlap --preset balanced --tokens 16384 --layers 3 --comm-sms 4 --tag H200_balanced_ce --out-dir "$RES"
stage overlapce 150 $PY -m benchmarks.bench_overlap --preset balanced --tokens 16384 --layers 3 --comm-sms 4 --tag H200_balanced_sm4 --out-dir "$RES"
stage overlapce 150 $PY -m benchmarks.bench_overlap --preset balanced --tokens 16384 --layers 3 --comm-sms 20 --tag H200_balanced_sm20 --out-dir "$RES"
stage overlap 120 $PY -m benchmarks.bench_overlap --preset v3 --out-dir "$RES"
# overlapab: the dual pipeline with and without the SM carveout, back to back, for each ';'-separated
# argument set in OVERLAP_AB (each run tagged by its position and carveout).
IFS=';' read -r -a AB_SETS <<<"${OVERLAP_AB:---preset balanced --tokens 16384 --layers 3 --comm-sms 4}"
for i in "${!AB_SETS[@]}"; do
  for cv in ${OVERLAP_AB_CARVEOUTS:-off auto}; do
    stage overlapab ${OVERLAP_AB_TIMEOUT:-150} $PY -m benchmarks.bench_overlap ${AB_SETS[$i]} --sm-carveout "$cv" \
      --tag "H200_ab${i}_cv${cv}" --out-dir "$RES"
  done
done
# overlapfb: the forward+backward phase alone (~45 s a run), then every phase with the dense reference
FB="$PY -m benchmarks.bench_overlap --preset network --ce-staging host --comm-sms 4 --layers 6 --out-dir $RES"
C=${COMMLIB_GIT_COMMIT:-local}
for args in "--expert-hidden 2816 --fb-schedule split:i2816_split" "--expert-hidden 2816 --fb-schedule joint:i2816_joint" \
            "--expert-hidden 2816 --fb-schedule joint --sm-carveout-backward off:i2816_joint_bco" \
            "--expert-hidden 2816 --fb-schedule joint --sm-carveout-backward off --ce-defer-sum:i2816_joint_bco_ds" \
            "--fp8 --expert-hidden 2048 --fb-schedule split:fp8_i2048_split" \
            "--fp8 --expert-hidden 2048 --fb-schedule joint:fp8_i2048_joint" \
            "--fp8 --expert-hidden 1536 --fb-schedule joint:fp8_i1536_joint"; do
  stage overlapfb 100 $FB --iters 8 --no-dense --no-plot --phases forward_backward ${args%%:*} \
    --tag "NVIDIA_H200_network_s4_fb_${args##*:}_$C"
done
stage overlapfb 200 $FB --iters 10 --expert-hidden 2816 --tag "NVIDIA_H200_network_i2816_s4_$C"
# what the comm kernels' neighbours cost: GEMMs beside plain vs clustered comm CTAs; comm beside each load
stage neighbour 90 $PY -m experiments.bench_gemm_carveout --neighbour 4,12 --json "$RES/gemm_neighbour.json"
stage interference 150 $PY -m experiments.bench_comm_interference --json "$RES/comm_interference.json"
stage tune 200 $PY -m benchmarks.bench_tune ${TUNE_ARGS:-} --json "$RES"
stage internode 150 $PY -m benchmarks.bench_internode --chunks 1,2,4,8 --json "$RES"
# the same over NCCL's socket transport (each rank its own NCCL_HOSTID; on 2 GPUs each rank keeps its GPU)
stage internodesock 150 $PY -m benchmarks.bench_internode --chunks 1,2,4,8 --emulate-hosts \
  --json "$RES/bench_internode_socket_$(gpu_tag)_$(date +%Y%m%d)_${COMMLIB_GIT_COMMIT:-unknown}.json"
# one GPU: 2 processes as 2 emulated hosts over NCCL's socket transport; host time per call and K (device times
# are time-sliced, not meaningful); V3 rows at 4096 tokens, chunk caps 1..8
stage inhost 200 $PY -m benchmarks.bench_internode --ranks 2 --ranks-per-node 1 --emulate-hosts --chunks ${INHOST_CHUNKS:-1} \
  --iters 10 --warmup 3 --torch-steps --json "$OUTDIR"
stage inprofile 200 $PY -m benchmarks.bench_internode --ranks 2 --ranks-per-node 1 --emulate-hosts --chunks 1 \
  --iters 10 --warmup 3 --profile
# planted bugs in csrc/internode.cu, each must fail the device test that exists for it
stage inplant 200 bash scripts/plant_internode_kernels.sh
# one GPU or more: host time of each primitive the internode engine is made of (experiments/host_cost_nccl.py)
stage hostcost 120 $PY -m experiments.host_cost_nccl --ranks 2 --json "$OUTDIR"
# one process: the host time of a Buffer call's own share and of the engine's torch / launch primitives
stage hostbuf 120 $PY -m experiments.host_cost_buffer --json "$OUTDIR"
# the same as 2 nodes x 2 (4 processes on one GPU): the forwarder kernel's path, host time per call
stage inhost4 200 $PY -m benchmarks.bench_internode --ranks 4 --ranks-per-node 2 --emulate-hosts --chunks 1,4 \
  --iters 5 --warmup 2 --torch-steps --json "$OUTDIR/bench_internode_2x2_$(gpu_tag)_$(date +%Y%m%d)_${COMMLIB_GIT_COMMIT:-unknown}.json"
stage llbench 120 $PY -m benchmarks.bench_low_latency --json "$RES"
if ls "$RES"/* >/dev/null 2>&1; then tar -czf "$OUTDIR/results.tar.gz" -C "$RES" . && log "[gpu_check] packed $(ls "$RES" | wc -l) result files"; fi

# keep a copy of the benchmark JSON with the repository's results
if want bench; then
  mkdir -p benchmarks/results
  for f in "$OUTDIR"/bench_intranode_*.json "$OUTDIR"/bench_intranode_*.png; do
    [ -f "$f" ] && cp "$f" benchmarks/results/ && log "[gpu_check] copied $(basename "$f") to benchmarks/results/"
  done
fi

log "[gpu_check] ===== summary ($(( $(date +%s) - START ))s of ${BUDGET}s budget)"
for s in "${SUMMARY[@]}"; do log "  $s"; done
if want bench; then grep -E "^#? +(dispatch|combine)|\[target\]|\[layout\]|\[host\]|^#   +(dispatch|combine)|^#  +op" "$LOG" | tail -80; fi
