#!/usr/bin/env bash
# Plants the low-latency engine's old output allocation (on the comm stream, recorded for the caller's
# stream, no blocks) in a copy of this tree and runs the GPU case that exists for it,
# tests/gpu/low_latency_cases.py case_host_ahead_memory (2 ranks): the plant must make it fail, the
# unplanted tree must pass. GPU machine only (scripts/gpu_check.sh stage llplant).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
run() {   # run TREE: the case's verdict line
  ( cd "$1" && env PYTHONPATH="$1" COMMLIB_TEST_CASES=host_ahead_memory COMMLIB_TIMEOUT_S=60 \
      "$PY" -m pytest tests/gpu/test_low_latency_gpu.py -q -p no:cacheprovider -k "matches_reference and 2" 2>&1 ) |
    tee /tmp/plant_ll_$2.log | grep -E "passed|failed|error" | tail -1
}
base=$(run "$PWD" clean)
echo "[plant] no plant: $base"
[[ "$base" == *passed* && "$base" != *failed* ]] || { echo "[plant] the unplanted tree must pass first"; tail -20 /tmp/plant_ll_clean.log; exit 99; }
T=$(mktemp -d /tmp/plant_ll.XXXXXX)
cp -r commlib tests csrc pyproject.toml "$T"/
F="$T/commlib/backends/low_latency/nvlink.py"
sed -i 's/b\.out_stream, b\.comm_stream/None, b.comm_stream/; s/self\.blocks = tuple(made)/self.blocks = None/' "$F"
n=$(grep -c "None, b\.comm_stream\|self\.blocks = None" "$F")
[ "$n" -ge 5 ] || { echo "[plant] the plant did not apply ($n edits)"; exit 98; }
planted=$(run "$T" planted)
echo "[plant] comm-stream outputs: $planted"
grep -m1 "held" /tmp/plant_ll_planted.log || true
rm -rf "$T"
[[ "$planted" == *failed* ]] && { echo "[plant] caught"; exit 0; }
echo "[plant] MISSED"; exit 1
