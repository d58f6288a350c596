"""SMs kept free of GEMMs while the overlapped schedules run (torch's experimental SM carveout)."""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from commlib.training.pipeline.stages import CommStage
from commlib.utils import env


def resolve_sm_carveout(value, stages: Iterable = ()) -> int:
    """SMs the overlapped schedules keep GEMMs off.

    Args:
      value: None ($COMMLIB_SM_CARVEOUT, default "auto"); "auto" = the most SMs any comm stage among
        ``stages`` occupies per call (its Config's num_sms, else the Buffer's); "off" or 0 = none;
        an int (or its string) = that many.
      stages: the schedule's stages (only CommStages count).
    Returns:
      the SM count (int >= 0). Raises ValueError for anything else.
    """
    if value is None:
        value = env.sm_carveout()
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return max((s.comm_sms() for s in stages if isinstance(s, CommStage)), default=0)
        if v in ("off", "none", "0"):
            return 0
        try:
            value = int(v)
        except ValueError:
            raise ValueError(f"pipeline: sm_carveout must be 'auto', 'off' or an SM count, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"pipeline: sm_carveout must be 'auto', 'off' or an SM count >= 0, got {value!r}")
    return value


@contextlib.contextmanager
def carveout_phases(device: Optional[torch.device] = None):
    """Yields set(num_sms): from now on torch's GEMMs keep off ``num_sms`` SMs (<= 0: the value
    before); returns the count set. The value before is restored on exit. A no-op on CPU or where
    torch lacks the setting (set returns 0)."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if device is None or device.type != "cuda" or setter is None or getter is None:
        yield lambda num_sms: 0
        return
    total = torch.cuda.get_device_properties(device).multi_processor_count
    previous = getter()

    def set_(num_sms: int) -> int:
        if num_sms <= 0:
            setter(previous)
            return 0
        n = min(int(num_sms), total - 1)
        setter(n)
        return n

    try:
        yield set_
    finally:
        setter(previous)


@contextlib.contextmanager
def sm_carveout(num_sms: int, device: Optional[torch.device] = None):
    """While active, the GEMMs torch launches (cuBLAS, the CUTLASS grouped GEMM behind
    ``torch._grouped_mm``) size their grids for all SMs but ``num_sms`` (torch's experimental SM
    carveout, process-wide; the previous value is restored on exit).

    DeepSeek-V3's point: persistent GEMM kernels hold every SM until they finish, so a communication
    kernel queued beside one waits for SMs, and a GEMM sized for every SM runs a second wave on the
    SMs the comm kernels hold; with the carveout, the ``num_sms`` SMs stay free of GEMM CTAs. The
    default cuBLAS path honours it, so the BLAS library is left alone. Alone, a GEMM may lose to
    wave quantization (experiments/bench_gemm_carveout.py measures it).

    Args:
      num_sms: SMs to keep free (<= 0: a no-op).
      device: the CUDA device whose SM count bounds it (None or CPU: a no-op).
    Yields:
      the SM count set (0 where nothing was set: CPU, torch without the setting).
    """
    if num_sms <= 0:
        yield 0
        return
    with carveout_phases(device) as set_:
        yield set_(num_sms)
