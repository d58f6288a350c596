#!/usr/bin/env bash
# DeepEP v1's own tests, unchanged, against commlib on one GPU (ranks share it through the harness).
#
#   bash scripts/deepep_tests.sh LOGDIR HARNESS_DIR [TESTS_DIR] [RUNS]
#
# LOGDIR       one log per run (<run>.log) and summary.txt ("<run> rc=<n> <pass|FAIL|pass (bounded)>")
# HARNESS_DIR  the harness folder (sitecustomize.py: ranks -> GPU i % count, NCCL_HOSTID per rank)
# TESTS_DIR    DeepEP's tests/ at the v1 commit (test_intranode.py, test_low_latency.py,
#              test_internode.py, utils.py); default: .deepep_tests of this checkout
# RUNS         comma list, default all: intranode, ll, ll_logfmt, ll_shrink, ll_pressure, internode;
#              also mem (not in the default): benchmarks.mem_probe at test_internode's shape, 2 x 8;
#              mem_ll: the same at test_low_latency's shape; ll_expseg: ll with expandable segments
#
#              DeepEP V2's files (TESTS_DIR from scripts/stage_deepep_v2_tests.sh, default
#              .deepep_v2_tests), 2 ranks, not in the default: v2ep (test_ep.py, CPU sync, every mode),
#              v2ep_nosync (--do-cpu-sync 0), v2ep_det (--deterministic), v2ep_perf (with its kineto
#              timing), v2ep_nomr (--allow-multiple-reduction 0), v2ep_masked (--masked-ratio 0.2),
#              v2ep_nohybrid (--allow-hybrid-mode 0), v2barrier, v2gate (one process),
#              v2agrs, v2engram, v2pp. DEEPEP_V2_ARGS is appended to the arguments of every V2 test but test_barrier.
#
# v1: every run at the tests' default sizes and process counts (8 per launch), under `timeout`; the
# pressure test runs for DEEPEP_PRESSURE_S seconds and passes if nothing failed by then. Under CUDA
# MPS (started here unless one is running or DEEPEP_NO_MPS=1) the ranks run concurrently.
# Time limits: DEEPEP_TIMEOUT_S (default 540) per run. The tests run from TESTS_DIR, with this
# checkout first on PYTHONPATH so `import deep_ep` is commlib's.
set -u
LOGDIR=${1:?usage: deepep_tests.sh LOGDIR HARNESS_DIR [TESTS_DIR] [RUNS]}
HARNESS=${2:?usage: deepep_tests.sh LOGDIR HARNESS_DIR [TESTS_DIR] [RUNS]}
cd "$(dirname "$0")/.."
REPO=$(pwd)
RUNS=${4:-intranode,ll,ll_logfmt,ll_shrink,ll_pressure,internode}
case "$RUNS" in v2*) TESTS=${3:-$REPO/.deepep_v2_tests} ;; *) TESTS=${3:-$REPO/.deepep_tests} ;; esac
mkdir -p "$LOGDIR"
LOGDIR=$(cd "$LOGDIR" && pwd)
HARNESS=$(cd "$HARNESS" && pwd)
TESTS=$(cd "$TESTS" && pwd)
SUMMARY="$LOGDIR/summary.txt"
: >"$SUMMARY"
PY=${PYTHON:-python3}
LIMIT=${DEEPEP_TIMEOUT_S:-540}
PRESSURE_S=${DEEPEP_PRESSURE_S:-240}
V2ARGS=${DEEPEP_V2_ARGS:-}
case "$RUNS" in
  v2*) NEED="tests/elastic/test_ep.py tests/elastic/test_barrier.py tests/utils/test_gate.py
             support/deep_ep/utils/refs.py support/deep_ep/utils/gate.py support/deep_ep/utils/testing.py" ;;
  *) NEED="test_intranode.py test_low_latency.py test_internode.py utils.py" ;;
