#!/usr/bin/env bash
# Plants an engine's old output allocation (on the comm stream, recorded for the caller's stream, no
# blocks) in a copy of this tree and runs the GPU case that exists for it, case host_ahead_memory: the
# plant must make it fail, the unplanted tree must pass. GPU machine only (scripts/gpu_check.sh).
#
#   bash scripts/plant_alloc.sh ll          # low-latency engine, tests/gpu/low_latency_cases.py, 2 ranks
#   bash scripts/plant_alloc.sh internode   # internode engine, tests/cases_internode.py, 4 ranks (2 x 2:
#                                           # the device path and the num_worst_tokens kernel route)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
case "${1:-}" in
  ll) TEST="tests/gpu/test_low_latency_gpu.py"; K="matches_reference and 2"
      FILE=commlib/backends/low_latency/nvlink.py; EDITS=5
      SED='s/b\.out_stream, b\.comm_stream/None, b.comm_stream/; s/self\.blocks = tuple(made)/self.blocks = None/'
      DONE='None, b\.comm_stream\|self\.blocks = None' ;;
  internode) TEST="tests/gpu/test_internode_gpu.py"; K="matches_reference and 4"
      FILE=commlib/backends/internode/wiring.py; EDITS=2
      SED='s/(ctx\.out_stream, ctx\.comm_stream) if ctx is not None/(None, None) if ctx is not None/; s/return tuple(made) if keep else None/return None/'
      DONE='(None, None) if ctx is not None\|        return None$' ;;
  *) echo "usage: plant_alloc.sh ll|internode"; exit 2 ;;
esac
run() {   # run TREE NAME: the case's verdict line
  ( cd "$1" && env PYTHONPATH="$1" COMMLIB_TEST_CASES=host_ahead_memory COMMLIB_TIMEOUT_S=60 \
      "$PY" -m pytest "$TEST" -q -p no:cacheprovider -k "$K" 2>&1 ) |
    tee "/tmp/plant_alloc_$2.log" | grep -E "passed|failed|error" | tail -1
}
base=$(run "$PWD" clean)
echo "[plant] no plant: $base"
[[ "$base" == *passed* && "$base" != *failed* ]] || { echo "[plant] the unplanted tree must pass first"; tail -20 /tmp/plant_alloc_clean.log; exit 99; }
T=$(mktemp -d /tmp/plant_alloc.XXXXXX)
cp -r commlib tests csrc pyproject.toml "$T"/
sed -i "$SED" "$T/$FILE"
n=$(grep -c "$DONE" "$T/$FILE")
[ "$n" -ge "$EDITS" ] || { echo "[plant] the plant did not apply ($n edits)"; exit 98; }
planted=$(run "$T" planted)
echo "[plant] comm-stream outputs: $planted"
grep -m1 "held" /tmp/plant_alloc_planted.log || true
rm -rf "$T"
[[ "$planted" == *failed* ]] && { echo "[plant] caught"; exit 0; }
echo "[plant] MISSED"; exit 1
