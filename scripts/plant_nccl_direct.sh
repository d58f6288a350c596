#!/usr/bin/env bash
# Plants a bug in commlib/cuda/nccl.py (the direct NCCL steps of the internode engine) at a time and runs
# the device case that exists for it (2 processes on the GPU as 2 emulated hosts, against the reference
# backend or the deadline): every plant must make it fail. The file is restored after each plant.
# GPU machine only (scripts/gpu_check.sh stage ncclplant).
set -u
cd "$(dirname "$0")/.."
SRC=commlib/cuda/nccl.py
PY=${PY:-python3}
cp "$SRC" /tmp/nccl.py.orig
trap 'cp /tmp/nccl.py.orig "$SRC"' EXIT
# name | case | text | its planted replacement
PLANTS=(
  "all-to-all: every peer's rows land at the first peer's place|matches_reference|                    rp += n_r|                    rp += 0"
  "all-gather: half of each row|matches_reference|        n = row.numel() * row.element_size()|        n = row.numel() * row.element_size() // 2"
  "watchdog: never started (no read follows the late step)|network_timeout|        self._thread.start()|        pass"
)
cat >/tmp/plant_nccl_run.py <<PYEOF
import sys
sys.path.insert(0, "$PWD/tests")
from worlds import run_world
if __name__ == "__main__":
    case = sys.argv[1]
    res = run_world(2, "cases_internode", [case], use_gpu=True, group_backend="nccl",
                    emulate_hosts=True, ranks_per_node=1, timeout_s=240, case_timeout_s=120)
    err = res[case]
    print("RESULT", "passed" if err is None else "failed: " + err.strip().splitlines()[-1][:300])
PYEOF
for c in matches_reference network_timeout; do
  base=$($PY /tmp/plant_nccl_run.py $c 2>&1 | grep "^RESULT" | tail -1)
  echo "[plant] no plant, $c: ${base#RESULT }"
  [[ "$base" == "RESULT passed" ]] || { echo "[plant] the unplanted steps must pass first"; exit 99; }
done
missed=0
for p in "${PLANTS[@]}"; do
  IFS='|' read -r name case from to <<<"$p"
  cp /tmp/nccl.py.orig "$SRC"
  FROM="$from" TO="$to" $PY - "$SRC" <<'PYEOF'
import os, sys
p = sys.argv[1]; s = open(p).read()
assert s.count(os.environ["FROM"]) == 1, f"plant text not found once: {os.environ['FROM']!r}"
open(p, "w").write(s.replace(os.environ["FROM"], os.environ["TO"]))
PYEOF
  out=$($PY /tmp/plant_nccl_run.py "$case" 2>&1)
  line=$(echo "$out" | grep "^RESULT" | tail -1)
  if [[ "$line" == "RESULT failed"* ]]; then echo "[plant] $name: caught (${line#RESULT })"
  else echo "[plant] $name: NOT caught (${line:-no result: $(echo "$out" | tail -3)})"; missed=$((missed + 1)); fi
done
exit $missed
