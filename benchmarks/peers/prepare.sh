#!/usr/bin/env bash
# Stages the sources bench_peers needs into the ignored folder .peers/ (carry it whole to the GPU
# machine); it builds nothing:
#   .peers/DeepEP            DeepEP v1's source (setup.py, csrc/, deep_ep/, LICENSE) at DEEPEP_COMMIT
#   .peers/commlib_917fdc0   commlib/ and csrc/ of this repository at the pre-rings commit
#   .peers/wheels/           a ninja wheel, for a build on a machine without ninja, when pip can get one
#
#   bash benchmarks/peers/prepare.sh DEEPEP_GIT_DIR      # a clone (or bare mirror) of deepseek-ai/DeepEP
#
# DEEPEP_COMMIT (default 567632dd, DeepEP's last commit before V2 replaced the v1 layout on main).
# The build recipe, .peers/build_deepep.sh, is not in the repository (docs/peers.md): it is added to
# .peers/ by hand, and kept (with .peers/prebuilt/) when this runs again. Nothing here is committed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEEPEP_GIT=${1:?usage: prepare.sh DEEPEP_GIT_DIR}
COMMIT=${DEEPEP_COMMIT:-567632dd59810d77b3cc05553df953cc0f779799}
OLD=${OLD_COMMIT:-917fdc0}
PEERS=$ROOT/.peers
rm -rf "$PEERS/DeepEP" "$PEERS/commlib_$OLD"
mkdir -p "$PEERS/DeepEP" "$PEERS/commlib_$OLD" "$PEERS/wheels"
git -C "$DEEPEP_GIT" archive "$COMMIT" setup.py csrc deep_ep LICENSE | tar -x -C "$PEERS/DeepEP"
git -C "$DEEPEP_GIT" rev-parse "$COMMIT" >"$PEERS/DeepEP/COMMIT"
git -C "$ROOT" archive "$OLD" commlib csrc | tar -x -C "$PEERS/commlib_$OLD"
if ! compgen -G "$PEERS/wheels/ninja-*.whl" >/dev/null; then
  "${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: -d "$PEERS/wheels" ninja ||
    echo "[prepare] no ninja wheel (the device build then compiles one file at a time unless ninja is there)"
fi
du -sh "$PEERS"/* | sed 's/^/[prepare] /'
