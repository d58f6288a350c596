"""The exception types every layer raises, and which errors leave the CUDA context unusable."""
from __future__ import annotations


class CommlibError(RuntimeError):
    """A failure inside communication (timeout, peer mismatch, use after destroy)."""


class KernelLaunchError(RuntimeError):
    """cuLaunchKernel returned an error; ``code`` is its CUresult."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = int(code)


# CUDA error codes (the driver's CUresult and the runtime's cudaError_t agree on these) after which
# the context is unusable: a kernel faulted, trapped or asserted, or the memory is corrupt.
STICKY_CUDA_ERRORS = frozenset({
    214,   # ECC uncorrectable
    700,   # illegal address
    702,   # launch timeout
    710,   # device-side assert
    714,   # hardware stack error
    715,   # illegal instruction
    716,   # misaligned address
    717,   # invalid address space
    718,   # invalid program counter
    719,   # launch failure (a trap)
})


def is_device_failure(e: BaseException) -> bool:
    """True for a CUDA or driver failure that poisons the context (a faulted or trapped kernel, a
    device-side assert); False for host-side errors, whatever their message says."""
    import torch

    if isinstance(e, KernelLaunchError):
        return e.code in STICKY_CUDA_ERRORS
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(e, accelerator):
        code = getattr(e, "error_code", None)
        return code is None or int(code) in STICKY_CUDA_ERRORS
    return False
