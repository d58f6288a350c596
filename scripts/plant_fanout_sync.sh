#!/usr/bin/env bash
# Plants a bug in the node barrier's pieces (csrc/common.cuh NodeSync: the barriers a dispatch's forwards
# and a combine's rows and first reduce take) at a time and runs the device case that exists for it
# (tests/gpu/fanout_cases.py sync_pieces: 2 processes of one node on the GPU, one rank late in turn,
# against torch oracles): every plant must make it fail. The file is restored after each plant. GPU
# machine only (scripts/gpu_check.sh fansync).
source "$(dirname "$0")/plant_lib.sh"
plant_begin csrc/common.cuh
# name @ text in the header @ its planted replacement
PLANTS=(
  "no wait in the barrier at a kernel's end@if (s.flags & NODE_SYNC_WAIT_END) node_wait(@if (false) node_wait("
  "no wait in the barrier at a kernel's start@if (s.flags & (NODE_SYNC_ENTER | NODE_SYNC_WAIT_START)) {@if (s.flags & NODE_SYNC_WAIT_START) {"
  "no wait for an earlier kernel's arrival@if (s.flags & (NODE_SYNC_ENTER | NODE_SYNC_WAIT_START)) {@if (s.flags & NODE_SYNC_ENTER) {"
)
cat >/tmp/plant_fansync.py <<PYEOF
import sys
sys.path.insert(0, "$PWD/tests")
sys.path.insert(0, "$PWD/tests/gpu")
from worlds import run_world
if __name__ == "__main__":
    try:
        err = run_world(2, "fanout_cases", ["sync_pieces"], use_gpu=True, group_backend="gloo", timeout_s=200,
                        case_timeout_s=150)["sync_pieces"]
    except RuntimeError as e:   # a rank died or hung: failed as well
        err = f"the world failed: {e}"
    print("RESULT", "passed" if err is None else "failed: " + err.strip().splitlines()[-1][:300])
PYEOF
plant_loop /tmp/plant_fansync.py "RESULT failed"
