#!/usr/bin/env bash
# The GPU machine's checks: one table of stages, grouped by engine, each run under a hard `timeout`.
#
#   bash scripts/gpu_check.sh OUTDIR                            # the `quick` preset
#   GPU_CHECK_ONLY=internode bash scripts/gpu_check.sh OUTDIR   # a preset, a group, or stage names:
#   GPU_CHECK_ONLY=compile,inworlds,llgpu bash scripts/gpu_check.sh OUTDIR
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh OUTDIR            # print each stage's command, run nothing
#   GPU_CHECK_EXTRA='name | group | ranks | timeout | command'   # a stage for this run only
#
# Presets: quick (one short check per engine), nvlink, internode, ll, training, peers (env and compile,
# then that group's stages), setup, all (every stage, in table order, until the budget is spent).
# A stage whose ranks exceed the GPU count runs under CUDA MPS (one daemon for the run, its pipe and
# log folders under /tmp, stopped on exit): its ranks share a GPU concurrently, and device times there
# are HBM loopback, never NVLink (docs/launch.md). GPU_CHECK_MPS=0: time-slice instead.
# Every stage's output goes to OUTDIR/logs/<stage>.log and OUTDIR/gpu_check.log; benchmark JSON to
# OUTDIR/results; the summary to OUTDIR/gpu_check.json. Each timeout is clamped to what is left of
# GPU_CHECK_BUDGET_S (default 520), so a hang never eats the device lease. BENCH_ARGS / BENCH_FLAGS
# add to / replace bench's sweep flags; COMMLIB_TEST_CASES=a,b limits the 2-rank world's cases.
# Measurement sweeps that are not checks are commands in experiments/README.md.
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
[[ $OUT == /* ]] || OUT="$PWD/$OUT"   # the output folder is the caller's, not the checkout's
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=${GPU_CHECK_DRY:-0}
ONLY=${GPU_CHECK_ONLY:-quick}
BUDGET=${GPU_CHECK_BUDGET_S:-520}
PY=${PYTHON:-python3}
RES="$OUT/results"

# NVLink multicast stays off in everything started here (it can take shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export COMMLIB_TIMEOUT_S=${COMMLIB_TIMEOUT_S:-20}
# The device gets the tree without .git: write `git rev-parse --short HEAD > .git_commit` before the
# run so the results record the commit they measured.
export COMMLIB_GIT_COMMIT=${COMMLIB_GIT_COMMIT:-$(cat .git_commit 2>/dev/null || true)}
C=${COMMLIB_GIT_COMMIT:-local}

# One line per stage: name | group | ranks (processes it starts; more than GPUs: MPS) | timeout s | command.
# Ranks written Nt: time-sliced even then (its kernels cannot all be resident at once under MPS:
# ranks x num_sms beyond the GPU's SMs, docs/launch.md), correctness only.
# The command is expanded when the stage runs ($PY, $OUT, $RES, $(gpu_tag), ${VAR:-default}).
# To add a stage: add its line; GPU_CHECK_ONLY=<name> runs it, and its group's preset picks it up.
STAGES='
env          | setup     | 0 |  60 | bash -c env_info
compile      | setup     | 1 | 150 | bash -c compile_kernels
cpusib       | setup     | 0 |  60 | $PY -m benchmarks.cpu_siblings --json $RES
wheel        | setup     | 2 | 200 | bash -c wheel_check
cpu          | setup     | 0 |  60 | $PY -m pytest tests/gpu/test_nvlink.py -x -q -p no:cacheprovider -k "imports or assemble or nvrtc"
smoke        | nvlink    | 2 |  90 | env COMMLIB_TEST_CASES=smoke $PY -m pytest tests/gpu/test_nvlink.py -x -q -p no:cacheprovider -k two_ranks
tests2       | nvlink    | 2 | 200 | $PY -m pytest tests/gpu/test_nvlink.py -q -s -p no:cacheprovider -k two_ranks
tests2plain  | nvlink    | 2 | 120 | env COMMLIB_TEST_KERNEL_VARIANT=COMM_CLUSTER=1 $PY -m pytest tests/gpu/test_nvlink.py -q -p no:cacheprovider -k two_ranks
tests2noshare| nvlink    | 2 | 120 | env COMMLIB_TEST_KERNEL_VARIANT=SHARE_WORK=0 $PY -m pytest tests/gpu/test_nvlink.py -q -p no:cacheprovider -k two_ranks
tests2half   | nvlink    | 2 | 120 | env COMMLIB_TEST_KERNEL_VARIANT=DISPATCH_THREADS=512,COMBINE_THREADS=512,DISPATCH_MIN_BLOCKS=2,COMBINE_MIN_BLOCKS=2 $PY -m pytest tests/gpu/test_nvlink.py -q -p no:cacheprovider -k two_ranks
tests2trace  | nvlink    | 2 | 120 | env COMMLIB_TEST_KERNEL_VARIANT=COMM_TRACE=1 $PY -m pytest tests/gpu/test_nvlink.py -q -p no:cacheprovider -k two_ranks
tests2py     | nvlink    | 2 | 200 | env COMMLIB_CALLPATH=python $PY -m pytest tests/gpu/test_nvlink.py -q -p no:cacheprovider -k "two_ranks and not callpath"
callpath     | nvlink    | 2 | 150 | env COMMLIB_CALLPATH=cpp COMMLIB_TEST_CASES=callpath,replays,options,bad_ids,rejected_input,cuda_graph $PY -m pytest tests/gpu/test_nvlink.py -x -q -p no:cacheprovider -k two_ranks
cpplant      | nvlink    | 2 | 360 | env PY=$PY bash scripts/plant_callpath.sh
shared       | nvlink    | 8 | 150 | $PY -m pytest tests/gpu/test_nvlink.py -x -q -p no:cacheprovider -k shared_gpus
rings        | nvlink    | 2 | 200 | $PY -m pytest tests/gpu/test_nvlink.py -q -p no:cacheprovider -k rings
timeout      | nvlink    | 2 |  90 | $PY -m pytest tests/gpu/test_nvlink.py -x -q -p no:cacheprovider -k device_timeout
faults       | nvlink    | 2 | 150 | env COMMLIB_FAULT_LOG_DIR=$OUT/faults $PY -m pytest tests/gpu/test_gpu_reliability.py -q -s -p no:cacheprovider -k "not long_run"
long         | nvlink    | 2 | 200 | env COMMLIB_TEST_LONG_ROUNDS=${LONG_ROUNDS:-10000} $PY -m pytest tests/gpu/test_gpu_reliability.py -q -s -p no:cacheprovider -k long_run
profile      | nvlink    | 2 |  90 | $PY -m benchmarks.profile_host --fp8 --calls 300
profilecupy  | nvlink    | 2 |  90 | env COMMLIB_FAST_LAUNCH=0 $PY -m benchmarks.profile_host --fp8 --calls 300
bench        | nvlink    | 2 | 200 | $PY -m benchmarks.bench_intranode --json $RES ${BENCH_FLAGS:---plot --plain --sms 8,12,16,24,32 --chunks 64,128} ${BENCH_ARGS:-}
main         | nvlink    | 2 | 120 | $PY -m commlib.bench --json $RES
a2a          | nvlink    | 2 | 150 | env NP=2 PYTHON=$PY bash scripts/launch_mpirun.sh -m benchmarks.alltoall_perf -b 512 -e 8K -f 2 --fp8 --json $RES
a2aplot      | nvlink    | 0 |  60 | $PY -m benchmarks.plot $RES/alltoall_perf_*.json --out $RES
tune         | nvlink    | 2 | 200 | $PY -m benchmarks.bench_tune ${TUNE_ARGS:-} --json $RES
host         | nvlink    | 2 | 150 | $PY -m benchmarks.bench_host --world 1,2 --repeat 3 --json $RES
fanout       | internode | 4 | 240 | $PY -m pytest tests/gpu/test_fanout_gpu.py -x -q -p no:cacheprovider
fanwin       | internode | 4 | 150 | env COMMLIB_TEST_CASES=forward_windows $PY -m pytest tests/gpu/test_fanout_gpu.py -x -q -p no:cacheprovider
fanplant     | internode | 2 | 240 | env PY=$PY bash scripts/plant_fanout_windows.sh
fansync      | internode | 2 | 240 | env PY=$PY bash scripts/plant_fanout_sync.sh
inworst      | internode | 2 | 120 | $PY -m pytest tests/gpu/test_internode_gpu.py -x -q -p no:cacheprovider -k worst_mode
inworlds     | internode | 4 | 420 | $PY -m pytest tests/gpu/test_internode_gpu.py -x -q -p no:cacheprovider -k "not worst_mode and not worst_windows"
inwin        | internode | 4 | 240 | $PY -m pytest tests/gpu/test_internode_gpu.py -x -q -p no:cacheprovider -k worst_windows
incpp        | internode | 4 | 420 | env COMMLIB_CALLPATH=cpp COMMLIB_TEST_CASES=callpath,callpath_dispatch $PY -m pytest tests/gpu/test_internode_gpu.py -x -q -p no:cacheprovider -k "not worst_mode and not worst_windows"
inplant      | internode | 2 | 200 | env PY=$PY bash scripts/plant_internode_kernels.sh
inplantcpp   | internode | 4 | 400 | env PY=$PY bash scripts/plant_callpath_internode.sh
inalloc      | internode | 4 | 240 | env PY=$PY bash scripts/plant_alloc.sh internode
inhost       | internode | 2 | 150 | $PY -m benchmarks.bench_internode --host --ranks 2 --ranks-per-node 1 --emulate-hosts --chunks 1 --iters 20 --warmup 3 --json $RES/bench_internode_host_2x1_$(gpu_tag)_$(date +%Y%m%d)_$C.json
inhostpin    | internode | 2 | 150 | $PY -m benchmarks.bench_internode --host --ranks 2 --ranks-per-node 1 --emulate-hosts --chunks 1 --iters 20 --warmup 3 --pin --json $RES/bench_internode_host_2x1_pin_$(gpu_tag)_$(date +%Y%m%d)_$C.json
inhost4      | internode | 4 | 200 | $PY -m benchmarks.bench_internode --host --ranks 4 --ranks-per-node 2 --emulate-hosts --chunks 1,4 --iters 10 --warmup 2 --json $RES/bench_internode_host_2x2_$(gpu_tag)_$(date +%Y%m%d)_$C.json
inprofile    | internode | 2 | 200 | $PY -m benchmarks.bench_internode --ranks 2 --ranks-per-node 1 --emulate-hosts --chunks 1 --iters 10 --warmup 3 --profile
inbench      | internode | 2 | 150 | $PY -m benchmarks.bench_internode --chunks 1,2,4,8 --json $RES
inbenchsock  | internode | 2 | 150 | $PY -m benchmarks.bench_internode --chunks 1,2,4,8 --emulate-hosts --json $RES/bench_internode_socket_$(gpu_tag)_$(date +%Y%m%d)_$C.json
llgpu        | ll        | 4 | 150 | $PY -m pytest tests/gpu/test_low_latency_gpu.py -x -q -s -p no:cacheprovider
llplant      | ll        | 2 | 240 | env PY=$PY bash scripts/plant_alloc.sh ll
llfault      | ll        | 2 |  60 | env COMMLIB_FAULT_LOG_DIR=$OUT/faults $PY -m pytest tests/gpu/test_gpu_reliability.py -q -s -p no:cacheprovider -k ll_bad_expert_id
lltrace      | ll        | 2 | 120 | $PY -m benchmarks.bench_low_latency --trace --iters 20
llbench      | ll        | 2 | 120 | $PY -m benchmarks.bench_low_latency --json $RES
moegpu       | training  | 1 |  90 | $PY -m pytest tests/gpu/test_moe_gpu.py -x -q -p no:cacheprovider
compilegpu   | training  | 2 | 400 | $PY -m pytest tests/gpu/test_compile_gpu.py -x -q -s -p no:cacheprovider -k "not internode"
compilein    | training  | 2 | 200 | $PY -m pytest tests/gpu/test_compile_gpu.py -x -q -s -p no:cacheprovider -k internode
overlap      | training  | 2 | 150 | $PY -m benchmarks.bench_overlap --preset balanced --out-dir $RES
overlapsms   | training  | 2 | 180 | $PY -m benchmarks.bench_overlap --preset balanced_sms --tokens 8192 --tag H200_balanced_sms_8192 --out-dir $RES
overlapfb    | training  | 2 | 180 | $PY -m benchmarks.bench_overlap --preset balanced_fb --out-dir $RES
overlapv3    | training  | 2 | 120 | $PY -m benchmarks.bench_overlap --preset v3 --out-dir $RES
overlapce    | training  | 2 | 150 | env COMMLIB_CE_BYTES=629145600 $PY -m benchmarks.bench_overlap --preset balanced --tokens 16384 --layers 3 --comm-sms 4 --tag H200_balanced_ce --out-dir $RES
overlapsm4   | training  | 2 | 150 | $PY -m benchmarks.bench_overlap --preset balanced --tokens 16384 --layers 3 --comm-sms 4 --tag H200_balanced_sm4 --out-dir $RES
overlapsm20  | training  | 2 | 150 | $PY -m benchmarks.bench_overlap --preset balanced --tokens 16384 --layers 3 --comm-sms 20 --tag H200_balanced_sm20 --out-dir $RES
overlapnet   | training  | 2 | 200 | $PY -m benchmarks.bench_overlap --preset network --ce-staging host --comm-sms 4 --layers 6 --iters 10 --expert-hidden 2816 --tag NVIDIA_H200_network_i2816_s4_$C --out-dir $RES
deepep       | peers     | 4 | 200 | $PY -m pytest tests/gpu/test_deep_ep_gpu.py -x -q -p no:cacheprovider
knames       | peers     | 2 | 120 | $PY -m pytest tests/gpu/test_kernel_names_gpu.py -x -q -p no:cacheprovider
defdev       | peers     | 4 | 200 | $PY -m pytest tests/gpu/test_default_device_gpu.py -x -q -p no:cacheprovider
llhooks      | ll        | 2 | 120 | $PY -m pytest tests/gpu/test_ll_hooks_gpu.py -x -q -p no:cacheprovider
elastic      | peers     | 4 | 300 | env COMMLIB_TIMEOUT_S=60 $PY -m pytest tests/gpu/test_elastic_gpu.py -x -q -p no:cacheprovider
megatron     | peers     | 2 | 240 | bash -c megatron_moe
memprobe     | peers     | 16t | 200 | $PY -m benchmarks.mem_probe --require-fit --json $RES/mem_probe_$(gpu_tag)_$(date +%Y%m%d)_$C.json
memll        | peers     | 8 | 200 | $PY -m benchmarks.mem_probe --low-latency --json $RES/mem_probe_ll_$(gpu_tag)_$(date +%Y%m%d)_$C.json
peerbuild    | peers     | 0 | 300 | bash -c peer_build
peerbench    | peers     | 4 | 420 | $PY -m benchmarks.peers.bench_peers --json $RES ${PEER_ARGS:-}
v1intranode  | peers     | 8  | 570 | bash scripts/deepep_tests.sh $OUT/deepep_v1 $REPO/.deepep_harness $REPO/.deepep_tests intranode
v1ll         | peers     | 8  | 570 | bash scripts/deepep_tests.sh $OUT/deepep_v1 $REPO/.deepep_harness $REPO/.deepep_tests ll
v1llexp      | peers     | 8  | 570 | bash scripts/deepep_tests.sh $OUT/deepep_v1 $REPO/.deepep_harness $REPO/.deepep_tests ll_expseg
v1logfmt     | peers     | 8  | 570 | bash scripts/deepep_tests.sh $OUT/deepep_v1 $REPO/.deepep_harness $REPO/.deepep_tests ll_logfmt
v1shrink     | peers     | 8  | 570 | bash scripts/deepep_tests.sh $OUT/deepep_v1 $REPO/.deepep_harness $REPO/.deepep_tests ll_shrink
v1pressure   | peers     | 8  | 570 | bash scripts/deepep_tests.sh $OUT/deepep_v1 $REPO/.deepep_harness $REPO/.deepep_tests ll_pressure
v1internode  | peers     | 16  | 570 | bash scripts/deepep_tests.sh $OUT/deepep_v1 $REPO/.deepep_harness $REPO/.deepep_tests internode
v2ep         | peers     | 2 | 570 | env DEEPEP_TIMEOUT_S=540 bash scripts/deepep_tests.sh $OUT/deepep_v2 $REPO/.deepep_harness $REPO/.deepep_v2_tests v2ep
v2modes      | peers     | 2 | 570 | env DEEPEP_TIMEOUT_S=170 DEEPEP_V2_ARGS="--num-tokens 1024" bash scripts/deepep_tests.sh $OUT/deepep_v2_modes $REPO/.deepep_harness $REPO/.deepep_v2_tests v2ep_nosync,v2ep_det,v2barrier
v2more       | peers     | 2 | 200 | env DEEPEP_TIMEOUT_S=90 DEEPEP_V2_ARGS="--num-tokens 1024" bash scripts/deepep_tests.sh $OUT/deepep_v2_more $REPO/.deepep_harness $REPO/.deepep_v2_tests v2ep_masked,v2ep_nohybrid
v2nomr       | peers     | 2 | 200 | env DEEPEP_TIMEOUT_S=180 bash scripts/deepep_tests.sh $OUT/deepep_v2_nomr $REPO/.deepep_harness $REPO/.deepep_v2_tests v2ep_nomr
v2unserved   | peers     | 2 | 400 | env DEEPEP_TIMEOUT_S=90 bash scripts/deepep_tests.sh $OUT/deepep_v2_unserved $REPO/.deepep_harness $REPO/.deepep_v2_tests v2ep_perf,v2agrs,v2engram,v2pp
v2gate       | peers     | 1 | 300 | env DEEPEP_TIMEOUT_S=280 bash scripts/deepep_tests.sh $OUT/deepep_v2_gate $REPO/.deepep_harness $REPO/.deepep_v2_tests v2gate
'
# GPU_CHECK_EXTRA: more table lines (newline-separated) for this run only, e.g. a stage running
# DeepEP's own tests from a tree carried to the device: 'dtests | peers | 8 | 300 | $PY ...'
STAGES+=$'\n'"${GPU_CHECK_EXTRA:-}"
# name=stage,... ; a group's preset (nvlink, internode, ll, training, peers) is env,compile + its stages
PRESETS='
quick=env,compile,cpu,smoke,inworst,llfault,moegpu
'

log() { echo "$@" | tee -a "$LOG"; }
trim() { local s=$1; s=${s#"${s%%[![:space:]]*}"}; echo "${s%"${s##*[![:space:]]}"}"; }

NAMES=(); GROUP=(); RANKS=(); LIMIT=(); CMD=()
while IFS='|' read -r name group ranks limit cmd; do
  name=$(trim "$name")
  [[ -z $name || $name == \#* ]] && continue
  NAMES+=("$name"); GROUP+=("$(trim "$group")"); RANKS+=("$(trim "$ranks")"); LIMIT+=("$(trim "$limit")")
  CMD+=("$(trim "$cmd")")
done <<<"$STAGES"

# GPU_CHECK_ONLY -> the selected stage names (run in table order)
declare -A PICK=()
is_stage() { local n; for n in "${NAMES[@]}"; do [[ $n == "$1" ]] && return 0; done; return 1; }
select_token() {
  local tok=$1 line i found=0 sub s
  [[ -z $tok ]] && return 0
  while read -r line; do
    [[ $line == "$tok="* ]] || continue
    IFS=',' read -r -a sub <<<"${line#*=}"
    for s in "${sub[@]}"; do select_token "$s" || return 1; done
    return 0
  done <<<"$PRESETS"
  if is_stage "$tok"; then PICK[$tok]=1; return 0; fi
  for i in "${!NAMES[@]}"; do
    [[ $tok == all || ${GROUP[$i]} == "$tok" ]] && { PICK[${NAMES[$i]}]=1; found=1; }
  done
  (( found )) || { echo "gpu_check: unknown stage, group or preset '$tok'; stages: ${NAMES[*]}" >&2; return 1; }
  [[ $tok == all || $tok == setup ]] || { PICK[env]=1; PICK[compile]=1; }  # a group's preset starts with these
}
IFS=',' read -r -a TOKENS <<<"$ONLY"
for tok in "${TOKENS[@]}"; do select_token "$(trim "$tok")" || exit 2; done

if command -v nvidia-smi >/dev/null 2>&1 && [[ $DRY != 1 ]]; then
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
else
  GPUS=${GPU_CHECK_GPUS:-1}
fi

# H200x1: the GPU model and how many there are (result file names: docs/results.md)
gpu_tag() {
  if [[ $DRY == 1 ]]; then echo "GPUx$GPUS"; return; fi
  $PY -c "import torch; from commlib.bench.results import gpu_short_name as g; print(f'{g(torch.cuda.get_device_name(0))}x{torch.cuda.device_count()}')"
}

env_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m
  lscpu | grep -E "^(Model name|CPU\(s\)|Thread|Core|Socket|NUMA node|L3|Hypervisor)" || true
  # the clock every host time is read with (a clocksource without a vDSO path costs a syscall a read)
  echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null) (of:" \
    "$(cat /sys/devices/system/clocksource/clocksource0/available_clocksource 2>/dev/null))"
  $PY - <<'EOF'
import time
t = time.perf_counter_ns
n = 100000
a = t()
for _ in range(n):
    t()
print(f"perf_counter_ns: {(t() - a) / n:.0f} ns a read (a Python call included)")
EOF
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
from commlib.cuda import callpath, loader as kernels
torch.cuda.init()
for plain in (False, True):
    t0 = time.perf_counter()
    kernels.compile_all(plain)
    print(f"[compile] plain={plain}: {len(kernels.FAMILIES)} families in {time.perf_counter() - t0:.2f} s")
t0 = time.perf_counter()   # the C++ call path, built once here for the later stages (COMMLIB_CALLPATH)
mod = callpath.load()
print(f"[compile] C++ call path: {'loaded' if mod else 'UNAVAILABLE: ' + callpath.why_unavailable} in "
      f"{time.perf_counter() - t0:.2f} s (compiler: {callpath.build_seconds or 'cached'})")
EOF
}

# A wheel built from this tree, installed (not editable) into its own folder and imported from
# outside the checkout: the kernels compile from its commlib/_csrc and the main job passes.
wheel_check() {
  local W=/tmp/cl_wheel S=/tmp/cl_site
  rm -rf "$W" "$S"; mkdir -p "$W"
  $PY -m pip wheel --no-deps --no-build-isolation -q -w "$W" . || return 1
  $PY -m pip install -q --no-deps --no-compile --target "$S" "$W"/commlib-*.whl || return 1
  (cd /tmp && PYTHONPATH="$S" $PY -c "import commlib, commlib.cuda.loader as L; print('[wheel]', commlib.__file__, L.CSRC); assert str(L.CSRC).startswith('$S'); L.compile_all()" &&
   PYTHONPATH="$S" $PY -m commlib.bench --ranks 2 --tokens 1024 --iters 3 --warmup 1 --json "$W/results")
}
# Megatron-Core's MoELayer, flex dispatcher on commlib against its alltoall dispatcher
# (benchmarks/megatron_moe.py). The device has no registry: megatron-core comes as the wheel carried
# in .wheels/ (docs/deep_ep.md), installed without dependencies (it needs torch, numpy, packaging).
megatron_moe() {
  local wheels=("$REPO"/.wheels/*.whl)
  [[ -e ${wheels[0]} ]] || { echo "megatron: no wheel in $REPO/.wheels (carry .wheels: docs/deep_ep.md)"; return 2; }
  $PY -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check "${wheels[@]}" || return 1
  $PY -m benchmarks.megatron_moe --json "$RES" ${MEGATRON_ARGS:-}
}
# DeepEP v1's extension for peerbench (benchmarks/peers), built by .peers/build_deepep.sh: the repository
# holds no recipe that builds fetched code (docs/peers.md), so the carried .peers/ brings its own.
# The .so is also copied to $OUT/peers, to be carried back as .peers/prebuilt/ (then nothing builds).
# PEERS_DIR: another .peers (the CPU test's).
peer_build() {
  local peers=${PEERS_DIR:-$REPO/.peers} recipe=${PEERS_DIR:-$REPO/.peers}/build_deepep.sh
  if [[ ! -f $recipe ]]; then
    echo "peerbuild: no $recipe: DeepEP's build recipe is kept out of the repository by policy; carry a .peers" \
         "that has one (docs/peers.md). peerbench still runs commlib HEAD against 917fdc0."
    return 2
  fi
  PYTHON=$PY bash "$recipe" "$peers/DeepEP" "$REPO/.peers_build/DeepEP" "$PEER_SO_OUT"
}
export -f env_info compile_kernels wheel_check megatron_moe peer_build
PEER_SO_OUT="$OUT/peers"
export REPO RES PEER_SO_OUT
export PY

# CUDA MPS: started before the first stage that needs it, always stopped on exit.
MPS_DIR=/tmp/commlib_mps_$$
MPS_STATE=off   # off | on | none (no daemon: ranks time-slice)
mps_start() {
  [[ $MPS_STATE != off ]] && return 0
  if [[ ${GPU_CHECK_MPS:-1} == 0 ]] || ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    MPS_STATE=none; log "[gpu_check] no MPS (GPU_CHECK_MPS=0 or no nvidia-cuda-mps-control): ranks time-slice"; return 0
  fi
  mkdir -p "$MPS_DIR/pipe" "$MPS_DIR/log"
  if CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log" nvidia-cuda-mps-control -d; then
    MPS_STATE=on; log "[gpu_check] MPS daemon started ($MPS_DIR)"
  else
    MPS_STATE=none; log "[gpu_check] MPS daemon did not start: ranks time-slice"
  fi
}
mps_stop() {
  if [[ $MPS_STATE == on ]]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" nvidia-cuda-mps-control && log "[gpu_check] MPS daemon stopped"
    MPS_STATE=off
  fi
  [[ -f ${MPS_DIR}/log/control.log ]] && cp "$MPS_DIR/log/control.log" "$OUT/logs/mps_control.log" 2>/dev/null
  rm -rf "$MPS_DIR"
}
trap mps_stop EXIT
trap 'exit 130' INT TERM

LOG="$OUT/gpu_check.log"
if [[ $DRY != 1 ]]; then mkdir -p "$OUT/logs" "$RES"; : >"$LOG"; fi
START=$(date +%s)
ROWS=()

run_stage() {
  local i=$1 name=${NAMES[$1]} limit=${LIMIT[$1]} mps=0 t0 rc status ranks=${RANKS[$1]%t}
  [[ ${RANKS[$i]} != *t ]] && (( ranks > GPUS )) && mps=1
  local words; eval "words=(${CMD[$i]})"
  if [[ $DRY == 1 ]]; then
    local missing=""
    [[ ${words[0]} == bash && ${words[1]} == -c ]] && ! declare -F "${words[2]}" >/dev/null && missing=" MISSING-FUNCTION"
    printf '[dry] %s group=%s ranks=%s timeout=%s mps=%s ::' "$name" "${GROUP[$i]}" "${RANKS[$i]}" "$limit" "$mps"
    printf ' %q' "${words[@]}"; printf '%s\n' "$missing"
    return 0
  fi
  local left=$((BUDGET - ($(date +%s) - START)))
  if (( left < 15 )); then log "[gpu_check] skip $name: budget spent"; ROWS+=("$name|${GROUP[$i]}|$mps|skipped|0|0"); return 0; fi
  (( limit > left )) && limit=$left
  local pre=()
  if (( mps )); then
    mps_start
    [[ $MPS_STATE == on ]] && pre=(env CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log") || mps=0
  fi
  log "[gpu_check] === $name (${GROUP[$i]}, $ranks ranks on $GPUS GPUs$( ((mps)) && echo ', MPS'), timeout ${limit}s) $(date +%T): ${words[*]}"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "${pre[@]}" "${words[@]}" 2>&1 | tee "$OUT/logs/$name.log" >>"$LOG"
  rc=${PIPESTATUS[0]}
  tail -n 40 "$OUT/logs/$name.log"
  if (( rc == 0 )); then status=ok; elif (( rc == 124 || rc == 137 )); then status=timeout; else status=failed; fi
  ROWS+=("$name|${GROUP[$i]}|$mps|$status|$rc|$(( $(date +%s) - t0 ))")
}

for i in "${!NAMES[@]}"; do
  [[ -n ${PICK[${NAMES[$i]}]+x} ]] && run_stage "$i"
done
[[ $DRY == 1 ]] && exit 0

log "[gpu_check] ===== summary ($(( $(date +%s) - START ))s of ${BUDGET}s budget, $GPUS GPUs, commit $C)"
JSON="{\"commit\": \"$C\", \"gpus\": $GPUS, \"budget_s\": $BUDGET, \"stages\": ["
sep="" bad=0
for r in "${ROWS[@]}"; do
  IFS='|' read -r n g m s rc dt <<<"$r"
  log "  $n ($g$( ((m)) && echo ', MPS')): $s (rc $rc, ${dt}s)"
  [[ $s == ok ]] || bad=1
  JSON+="$sep"$'\n'"  {\"stage\": \"$n\", \"group\": \"$g\", \"mps\": $m, \"status\": \"$s\", \"rc\": $rc, \"seconds\": $dt}"
  sep=","
done
echo "$JSON"$'\n'"]}" >"$OUT/gpu_check.json"
exit $bad
