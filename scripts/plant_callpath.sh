#!/usr/bin/env bash
# Plants a bug in csrc/callpath.cpp (or its header) at a time and runs the device test that exists for it
# (tests/gpu/nvlink_cases.py case_callpath: 2 ranks, the C++ call path against the Python path and the
# reference backend, bit for bit): every plant must make it fail with an AssertionError (a mismatch,
# not a crash). Each plant is its own build (a changed source is a new cache entry). The file is
# restored after each plant. GPU machine only (scripts/gpu_check.sh cpplant).
source "$(dirname "$0")/plant_lib.sh"
plant_begin csrc/callpath.cpp csrc/callpath.h
# name @ text in the source @ its planted replacement
PLANTS=(
  "cached dispatch: the kept x address replayed, not this call's@    l.set(p.x_slot, address(tensor(xo)));@    (void)xo;"
  "layout: num_tokens_per_expert written into num_tokens_per_rank@    l.set(p.ntpe, address(ntpe));@    l.set(p.ntpe, address(ntpr));"
  "cached FP8 dispatch: the scales carved over recv_x's last 256 bytes (the outputs' one allocation)@    offset2 = two ? align_up(nbytes(shape, dtype), 256) : 0;@    offset2 = two ? align_up(nbytes(shape, dtype), 256) - 256 : 0;"
  "dispatch: per-expert counts not rounded to the alignment@        per_expert.append(align_up(c, e.alignment));@        per_expert.append(c);"
)
cat >/tmp/plant_callpath_run.py <<PYEOF
import sys
sys.path[:0] = ["$PWD", "$PWD/tests", "$PWD/tests/gpu"]
from worlds import run_world
if __name__ == "__main__":
    res = run_world(2, "nvlink_cases", ["callpath"], use_gpu=True, timeout_s=240, case_timeout_s=150)
    err = res["callpath"]
    kind = "mismatch" if err and "AssertionError" in err else "error"
    print("RESULT", "passed" if err is None else f"failed ({kind}): " + err.strip().splitlines()[-1][:300])
PYEOF
plant_loop /tmp/plant_callpath_run.py "RESULT failed (mismatch)"