esac
for f in $NEED; do
  [ -f "$TESTS/$f" ] || { echo "missing $TESTS/$f" | tee -a "$SUMMARY"; exit 2; }
done
[ -f "$HARNESS/sitecustomize.py" ] || { echo "missing $HARNESS/sitecustomize.py" | tee -a "$SUMMARY"; exit 2; }

# NVLink multicast stays off in everything started here (it can take shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$HARNESS:$REPO${PYTHONPATH:+:$PYTHONPATH}"
case "$RUNS" in v2*)
  # V2's tests import its test-support modules from deep_ep.utils (refs, gate, testing): a copy of
  # commlib's deep_ep with V2's three files added beside commlib's own (never replacing one) goes
  # first on the path; it imports commlib from this checkout
  V2PKG="$LOGDIR/v2pkg"
  rm -rf "$V2PKG" && mkdir -p "$V2PKG" && cp -r "$REPO/deep_ep" "$V2PKG/"
  for m in "$TESTS"/support/deep_ep/utils/*.py; do
    [ -e "$V2PKG/deep_ep/utils/$(basename "$m")" ] || cp "$m" "$V2PKG/deep_ep/utils/"
  done
  export PYTHONPATH="$HARNESS:$V2PKG:$REPO${PYTHONPATH#$HARNESS:$REPO}"
  echo "# deep_ep: commlib's + V2's $(cd "$TESTS/support/deep_ep/utils" && ls *.py | tr '\n' ' ')(DeepEP $(cat "$TESTS/COMMIT" 2>/dev/null))" | tee -a "$SUMMARY" ;;
esac
export DEEPEP_HARNESS_SHARE_GPU=1 MASTER_ADDR=127.0.0.1
export COMMLIB_TIMEOUT_S=${COMMLIB_TIMEOUT_S:-120}
unset DEEPEP_HARNESS_WORKAROUND_CPU_DEFAULT   # a diagnostic that hides a commlib bug: never for a pass

MPS_STARTED=0
if [ "${DEEPEP_NO_MPS:-0}" != 1 ] && command -v nvidia-cuda-mps-control >/dev/null; then
  if ! pgrep -u "$(id -u)" -f "^nvidia-cuda-mps-control" >/dev/null; then
    MPS_DIR=$(mktemp -d /tmp/deepep_mps.XXXXXX)   # pipes and sockets: not in LOGDIR
    export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && MPS_STARTED=1
  fi
fi
echo "# mps: started here=$MPS_STARTED pipe=${CUDA_MPS_PIPE_DIRECTORY:-default}" | tee -a "$SUMMARY"
stop_mps() {
  [ "$MPS_STARTED" = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control
  cp "$CUDA_MPS_LOG_DIRECTORY/control.log" "$LOGDIR/mps_control.log" 2>/dev/null || true
}
trap stop_mps EXIT

PORT=29600
# each spawned rank prints its device memory when it ends or raises ([memwatch rank R] lines; the
# test itself runs unchanged): DEEPEP_MEMWATCH=0 runs the file bare
WATCH=""
[ "${DEEPEP_MEMWATCH:-1}" != 0 ] && WATCH="-m benchmarks.deepep_memwatch"
# launch NAME SECONDS 'ENV...' ARGS...: one process group (setsid) per launch, killed whole at the limit
start() {   # start LOG ENV-ASSIGNMENTS ARGS... ; sets LAST_PID
  local log=$1 envs=$2; shift 2
  ( cd "$TESTS" && exec setsid env $envs MASTER_PORT=$PORT "$PY" $WATCH "$@" ) >>"$log" 2>&1 &
  LAST_PID=$!
}
wait_all() {   # wait_all SECONDS PID... ; sets RC (124: the limit; else the first non-zero)
  local limit=$1; shift
  local end=$(( $(date +%s) + limit )) pid
  RC=0
  while :; do
    local alive=0
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    if [ "$(date +%s)" -ge $end ]; then
      for pid in "$@"; do kill -TERM -- "-$pid" 2>/dev/null; done
      sleep 10
      for pid in "$@"; do kill -KILL -- "-$pid" 2>/dev/null; done
      RC=124
      break
    fi
    sleep 2
  done
  for pid in "$@"; do
    wait "$pid"; local r=$?
    [ $RC = 0 ] && [ $r != 0 ] && RC=$r
  done
}
verdict() {   # verdict NAME LOG BOUNDED
  local name=$1 log=$2 bounded=$3 result=FAIL
  if [ "$RC" = 0 ]; then
    result=pass
  elif [ "$RC" = 124 ] && [ "$bounded" = 1 ] && ! grep -qE "Traceback|Error|AssertionError" "$log"; then
    result="pass (bounded)"
  fi
  echo "$name rc=$RC $result ($(( $(date +%s) - T0 )) s)" | tee -a "$SUMMARY"
}
run_one() {   # run_one NAME SECONDS BOUNDED 'ENV...' ARGS...
  local name=$1 limit=$2 bounded=$3 envs=$4; shift 4
  local log="$LOGDIR/$name.log"
  : >"$log"
  T0=$(date +%s)
  PORT=$((PORT + 1))
  start "$log" "$envs" "$@"
  wait_all "$limit" "$LAST_PID"
  verdict "$name" "$log" "$bounded"
}

IFS=, read -ra WANT <<<"$RUNS"
for run in "${WANT[@]}"; do
  case "$run" in
    intranode) run_one intranode "$LIMIT" 0 "" test_intranode.py ;;
    ll) run_one ll "$LIMIT" 0 "" test_low_latency.py ;;
    # a diagnostic, never a pass of the test as it stands: the same run with torch's expandable
    # segments (shows how much of the memory is the caching allocator's fragmentation)
    ll_expseg) run_one ll_expseg "$LIMIT" 0 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" test_low_latency.py ;;
    ll_logfmt) run_one ll_logfmt "$LIMIT" 0 "" test_low_latency.py --use-logfmt ;;
    # ranks 1, 3, 5 stop calling: each costs the others one timeout before it is masked
    ll_shrink) run_one ll_shrink "$LIMIT" 0 "COMMLIB_TIMEOUT_S=${DEEPEP_SHRINK_TIMEOUT_S:-15}" \
                 test_low_latency.py --shrink-test ;;
    ll_pressure) run_one ll_pressure "$PRESSURE_S" 1 "" test_low_latency.py --pressure-test ;;
    internode)   # 2 emulated nodes x 8: two launches of 8 processes, one world of 16
      log="$LOGDIR/internode.log"
      : >"$log"
      T0=$(date +%s)
      PORT=$((PORT + 1))
      start "$log.node0" "WORLD_SIZE=2 RANK=0 COMMLIB_RANKS_PER_NODE=8" test_internode.py --num-processes 8
      p0=$LAST_PID
      start "$log.node1" "WORLD_SIZE=2 RANK=1 COMMLIB_RANKS_PER_NODE=8" test_internode.py --num-processes 8
      wait_all "$LIMIT" "$p0" "$LAST_PID"
      cat "$log.node0" "$log.node1" >"$log"
      # how far it got: its correctness checks (local rank 0 of each node prints one line per check;
      # 32 per node), the tuning sweeps after them, ranks out of memory
      echo "# internode: checks passed $(grep -c ' passed' "$log.node0") / $(grep -c ' passed' "$log.node1") of 32" \
           "(node 0 / 1); tuning lines $(grep -c '^\[tuning\]' "$log"); out of memory on" \
           "$(grep -c 'memwatch rank .* raised OutOfMemoryError' "$log") ranks" | tee -a "$SUMMARY"
      verdict internode "$log" 0 ;;
    # DeepEP V2 (one node, 2 ranks): test_ep's kineto timing looks for V2's kernel names, so the
    # correctness runs pass --skip-perf-test (v2ep_perf keeps it, to show what it does here)
    v2ep) run_one v2ep "$LIMIT" 0 "" tests/elastic/test_ep.py --num-processes 2 --skip-perf-test $V2ARGS ;;
    v2ep_nosync) run_one v2ep_nosync "$LIMIT" 0 "" tests/elastic/test_ep.py --num-processes 2 --skip-perf-test \
                   --do-cpu-sync 0 $V2ARGS ;;
    v2ep_det) run_one v2ep_det "$LIMIT" 0 "" tests/elastic/test_ep.py --num-processes 2 --skip-perf-test \
                --deterministic $V2ARGS ;;
    v2ep_perf) run_one v2ep_perf "$LIMIT" 0 "" tests/elastic/test_ep.py --num-processes 2 --test-first-only $V2ARGS ;;
    v2ep_nomr) run_one v2ep_nomr "$LIMIT" 0 "" tests/elastic/test_ep.py --num-processes 2 --skip-perf-test \
                 --allow-multiple-reduction 0 $V2ARGS ;;
    v2ep_masked) run_one v2ep_masked "$LIMIT" 0 "" tests/elastic/test_ep.py --num-processes 2 --skip-perf-test \
                   --masked-ratio 0.2 $V2ARGS ;;
    v2ep_nohybrid) run_one v2ep_nohybrid "$LIMIT" 0 "" tests/elastic/test_ep.py --num-processes 2 --skip-perf-test \
                     --allow-hybrid-mode 0 $V2ARGS ;;
    # test_barrier takes no size arguments: DEEPEP_V2_ARGS (test_ep's) are not passed to it
    v2barrier) run_one v2barrier "$LIMIT" 0 "" tests/elastic/test_barrier.py --num-processes 2 ;;
    v2gate) run_one v2gate "$LIMIT" 0 "" tests/utils/test_gate.py $V2ARGS ;;
    v2agrs) run_one v2agrs "$LIMIT" 0 "" tests/elastic/test_agrs.py --num-processes 2 $V2ARGS ;;
    v2engram) run_one v2engram "$LIMIT" 0 "" tests/elastic/test_engram.py --num-processes 2 $V2ARGS ;;
    v2pp) run_one v2pp "$LIMIT" 0 "" tests/elastic/test_pp.py --num-processes 2 $V2ARGS ;;
    mem)   # device memory per rank, stage by stage (a commlib benchmark, not a DeepEP test)
      log="$LOGDIR/mem.log"
      : >"$log"
      T0=$(date +%s)
      ( cd "$REPO" && exec setsid env -u DEEPEP_HARNESS_SHARE_GPU "$PY" -m benchmarks.mem_probe \
          --json "$LOGDIR/mem_probe.json" ) >>"$log" 2>&1 &
      wait_all "$LIMIT" $!
      verdict mem "$log" 0 ;;
    mem_ll)   # the same at test_low_latency's shape: 8 ranks, low-latency Buffer of its size hint
      log="$LOGDIR/mem_ll.log"
      : >"$log"
      T0=$(date +%s)
      ( cd "$REPO" && exec setsid env -u DEEPEP_HARNESS_SHARE_GPU "$PY" -m benchmarks.mem_probe --low-latency \
          --json "$LOGDIR/mem_probe_ll.json" ) >>"$log" 2>&1 &
      wait_all "$LIMIT" $!
      verdict mem_ll "$log" 0 ;;
    *) echo "$run: unknown run (intranode, ll, ll_expseg, ll_logfmt, ll_shrink, ll_pressure, internode, mem, mem_ll, v2ep, v2ep_nosync," \
            "v2ep_det, v2ep_perf, v2ep_nomr, v2ep_masked, v2ep_nohybrid, v2barrier, v2gate, v2agrs, v2engram, v2pp)" | tee -a "$SUMMARY" ;;
  esac
done
cat "$SUMMARY"
! grep -q "FAIL\|unknown" "$SUMMARY"
