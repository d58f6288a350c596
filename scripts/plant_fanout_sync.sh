#!/usr/bin/env bash
# Plants a bug in the node barrier's pieces (csrc/common.cuh NodeSync: the barriers a dispatch's forwards,
# a cached dispatch's pack, and a combine's rows and first reduce take) at a time and runs the device case that exists for it
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
  "no arrival at a cached dispatch's pack@(s.flags & (NODE_SYNC_ENTER | NODE_SYNC_ARRIVE_START)) && s_first@(s.flags & NODE_SYNC_ENTER) && s_first"
)
plant_world_case fanout_cases sync_pieces
