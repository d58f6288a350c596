#!/usr/bin/env bash
# Plants a bug in csrc/internode.cu at a time and runs the device test that exists for it (2 processes
# on the GPU as 2 emulated hosts, case matches_reference against the reference backend; plants marked
# "digest": the digest kernel against its torch spec, tests/gpu/test_internode_gpu.py -k digest): every
# plant must make it fail. The file is restored after each plant. GPU machine only (scripts/gpu_check.sh inplant).
source "$(dirname "$0")/plant_lib.sh"
plant_begin csrc/internode.cu
# name @ text in the kernel @ its planted replacement [@ digest]  ('@': the kernel's text has '|')
PLANTS=(
  "digest: this rank's first expert total one too many@o_expert[i] = s;@o_expert[i] = s + (i == 0);"
  "digest: a refused row not flagged@error |= row[0] != 0 || row[n_sig + R] > 0@error |= row[n_sig + R] > 0@digest"
  "digest: forwarders' rows read at the wrong local rank@recv += g[(i64)(n * P + p) * row_len + blk + k * P + loc];@recv += g[(i64)(n * P + p) * row_len + blk + k * P + p];@digest"
  "land: local expert ids off by one@topk_out[(i64)d * K + k] = keep ? local : -1;@topk_out[(i64)d * K + k] = keep ? local + 1 : -1;"
  "home: second bias dropped@if (b1) { const u32 v@if (false) { const u32 v"
  "pack: channel prefix at the wrong token@chan_prefix[i] = start < T ? before[(i64)start * R + r] : (int)mine[r];@chan_prefix[i] = start < T ? before[(i64)start * R + r] + (start > 0) : (int)mine[r];"
  "meta: rank 0's row count one too many@if (threadIdx.x == 0) per_rank[col] = carry;@if (threadIdx.x == 0) per_rank[col] = carry + (col == 0);"
)
cat >/tmp/plant_run.py <<PYEOF
import sys
sys.path.insert(0, "$PWD/tests")
from worlds import run_world
if __name__ == "__main__":
    res = run_world(2, "cases_internode", ["matches_reference"], use_gpu=True, group_backend="nccl",
                    emulate_hosts=True, ranks_per_node=1, timeout_s=240, case_timeout_s=120)
    err = res["matches_reference"]
    print("RESULT", "passed" if err is None else "failed: " + err.strip().splitlines()[-1])
PYEOF
base=$($PY /tmp/plant_run.py 2>&1 | grep "^RESULT" | tail -1)
echo "[plant] no plant: ${base#RESULT }"
[[ "$base" == "RESULT passed" ]] || { echo "[plant] the unplanted kernels must pass first"; exit 99; }
missed=0
for p in "${PLANTS[@]}"; do
  IFS='@' read -r name from to which <<<"$p"
  plant_apply "$from" "$to" || exit 98
  if [[ "${which:-}" == digest ]]; then
    out=$($PY -m pytest tests/gpu/test_internode_gpu.py -x -q -p no:cacheprovider -k digest 2>&1)
    if [[ $? -ne 0 ]] && echo "$out" | grep -q "AssertionError"; then line="RESULT failed: $(echo "$out" | grep -m1 "^E ")"
    else line="RESULT passed"; fi
  else
    out=$($PY /tmp/plant_run.py 2>&1)
    line=$(echo "$out" | grep "^RESULT" | tail -1)
  fi
  if [[ "$line" == "RESULT failed"* ]]; then echo "[plant] $name: caught (${line#RESULT })"
  else echo "[plant] $name: NOT caught (${line:-no result: $(echo "$out" | tail -3)})"; missed=$((missed + 1)); fi
done
exit $missed
