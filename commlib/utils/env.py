"""Every ``COMMLIB_*`` environment variable is read here, and only here.

Variables:
  COMMLIB_BACKEND          auto | reference | nvlink | internode   (default auto)
  COMMLIB_RANKS_PER_NODE   ranks per (emulated) node; overrides the launcher's local size
  COMMLIB_TIMEOUT_S        seconds any host or device wait may take before raising (default 100)
  COMMLIB_NUM_SMS          default SM budget for Buffer.set_num_sms (default 20)
  COMMLIB_DEBUG_SMID       1: communication kernels record %smid per CTA
  COMMLIB_PLAIN_LDST       1: kernels use plain loads/stores instead of the PTX cache hints
  COMMLIB_FAST_LAUNCH      0: launch kernels through CuPy instead of cuLaunchKernel via ctypes (default 1)
  COMMLIB_TUNING_CACHE     path of the tuning cache JSON file
  COMMLIB_AUTOTUNE         1: tune on first use when no cached config exists
  COMMLIB_KERNEL_CACHE     folder for compiled code: the C++ call path's builds go to its callpath/ (default
                           $XDG_CACHE_HOME/commlib or ~/.cache/commlib); NVRTC kernels stay in CuPy's cache
  COMMLIB_CALLPATH         auto | cpp | python: the NVLink engine's repeated calls through csrc/callpath.cpp (built at
                           first use; auto falls back to the Python call path with a warning where it cannot be built
                           or loaded, cpp raises there) or through Python (default auto)
  COMMLIB_CALLPATH_INTERNODE_DISPATCH  0: the internode engine's non-cached dispatches stay in Python (default 1:
                           its C++ call path runs them whole where they fit: the kernels with one rank per node or
                           the forwarder, top-k)
  COMMLIB_GIT_COMMIT       commit to record in results where the tree has no .git (device runs)
  COMMLIB_ISSUE_ORDER      auto | comm_first | compute_first: issue order of the dual pipeline's pairs
  COMMLIB_SM_CARVEOUT      auto | off | N: SMs the dual pipeline keeps GEMMs off while it overlaps (default auto)
  COMMLIB_DEFER_WGRAD      0: the dual pipeline's backward computes the expert weight gradients in place (default 1: B / W split)
  COMMLIB_MOE_ROW_KERNEL   0: the expert stage sums a row's slots with torch's float32 index_add (default 1: one-pass
                           kernel csrc/moe_rows.cu on CUDA bf16 rows)
  COMMLIB_CE_BYTES         N > 0: the nvlink backend moves dispatch / combine rows with the copy engines through an
                           N-byte CUDA IPC staging per rank (csrc/ce.cu; default 0: SM kernels)
  COMMLIB_CE_SMS           CTAs of the copy-engine path's packing and summing kernels (default 0: the call's
                           Config.num_sms, at least half the GPU's SMs), rounded up to whole COMM_CLUSTER clusters
  COMMLIB_CE_PREPACK       0: Buffer.prepack returns None, every copy-engine dispatch packs its rows on the comm stream
                           (default 1: the dual pipeline packs them on the compute stream, right after the step
                           that made them, with every SM)
  COMMLIB_CE_DEFER_SUM     1: a host-staged copy-engine combine asked to finish later (the dual pipeline's) leaves its
                           sum to PendingCombine.finish(), on the consumer's stream (default 0: measured neutral)
  COMMLIB_CE_STAGING       device | host: where the copy-engine path's staging lives (default device: CUDA IPC over
                           NVLink); host: pinned host memory shared by the ranks' processes, so rows cross PCIe
                           twice (the path of GPUs without peer access, and of a NIC's DMA)
  COMMLIB_NETWORK_CHUNKS   internode engine: most network chunks a dispatch / combine streams in (default 4)
  COMMLIB_FANOUT_WINDOW_ROWS  internode engine's forwarder: N > 0 lands a num_worst_tokens dispatch N rows per
                           window at most (tests; default 0: windows only where its rows would outgrow the areas)
  COMMLIB_DEBUG_NETWORK_STALL_MS  internode engine: N > 0 sleeps a random 0..N ms before each network chunk is
                           posted and landed (tests of the chunk protocol; default 0)
  COMMLIB_DEEP_EP_QUIET    1: ``import deep_ep`` (commlib's compatibility package) logs nothing (default: one
                           INFO line on the ``deep_ep`` logger naming commlib and its version)
"""
from __future__ import annotations

import os


def _get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def _int(name: str, default: int) -> int:
    raw = _get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not an integer") from e


def _float(name: str, default: float) -> float:
    raw = _get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not a number") from e


def _flag(name: str) -> bool:
    return (_get(name, "0") or "0").lower() in ("1", "true", "yes", "on")


def _flag_on(name: str) -> bool:
    """A switch that is on unless set to 0 / false / no / off."""
    return (_get(name, "1") or "1").lower() not in ("0", "false", "no", "off")


def backend() -> str:
    value = (_get("COMMLIB_BACKEND", "auto") or "auto").lower()
    if value not in ("auto", "reference", "nvlink", "internode"):
        raise ValueError(f"COMMLIB_BACKEND={value!r}: expected auto, reference, nvlink or internode")
    return value


