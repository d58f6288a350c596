"""CPU emulation for DeepEP V2's own test files: they run, unchanged, on CPU ranks (gloo) against commlib.

Active only when DEEPEP_V2_CPU=1 (tests/test_deepep_v2_files.py sets it for the test processes only).
It changes the environment the tests run in, never the tests or the library under test:
  (a) every torch call given a CUDA device (a 'cuda' string, a torch.device, as device= or as the
      target of Tensor.to) gets the CPU instead, and Tensor.cuda() returns the tensor (a TorchFunctionMode);
  (b) torch.cuda.synchronize and torch.cuda._sleep do nothing (there is no device to wait for);
  (c) dist.all_to_all_single moves tensors of dtypes gloo has no kernel for (float8) as raw bytes.
deep_ep.utils.envs.init_dist (commlib's) takes gloo and the CPU where CUDA is absent.
"""
import os
import sys


def _log(msg):
    sys.stderr.write(f"[v2 cpu pid {os.getpid()}] {msg}\n")


def _install():
    import functools

    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    def is_cuda(d):
        if isinstance(d, str):
            return d.startswith("cuda")
        return isinstance(d, torch.device) and d.type == "cuda"

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple("cpu" if is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    CudaToCpu().__enter__()  # for the life of the process
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda._sleep = lambda *a, **k: None

    raw_alltoall = dist.all_to_all_single

    @functools.wraps(raw_alltoall)
    def all_to_all_single(output, input, *args, **kwargs):
        if output.element_size() == 1 and output.is_floating_point():
            output, input = output.view(torch.uint8), input.view(torch.uint8)
        return raw_alltoall(output, input, *args, **kwargs)

    dist.all_to_all_single = all_to_all_single
    _log("cuda -> cpu for torch calls; synchronize/_sleep no-ops; fp8 all_to_all_single as bytes")


if os.environ.get("DEEPEP_V2_CPU") == "1":
    _install()
