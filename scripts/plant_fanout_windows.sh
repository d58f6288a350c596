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
plant_world_case fanout_cases forward_windows