def ranks_per_node() -> int | None:
    """Ranks per node from COMMLIB_RANKS_PER_NODE, else the launcher (torchrun, Open MPI, MPICH)."""
    for name in ("COMMLIB_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"):
        raw = _get(name)
        if raw:
            try:
                value = int(raw)
            except ValueError as e:
                raise ValueError(f"{name}={raw!r} is not an integer") from e
            if value <= 0:
                raise ValueError(f"{name}={raw!r} must be positive")
            return value
    return None


def timeout_s() -> float:
    value = _float("COMMLIB_TIMEOUT_S", 100.0)
    if value <= 0:
        raise ValueError(f"COMMLIB_TIMEOUT_S={value} must be positive")
    return value


def num_sms() -> int:
    return _int("COMMLIB_NUM_SMS", 20)


def debug_smid() -> bool:
    return _flag("COMMLIB_DEBUG_SMID")


def debug_smid_slots() -> int:
    """Launches per kind whose %smid words (and COMM_TRACE points) are kept (COMMLIB_DEBUG_SMID_SLOTS,
    default 1: the last launch only). More slots let a run collect the trace of every launch of a
    schedule without a sync between them (``trace_history``)."""
    value = _int("COMMLIB_DEBUG_SMID_SLOTS", 1)
    if not 1 <= value <= 4096:
        raise ValueError(f"COMMLIB_DEBUG_SMID_SLOTS={value} must be in 1 .. 4096")
    return value


def plain_ldst() -> bool:
    return _flag("COMMLIB_PLAIN_LDST")


def fast_launch() -> bool:
    return _flag_on("COMMLIB_FAST_LAUNCH")


def tuning_cache() -> str | None:
    return _get("COMMLIB_TUNING_CACHE")


def autotune() -> bool:
    return _flag("COMMLIB_AUTOTUNE")


def kernel_cache() -> str | None:
    return _get("COMMLIB_KERNEL_CACHE")


def callpath() -> str:
    v = (_get("COMMLIB_CALLPATH", "") or "auto").strip().lower()
    if v not in ("auto", "cpp", "python"):
        raise ValueError(f"COMMLIB_CALLPATH={v!r}: expected auto, cpp or python")
    return v


def callpath_internode_dispatch() -> bool:
    return _flag_on("COMMLIB_CALLPATH_INTERNODE_DISPATCH")


def callpath_cache_dir() -> str:
    """Where builds of the C++ call path are kept: COMMLIB_KERNEL_CACHE/callpath, else
    $XDG_CACHE_HOME/commlib/callpath (~/.cache/commlib/callpath)."""
    root = kernel_cache() or os.path.join(_get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                                          "commlib")
    return os.path.join(root, "callpath")


def git_commit() -> str | None:
    return _get("COMMLIB_GIT_COMMIT") or None


def issue_order() -> str:
    return _get("COMMLIB_ISSUE_ORDER", "") or "auto"


def sm_carveout() -> str:
    return (_get("COMMLIB_SM_CARVEOUT", "") or "auto").lower()


def defer_wgrad() -> bool:
    return _flag_on("COMMLIB_DEFER_WGRAD")


def moe_row_kernel() -> bool:
    return _flag_on("COMMLIB_MOE_ROW_KERNEL")


def ce_bytes() -> int:
    n = _int("COMMLIB_CE_BYTES", 0)
    if n < 0:
        raise ValueError(f"COMMLIB_CE_BYTES={n}: must be >= 0 (0: the SM kernels move the rows)")
    return n


def ce_staging() -> str:
    v = (_get("COMMLIB_CE_STAGING", "") or "device").lower()
    if v not in ("device", "host"):
        raise ValueError(f"COMMLIB_CE_STAGING={v!r}: must be device or host")
    return v


def ce_prepack() -> bool:
    return _flag_on("COMMLIB_CE_PREPACK")


def ce_defer_sum() -> bool:
    return _flag("COMMLIB_CE_DEFER_SUM")


def ce_sms() -> int:
    n = _int("COMMLIB_CE_SMS", 0)
    if n < 0:
        raise ValueError(f"COMMLIB_CE_SMS={n}: must be >= 0 (0: the call's Config.num_sms, at least half the GPU's SMs)")
    return n


def deep_ep_quiet() -> bool:
    return _flag("COMMLIB_DEEP_EP_QUIET")


def node_fanout() -> str:
    v = os.environ.get("COMMLIB_NODE_FANOUT", "kernel").strip().lower() or "kernel"
    if v not in ("kernel", "nccl"):
        raise ValueError(f"COMMLIB_NODE_FANOUT={v!r}: expected kernel or nccl")
    return v


def internode_kernels() -> bool:
    """COMMLIB_INTERNODE_KERNELS (default on): the internode engine's per-token steps as kernels."""
    return _flag_on("COMMLIB_INTERNODE_KERNELS")


def network_chunks() -> int:
    n = _int("COMMLIB_NETWORK_CHUNKS", 4)
    if not 1 <= n <= 64:
        raise ValueError(f"COMMLIB_NETWORK_CHUNKS={n} must be in 1 .. 64")
    return n


def fanout_window_rows() -> int:
    n = _int("COMMLIB_FANOUT_WINDOW_ROWS", 0)
    if n < 0:
        raise ValueError(f"COMMLIB_FANOUT_WINDOW_ROWS={n} must be >= 0")
    return n


def debug_network_stall_ms() -> float:
    v = _float("COMMLIB_DEBUG_NETWORK_STALL_MS", 0.0)
    if v < 0:
        raise ValueError(f"COMMLIB_DEBUG_NETWORK_STALL_MS={v} must be >= 0")
    return v
