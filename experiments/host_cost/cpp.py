"""What the same host work costs from Python and from C++ on this host, warm and cold (one GPU).

The internode engine's device path spends its host time in many small torch operations (allocations,
views, launches), each cheap in a tight loop and 3-10x dearer inside a call (``host_cost_calls``).
Before moving any of it to C++, this measures the gain on the machine itself: a torch C++ extension
built here (its build time is reported: a fresh device machine pays it once) against the same
operations from Python, for

  outputs   the device dispatch's per-call tensors: four outputs, one int32 arena and its seven views
  launch    one small kernel (csrc/internode.cu's recv_chan) through commlib's loader, against the
            same ``cuLaunchKernel`` from C++ with the same arguments
  noop      one call into the extension (the crossing alone)

each ``warm`` (back to back) and ``cold`` (a Python workload that sweeps 64 MB and runs unrelated
code between calls, as a call's other steps do). Median of ``--reps`` calls.

Run: python -m experiments.host_cost.cpp [--reps 200] [--json DIR]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch

from experiments import write_json

SOURCE = r"""
#include <torch/extension.h>
#include <cuda.h>
#include <c10/cuda/CUDAStream.h>

std::vector<at::Tensor> outputs(int64_t n, int64_t H, int64_t K, int64_t T, int64_t R, int64_t M, int64_t C,
                                int64_t dev) {
  auto o = at::TensorOptions().device(at::kCUDA, dev);
  std::vector<at::Tensor> out;
  out.push_back(at::empty({n, H}, o.dtype(at::kBFloat16)));
  out.push_back(at::empty({n, K}, o.dtype(at::kLong)));
  out.push_back(at::empty({n, K}, o.dtype(at::kFloat)));
  out.push_back(at::empty({n, 8}, o.dtype(at::kFloat)));
  std::vector<std::vector<int64_t>> shapes = {{R, R}, {R, C}, {R, C}, {T, R}, {T, M}, {n}, {0}};
  int64_t total = 0;
  for (auto& s : shapes) { int64_t k = 1; for (auto d : s) k *= d; total += k; }
  auto arena = at::empty({total}, o.dtype(at::kInt));
  int64_t at_ = 0;
  for (auto& s : shapes) {
    int64_t k = 1; for (auto d : s) k *= d;
    out.push_back(arena.narrow(0, at_, k).view(s));
    at_ += k;
  }
  return out;
}

void launch(int64_t fn, int64_t grid, int64_t block, std::vector<int64_t> ptrs, std::vector<int64_t> ints,
            std::vector<int64_t> order) {
  // order[i] >= 0: pointer ptrs[order[i]]; < 0: int ints[-order[i] - 1]
  std::vector<uint64_t> p(ptrs.begin(), ptrs.end());
  std::vector<int32_t> v(ints.begin(), ints.end());
  std::vector<void*> args;
  for (auto i : order) args.push_back(i >= 0 ? (void*)&p[i] : (void*)&v[-i - 1]);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  CUresult rc = cuLaunchKernel((CUfunction)fn, grid, 1, 1, block, 1, 1, 0, (CUstream)stream, args.data(), nullptr);
  TORCH_CHECK(rc == CUDA_SUCCESS, "cuLaunchKernel failed: ", (int)rc);
}

void noop() {}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("outputs", &outputs);
  m.def("launch", &launch);
  m.def("noop", &noop);
}
"""


def _py_outputs(n, H, K, T, R, M, C, dev):
    out = [torch.empty(n, H, dtype=torch.bfloat16, device=dev), torch.empty(n, K, dtype=torch.int64, device=dev),
           torch.empty(n, K, dtype=torch.float32, device=dev), torch.empty(n, 8, dtype=torch.float32, device=dev)]
    shapes = [(R, R), (R, C), (R, C), (T, R), (T, M), (n,), (0,)]
    sizes = [math.prod(s) for s in shapes]
    arena = torch.empty(sum(sizes), dtype=torch.int32, device=dev)
    at = 0
    for s, k in zip(shapes, sizes):
        out.append(arena[at:at + k].view(s))
        at += k
    return out


_sweep = np.ones(64 << 20, dtype=np.uint8)
_doc = {f"k{i}": [i, str(i), {"v": i * 1.5}] for i in range(400)}


def _cold() -> None:
    """What a call's other steps do to the caches: touch 64 MB, run unrelated Python."""
    _sweep[::64].sum()
    json.loads(json.dumps(_doc))


def _median_us(fn, reps: int, cold: bool) -> float:
    out = []
    for _ in range(reps):
        if cold:
            _cold()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost_cpp: needs a GPU")
        return 0
    from torch.utils.cpp_extension import load_inline

    from commlib.backends.internode import kernels as IK
    from commlib.cuda import loader

    t0 = time.perf_counter()
    ext = load_inline("commlib_host_cost_cpp", [SOURCE], functions=None, extra_ldflags=["-lcuda"], with_cuda=True,
                      extra_cflags=["-O2"], verbose=False)
    build_s = time.perf_counter() - t0
    print(f"# host_cost_cpp: extension built and loaded in {build_s:.1f} s")
    dev = torch.cuda.current_device()
    n, H, K, T, R, M, C = 4000, 7168, 8, 4096, 2, 2, 24
    src = torch.zeros(n, dtype=torch.int32, device="cuda")
    g = torch.zeros(R, 64, dtype=torch.int64, device="cuda")
    chan = torch.empty(R, C, dtype=torch.int32, device="cuda")
    IK.recv_chan(src, g, chan, n_sig=8, me=0)   # builds and caches the launcher
    torch.cuda.synchronize()
    lau = next(v for k, v in loader._launchers.items() if k[1] == "inter_recv_chan_kernel")
    ptrs = [src.data_ptr(), g.data_ptr(), chan.data_ptr()]
    ints = [64, 8, 0, R, C]
    order = [0, 1, -1, -2, -3, -4, -5, 2]
    cases = {
        "outputs": (lambda: _py_outputs(n, H, K, T, R, M, C, "cuda"), lambda: ext.outputs(n, H, K, T, R, M, C, dev)),
        "launch": (lambda: IK.recv_chan(src, g, chan, n_sig=8, me=0),
                   lambda: ext.launch(lau.handle, 1, IK.RECV_CHAN_THREADS, ptrs, ints, order)),
        "noop": (lambda: None, ext.noop),
    }
    rows = []
    print(f"# {'case':>8} {'mode':>5} {'python us':>10} {'c++ us':>8} {'ratio':>6}")
    for name, (py, cc) in cases.items():
        for mode in ("warm", "cold"):
            for _ in range(20):
                py(), cc()
            torch.cuda.synchronize()
            a_us = _median_us(py, a.reps, mode == "cold")
            b_us = _median_us(cc, a.reps, mode == "cold")
            torch.cuda.synchronize()
            print(f"# {name:>8} {mode:>5} {a_us:>10.1f} {b_us:>8.1f} {a_us / max(b_us, 1e-9):>6.1f}")
            rows.append({"op": f"{name}_{mode}", "python_us": round(a_us, 2), "cpp_us": round(b_us, 2)})
    if a.json:
        write_json("host_cost_cpp", argv, rows, 1, a.json, module="experiments.host_cost.cpp", build_s=round(build_s, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
