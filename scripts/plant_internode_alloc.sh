#!/usr/bin/env bash
# Plants the internode engine's old output allocation (outputs and transients on the comm stream,
# recorded for the caller's stream, no blocks) in a copy of this tree and runs the GPU case that
# exists for it, tests/cases_internode.py case_host_ahead_memory (4 ranks: 2 x 2 with the forwarder,
# the device path and the num_worst_tokens kernel route): the plant must make it fail, the unplanted
# tree must pass. GPU machine only (scripts/gpu_check.sh stage inalloc).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
run() {   # run TREE NAME: the case's verdict line
  ( cd "$1" && env PYTHONPATH="$1" COMMLIB_TEST_CASES=host_ahead_memory COMMLIB_TIMEOUT_S=60 \
      "$PY" -m pytest tests/gpu/test_internode_gpu.py -q -p no:cacheprovider -k "matches_reference and 4" 2>&1 ) |
    tee /tmp/plant_inalloc_$2.log | grep -E "passed|failed|error" | tail -1
}
base=$(run "$PWD" clean)
echo "[plant] no plant: $base"
[[ "$base" == *passed* && "$base" != *failed* ]] || { echo "[plant] the unplanted tree must pass first"; tail -20 /tmp/plant_inalloc_clean.log; exit 99; }
T=$(mktemp -d /tmp/plant_inalloc.XXXXXX)
cp -r commlib tests csrc pyproject.toml "$T"/
F="$T/commlib/backends/internode/wiring.py"
sed -i 's/(ctx\.out_stream, ctx\.comm_stream) if ctx is not None/(None, None) if ctx is not None/; s/return tuple(made) if keep else None/return None/' "$F"
n=$(grep -c "(None, None) if ctx is not None\|        return None$" "$F")
[ "$n" -ge 2 ] || { echo "[plant] the plant did not apply ($n edits)"; exit 98; }
planted=$(run "$T" planted)
echo "[plant] comm-stream outputs: $planted"
grep -m1 "held" /tmp/plant_inalloc_planted.log || true
rm -rf "$T"
[[ "$planted" == *failed* ]] && { echo "[plant] caught"; exit 0; }
echo "[plant] MISSED"; exit 1
