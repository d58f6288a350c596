#!/usr/bin/env bash
# Builds DeepEP v1's intranode extension (deep_ep_cpp) for benchmarks.peers.bench_peers, with DeepEP's
# own setup.py, in a build folder of its own; nothing is installed (commlib ships a package named
# deep_ep too: the benchmark loads this build by path, under another name).
#
#   bash benchmarks/peers/build_deepep.sh [SRC] [BUILD]
#
# SRC    DeepEP's source at its last v1 commit (setup.py, csrc/, deep_ep/); default .peers/DeepEP
# BUILD  where it is copied and built in place (build_ext --inplace); default .peers_build/DeepEP.
#        Reused when its stamp (the source files' hashes, the python, torch and nvcc versions) matches.
# Built without NVSHMEM even where a pip nvidia-nvshmem is installed (setup.py then compiles only
# deep_ep.cpp, runtime.cu, layout.cu, intranode.cu and disables the internode and low-latency
# kernels), for sm_90 (TORCH_CUDA_ARCH_LIST=9.0), MAX_JOBS (default 16) parallel compiles, with the
# device-link step an intranode-only build lacks (benchmarks/peers/deepep_setup.py).
# When no ninja is on PATH, a ninja wheel found under SRC/.. (.peers/wheels/) is unpacked next to
# BUILD (torch's extension builder compiles one file at a time without ninja).
# The new build is imported once (DEEPEP_IMPORT_CHECK=0 skips that: the CPU test's fake build).
# Prints "[deepep-build] ..." lines; the last one names the build folder. Exit status 1 on failure.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
SRC=$(cd "${1:-$ROOT/.peers/DeepEP}" && pwd)
BUILD=${2:-${DEEPEP_BUILD_DIR:-$ROOT/.peers_build/DeepEP}}
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")   # the build runs in BUILD
for f in setup.py csrc/deep_ep.cpp csrc/kernels/intranode.cu deep_ep/buffer.py; do
  [[ -f $SRC/$f ]] || { echo "[deepep-build] missing $SRC/$f (export DeepEP v1 there: docs/peers.md)" >&2; exit 1; }
done

stamp() {
  (cd "$SRC" && find . -type f ! -name '*.pyc' | LC_ALL=C sort | xargs sha256sum)
  "$PY" -c "import sys, importlib.metadata as m; print(sys.version.split()[0], m.version('torch'))"
  nvcc --version 2>/dev/null | tail -n 1 || echo "no nvcc"
  sha256sum "$ROOT/benchmarks/peers/deepep_setup.py"
}
so() { compgen -G "$BUILD/deep_ep_cpp*.so" >/dev/null; }
want=$(stamp | sha256sum | cut -c1-16)
if so && [[ -f $BUILD/.stamp && $(cat "$BUILD/.stamp") == "$want" ]]; then
  echo "[deepep-build] reused $BUILD (stamp $want)"
  echo "[deepep-build] ok $BUILD"
  exit 0
fi

if ! command -v ninja >/dev/null 2>&1; then
  wheel=$(compgen -G "$SRC/../wheels/ninja-*.whl" | head -n 1 || true)
  if [[ -n $wheel ]]; then
    tools="$(dirname "$BUILD")/tools"
    "$PY" -m pip install -q --no-index --no-deps --target "$tools" "$wheel" >&2
    export PATH="$tools/bin:$PATH" PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"
    echo "[deepep-build] ninja from $(basename "$wheel")"
  else
    echo "[deepep-build] no ninja: torch compiles the sources one at a time (slow)"
  fi
fi

"$PY" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" ||
  { echo "[deepep-build] $PY has no Python.h (python3-dev): the extension cannot build" >&2; exit 1; }
# torch's CUDA headers include cusparse.h & co.: from the toolkit, else from the pip CUDA packages
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")")}
if [[ ! -f $cuda_home/include/cusparse.h ]]; then
  inc=$("$PY" -c "import glob, os, site; print(':'.join(d for b in site.getsitepackages() for d in glob.glob(os.path.join(b, 'nvidia', '*', 'include')) + glob.glob(os.path.join(b, 'nvidia', '*', '*', 'include'))))")
  [[ -n $inc ]] && export CPATH="$inc${CPATH:+:$CPATH}"
  echo "[deepep-build] no cusparse.h in $cuda_home/include: CPATH gets the pip CUDA packages' headers (${inc:-none found})"
fi

rm -rf "$BUILD"
mkdir -p "$BUILD"
cp -r "$SRC/." "$BUILD/"
cd "$BUILD"
t0=$(date +%s)
echo "[deepep-build] building $SRC in $BUILD (MAX_JOBS=${MAX_JOBS:-16}, sm_90, no NVSHMEM)"
# DeepEP's setup.py, NVSHMEM hidden and its device-link step added (deepep_setup.py says why)
env -u NVSHMEM_DIR TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="${MAX_JOBS:-16}" "$PY" "$ROOT/benchmarks/peers/deepep_setup.py"
so || { echo "[deepep-build] no deep_ep_cpp*.so in $BUILD after the build" >&2; exit 1; }
if [[ ${DEEPEP_IMPORT_CHECK:-1} == 1 ]]; then   # undefined symbols show here, not in the benchmark
  "$PY" -c "import torch, deep_ep_cpp; print('[deepep-build] import ok:', deep_ep_cpp.__file__)" ||
    { echo "[deepep-build] the built extension does not import" >&2; exit 1; }
fi
echo "$want" >"$BUILD/.stamp"
echo "[deepep-build] built in $(( $(date +%s) - t0 )) s: $(cd "$BUILD" && ls deep_ep_cpp*.so)"
echo "[deepep-build] ok $BUILD"
