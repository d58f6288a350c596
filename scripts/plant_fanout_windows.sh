#!/usr/bin/env bash
# Plants a bug in the forwarder's window (csrc/fanout.cu) at a time and runs the device case that
# exists for it (tests/gpu/fanout_cases.py forward_windows: 2 processes of one node on the GPU,
# windows of final rows against a torch oracle): every plant must make it fail. The file is restored
# after each plant. GPU machine only (scripts/gpu_check.sh fanplant). The engine's side of the
# windows (padded.py) is planted on CPU stand-ins: tests/cases_internode.py worst_kernel_route.
source "$(dirname "$0")/plant_lib.sh"
plant_begin csrc/fanout.cu
# name @ text in the kernel @ its planted replacement
PLANTS=(
  "window's upper bound off by one@pos_lane >= lo && pos_lane < hi;@pos_lane >= lo && pos_lane <= hi;"
  "window's lower bound off by one@pos_lane >= lo && pos_lane < hi;@pos_lane > lo && pos_lane < hi;"
  "positions not rebased to the window@in_window ? pos_lane - lo : -1@in_window ? pos_lane : -1"
  "a row skipped when only the last local rank gets it@__any_sync(FULL_MASK, in_window)@__any_sync(FULL_MASK, in_window && lane + 1 < P)"
)
cat >/tmp/plant_fanwin.py <<PYEOF
import sys
sys.path.insert(0, "$PWD/tests")
sys.path.insert(0, "$PWD/tests/gpu")
from worlds import run_world
if __name__ == "__main__":
    try:
        err = run_world(2, "fanout_cases", ["forward_windows"], use_gpu=True, group_backend="gloo", timeout_s=200,
                        case_timeout_s=150)["forward_windows"]
    except RuntimeError as e:   # a rank died (a planted store past the buffer): failed as well
        err = f"the world failed: {e}"
    print("RESULT", "passed" if err is None else "failed: " + err.strip().splitlines()[-1][:300])
PYEOF
plant_loop /tmp/plant_fanwin.py "RESULT failed"
