#!/usr/bin/env bash
# gpu_check's peerbench stage: DeepEP v1's build (reused when it is there), then bench_peers.
#
#   bash benchmarks/peers/bench_peers.sh RES [bench_peers arguments...]     # JSON into the folder RES
#
# The benchmark runs even when the build failed (commlib HEAD against 917fdc0; DeepEP reported as
# not loaded), and the exit status is then 1.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
RES=${1:?usage: bench_peers.sh RES [args...]}
shift
PY=${PYTHON:-python3}
bash benchmarks/peers/build_deepep.sh
build=$?
(( build == 0 )) || echo "[peers] DeepEP's build failed (rc $build): the benchmark runs without it"
"$PY" -m benchmarks.peers.bench_peers --json "$RES" "$@"
bench=$?
(( build == 0 && bench == 0 ))
