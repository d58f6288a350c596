#!/usr/bin/env bash
# Plants a bug in csrc/callpath_internode.cpp (or the shared header) at a time and runs the device case that
# exists for it (tests/cases_internode.py case_callpath_dispatch: 4 ranks, every multi-node layout, the C++
# non-cached dispatch against the Python path and the reference backend, bit for bit, then cached dispatch
# and combine on its handles): every plant must make it fail (a mismatch, or a device error where the
# planted bug sends a kernel to a wrong address). Each plant is its own build. The files are restored
# after each plant. GPU machine only (scripts/gpu_check.sh inplantcpp).
source "$(dirname "$0")/plant_lib.sh"
plant_begin csrc/callpath_internode.cpp csrc/callpath.h
# name @ text in the source @ its planted replacement
PLANTS=(
  "dispatch: the digest kernel writes its device words, the host reads its own (stale) words@      t.digest->set(t.dig_out, !test && t.pinned ? address(t.host_dig) : address(t.dig));@      t.digest->set(t.dig_out, address(t.dig));"
  "dispatch with the forwarder: every chunk's landed positions stored at chunk 0's rows of the block@        f.set_value(t.fwd_pos, b + tail + 4 * t.P * c.recv_starts[k]);@        f.set_value(t.fwd_pos, b + tail);"
)
cat >/tmp/plant_callpath_internode_run.py <<PYEOF
import os, sys
sys.path[:0] = ["$PWD", "$PWD/tests", "$PWD/tests/gpu"]
os.environ["COMMLIB_CALLPATH"] = "cpp"
from worlds import run_world
if __name__ == "__main__":
    try:
        res = run_world(4, "cases_internode", ["callpath_dispatch"], use_gpu=True, group_backend="nccl",
                        emulate_hosts=True, ranks_per_node=1, timeout_s=300, case_timeout_s=240)
        err = res["callpath_dispatch"]
    except RuntimeError as e:   # a rank that died (a device error) stops the world
        err = "RuntimeError: " + " ".join(str(e).split())[-300:]
    kind = "mismatch" if err and "AssertionError" in err else "error"
    print("RESULT", "passed" if err is None else f"failed ({kind}): " + err.strip().splitlines()[-1][:300])
PYEOF
plant_loop /tmp/plant_callpath_internode_run.py "RESULT failed"
