"""Megatron-Core's MoELayer on commlib: its flex dispatcher with the DeepEP backend (``import deep_ep``
is commlib) against its own alltoall dispatcher, the same layer, weights and inputs, in one run.

    python -m benchmarks.megatron_moe --json benchmarks/results     # 2 ranks (one GPU: under MPS), BF16
    python -m benchmarks.megatron_moe --cpu                         # 2 gloo CPU ranks, small shapes

Each rank builds two MoELayers from the same TransformerConfig but ``moe_token_dispatcher_type``
("alltoall" / "flex" with ``moe_flex_dispatcher_backend="deepep"``), expert parallel = world size, the
local (non-TransformerEngine) spec: TopKRouter and SequentialMLP of ColumnParallel / RowParallel
linears, SwiGLU. Both get the same global weights (every rank draws them from one seed and loads its
experts' share) and the same inputs; one forward and backward each with the same output gradient.
Checked: the output, the input gradient, the router's and every local expert's weight gradients of
flex against alltoall, within BF16 tolerance (``close``); ``wrong`` counts the elements outside it,
summed over ranks. Timed (GPU: CUDA events, L2 flushed, median of --iters, slowest rank): forward,
and forward + backward, of each layer in the same run.

Megatron here runs eagerly (its ``jit_fuser`` torch.compile is switched off in the ranks, for both
layers alike) and its GEMMs are torch's (no TransformerEngine). With two ranks on one GPU under CUDA
MPS the device times are "HBM loopback", never NVLink. Needs megatron-core (0.16 or 0.19: the
carried wheel on the device, docs/deep_ep.md) and torch; nothing else of Megatron's optional set.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import shlex
import sys
import types

import torch
import torch.distributed as dist

from commlib.bench import results
from commlib.utils.timing import bench_cuda, slowest

DISPATCHERS = ("alltoall", "flex")
# BF16 tolerance: two bf16 roundings apart (2 * 2^-8 relative) on top of an absolute floor at 1% of
# the tensor's largest magnitude (sums reassociated between the dispatchers).
RTOL, ATOL_FRAC = 2 ** -7, 1e-2
PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
_PREPARED: list | None = None   # what prepare_megatron changed in this process


@dataclasses.dataclass(frozen=True)
class Shape:
    """One MoE layer and its inputs: ``tokens`` per rank (a list: one count per rank), ``hidden``,
    expert FFN size ``ffn``, ``experts`` in all, ``topk`` per token; optional token dropping, and
    ``pre_softmax`` (softmax over all experts, then top-k; Megatron requires it for top-1)."""
    tokens: tuple
    hidden: int
    ffn: int
    experts: int
    topk: int
    capacity_factor: float | None = None
    pre_softmax: bool = False


GPU_SHAPE = Shape(tokens=(4096, 4096), hidden=7168, ffn=1024, experts=32, topk=8)
CPU_SHAPE = Shape(tokens=(48, 40), hidden=128, ffn=64, experts=8, topk=4)


def megatron_available() -> bool:
    """Is megatron-core installed (found without importing it: its import costs seconds)?"""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def _megatron_has(module: str) -> bool:
    """Does the installed megatron ship ``module`` (a file under its namespace package; nothing of
    megatron.core is imported to find out)?"""
    from pathlib import Path

    spec = importlib.util.find_spec("megatron")
    rel = Path(*module.split(".")[1:]).with_suffix(".py")
    return spec is not None and any((Path(p) / rel).is_file() for p in spec.submodule_search_locations or ())


# ------------------------------------------------------------------ running Megatron here
class _HostStream:
    """Stands in for torch.cuda.Stream / Event on a CPU rank: every wait is already satisfied."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass


def prepare_megatron() -> list:
    """What this process changes so Megatron-Core's MoE layer runs here, before its first import;
    returns the changes' names. Megatron's files stay as they are; only this process is patched.

    - ``no_jit_fuser``: Megatron wraps small fusions in torch.compile at import; dynamo is switched off
      (both dispatchers run the same eager code; no compiler on CPU ranks or device time spent on it).
    - ``paged_stash_without_triton``: 0.19 imports triton unguarded for its paged-stash kernels (not on
      the MoELayer path); without triton that one module is replaced by one whose kernels raise.
    - CPU only (no CUDA): ``cuda_stream_on_host`` (the alltoall dispatcher makes a torch.cuda.Stream
      for its device-to-host copies, and the router moves a CPU weight to torch.cuda.current_device()),
      ``splits_as_numpy`` (the alltoall dispatcher turns its split sizes into numpy arrays only when
      they are CUDA tensors; gloo's all_to_all_single needs lists), ``router_gemm_without_te``
      (0.16.1's router gating reads te_general_gemm, undefined without TransformerEngine).
    """
    global _PREPARED
    if _PREPARED is not None:   # once per process
        return list(_PREPARED)
    import torch._dynamo

    done = _PREPARED = []
    torch._dynamo.config.disable = True
    done.append("no_jit_fuser")
    if importlib.util.find_spec("triton") is None and PAGED_STASH not in sys.modules and _megatron_has(PAGED_STASH):
        stub = types.ModuleType(PAGED_STASH)

        def _needs_triton(*args, **kwargs):
            raise RuntimeError("Megatron's paged-stash kernels need triton (not installed)")

        stub.GLOBAL_BLOCK_SIZE = 1024
        stub.paged_stash_copy_kernel = stub.paged_stash_pop_kernel = _needs_triton
        sys.modules[PAGED_STASH] = stub
        done.append("paged_stash_without_triton")
    if not torch.cuda.is_available():
        host = _HostStream()
        torch.cuda.Stream = _HostStream
        torch.cuda.current_stream = lambda device=None: host
        torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
        torch.cuda.current_device = lambda: torch.device("cpu")
        done.append("cuda_stream_on_host")
        from megatron.core.transformer.moe import moe_utils, token_dispatcher

        def splits_to_host(t, as_numpy=False, record_stream=False):
            return t.numpy() if as_numpy and torch.is_tensor(t) else t

        token_dispatcher.maybe_move_tensor_to_cpu = splits_to_host
        done.append("splits_as_numpy")
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
            done.append("router_gemm_without_te")
    return list(done)


def init_expert_parallel(world_size: int) -> None:
    """Megatron's parallel state: expert parallel = the world, no tensor / pipeline parallelism."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=world_size,
                                                 create_gloo_process_groups=False)


def build_layer(dispatcher: str, shape: Shape, device: torch.device, num_sms: int | None = None):
    """A Megatron MoELayer (local spec: SequentialMLP, no TransformerEngine) with ``dispatcher``:
    "alltoall", or "flex" on the DeepEP backend. BF16 parameters, FP32 router."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=8, ffn_hidden_size=shape.ffn,
        moe_ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts, moe_router_topk=shape.topk,
        moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend="deepep",
        moe_router_dtype="fp32", moe_router_load_balancing_type="none",
        moe_expert_capacity_factor=shape.capacity_factor, moe_router_pre_softmax=shape.pre_softmax,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        params_dtype=torch.bfloat16, bf16=True, perform_initialization=False,
        use_cpu_initialization=device.type == "cpu",
        **({"moe_flex_dispatcher_num_sms": num_sms} if num_sms else {}))
    spec = get_moe_module_spec(use_te=False, num_experts=shape.experts, moe_grouped_gemm=False)
    return spec(config=cfg)


def global_weights(shape: Shape, seed: int) -> dict:
    """Every expert's weights and the router's, the same on every rank (FP32, from ``seed``):
    router [E, H], fc1 [E, 2F, H] (gate rows then up rows), fc2 [E, H, F]."""
    g = torch.Generator().manual_seed(seed)
    E, H, F = shape.experts, shape.hidden, shape.ffn
    return {"router": torch.randn(E, H, generator=g) * H ** -0.5,
            "fc1": torch.randn(E, 2 * F, H, generator=g) * H ** -0.5,
            "fc2": torch.randn(E, H, F, generator=g) * F ** -0.5}


def load_weights(layer, weights: dict, ep_rank: int, device: torch.device):
    """Copy the global weights into ``layer``: the router whole, experts ep_rank*L .. ep_rank*L+L-1."""
    experts = layer.experts.local_experts
    L = len(experts)
    with torch.no_grad():
        layer.router.weight.data = weights["router"].to(layer.router.weight.dtype)
        for i, mlp in enumerate(experts):
            mlp.linear_fc1.weight.copy_(weights["fc1"][ep_rank * L + i])
            mlp.linear_fc2.weight.copy_(weights["fc2"][ep_rank * L + i])
    return layer.to(device)


def rank_inputs(shape: Shape, seed: int, rank: int) -> tuple:
    """(x [T, 1, H], dy [T, 1, H]) BF16 of ``rank``, on the CPU (any rank can draw any rank's)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T = shape.tokens[rank]
    return (torch.randn(T, 1, shape.hidden, generator=g).bfloat16(),
            torch.randn(T, 1, shape.hidden, generator=g).bfloat16())


def step(layer, x, dy, backward: bool = True, collect: bool = True) -> dict | None:
    """One forward (and backward with output gradient ``dy``): out, dx, router and expert weight grads
    (fc1 [L, 2F, H], fc2 [L, H, F]); None without ``collect`` (timing: no copies of the grads)."""
    for p in layer.parameters():
        p.grad = None
    xg = x.detach().requires_grad_(backward)
    out, bias = layer(xg)
    assert bias is None, "the local spec has no expert bias"
    if backward:
        out.backward(dy)
    if not collect:
        return None
    if not backward:
        return {"out": out.detach()}
    experts = layer.experts.local_experts
    return {"out": out.detach(), "dx": xg.grad, "router": layer.router.weight.grad,
            "fc1": torch.stack([m.linear_fc1.weight.grad for m in experts]),
            "fc2": torch.stack([m.linear_fc2.weight.grad for m in experts])}


def close(got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL, atol_frac: float = ATOL_FRAC) -> dict:
    """How far ``got`` is from ``want``: elements outside |got - want| <= atol + rtol * |want| (atol
    = atol_frac * max |want|), the largest difference, and whether they are bit for bit equal."""
    g, w = got.float(), want.float()
    if g.shape != w.shape:
        return {"wrong": max(g.numel(), w.numel()), "max_abs": float("inf"), "exact": False,
                "shape": [list(g.shape), list(w.shape)]}
    diff = (g - w).abs()
    atol = atol_frac * (float(w.abs().max()) if w.numel() else 0.0)
    bad = ~(diff <= atol + rtol * w.abs())   # NaN counts as wrong
    return {"wrong": int(bad.sum()), "max_abs": float(diff.max()) if diff.numel() else 0.0,
            "scale": float(w.abs().max()) if w.numel() else 0.0, "exact": bool(torch.equal(got, want))}


# ------------------------------------------------------------------ the benchmark
def worker(ctx, args: dict) -> dict:
    import os

    on_gpu = ctx.device.type == "cuda"
    if on_gpu:
        os.environ["COMMLIB_RANKS_PER_NODE"] = str(ctx.world_size)   # one node (NCCL sees emulated hosts)
    shims = prepare_megatron()
    from megatron.core.transformer.moe import fused_a2a

    assert fused_a2a.HAVE_DEEP_EP, "megatron's fused_a2a found no deep_ep"
    import deep_ep

    assert fused_a2a.Buffer is deep_ep.Buffer and deep_ep.__implementation__ == "commlib"
    shape = Shape(**args["shape"])
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    init_expert_parallel(R)
    weights = global_weights(shape, args["seed"])
    layers = {d: load_weights(build_layer(d, shape, dev, args.get("num_sms")), weights, me, dev)
              for d in DISPATCHERS}
    x, dy = (t.to(dev) for t in rank_inputs(shape, args["seed"], me))
    got = {d: step(layers[d], x, dy) for d in DISPATCHERS}
    checks = {k: close(got["flex"][k], got["alltoall"][k]) for k in got["alltoall"]}
    wrong = results.reduce_wrong([c["wrong"] for c in checks.values()], ctx.group)
    exact = slowest([0.0 if c["exact"] else 1.0 for c in checks.values()], ctx.group)
    max_abs = slowest([c["max_abs"] for c in checks.values()], ctx.group)
    rows = []
    for (name, c), w, ex, m in zip(checks.items(), wrong, exact, max_abs):
        rows.append({"op": f"check_{name}", "tensor": name, "max_abs": m, "exact": ex == 0.0,
                     **results.checked_fields(w)})
    timing = {}
    for d in DISPATCHERS:
        for mode, bwd in (("fwd", False), ("fwd_bwd", True)):
            t = bench_cuda(lambda: step(layers[d], x, dy, backward=bwd, collect=False), warmup=args["warmup"], iters=args["iters"])
            timing[(d, mode)] = slowest([t["median_us"]], ctx.group)[0]
    for mode in ("fwd", "fwd_bwd"):
        for d in DISPATCHERS:
            row = {"op": f"{d}_{mode}", "dispatcher": d, "mode": mode, "time_us": timing[(d, mode)],
                   "tokens": shape.tokens[0], "checked": False}
            if d == "flex":
                row.update(baseline_op=f"alltoall_{mode}", speedup=timing[("alltoall", mode)] / timing[(d, mode)])
            rows.append(row)
    buf = fused_a2a._buffer
    return {"rows": rows, "shims": shims, "engine": getattr(buf, "backend_name", None),
            "num_sms": deep_ep.Buffer.num_sms, "device": str(dev)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo CPU ranks and the small CPU shape")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, help="tokens per rank (default: 4096 GPU, 48 / 40 CPU)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int, help="expert FFN size")
    p.add_argument("--experts", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--num-sms", type=int, help="moe_flex_dispatcher_num_sms (Megatron's default: 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", help="folder (or .json file) for the result; 'auto': benchmarks/results")
    return p.parse_args(argv)


def print_table(out: dict, shape: Shape, note: str) -> None:
    print(f"# megatron_moe: MoELayer alltoall vs flex (deep_ep = commlib, engine {out['engine']}, "
          f"{out['num_sms']} SMs); {note}")
    print(f"# tokens/rank {list(shape.tokens)}, hidden {shape.hidden}, ffn {shape.ffn}, {shape.experts} experts, "
          f"top-{shape.topk}, BF16; Megatron patched here: {', '.join(out['shims'])}")
    print(f"# {'op':>18} {'time_us':>11} {'vs alltoall':>11}")
    for r in out["rows"]:
        if "time_us" in r:
            ratio = f"{r['speedup']:.3f}x" if "speedup" in r else "-"
            print(f"  {r['op']:>18} {r['time_us']:11.1f} {ratio:>11}")
    print(f"# {'check (flex vs alltoall)':>24} {'max_abs':>10} {'exact':>6} {'#wrong':>7}")
    for r in out["rows"]:
        if r["op"].startswith("check_"):
            print(f"  {r['tensor']:>24} {r['max_abs']:10.3g} {str(r['exact']):>6} {results.wrong_cell(r):>7}")
    print(results.check_footer(out["rows"]))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not megatron_available():
        print("# megatron_moe: megatron-core is not installed (pip install --no-deps megatron-core; docs/deep_ep.md)")
        return 2
    from commlib.utils.launch import parallel_launch

    cuda = torch.cuda.is_available() and not args.cpu
    base = CPU_SHAPE if not cuda else GPU_SHAPE
    R = args.ranks
    tokens = (args.tokens,) * R if args.tokens else tuple(base.tokens[r % len(base.tokens)] for r in range(R))
    shape = dataclasses.replace(base, tokens=tokens, **{k: getattr(args, k) for k in ("hidden", "ffn", "experts", "topk")
                                                         if getattr(args, k)})
    spec = {"shape": dataclasses.asdict(shape), "seed": args.seed, "iters": args.iters, "warmup": args.warmup,
            "num_sms": args.num_sms}
    # NCCL between processes that may share a GPU: each rank its own emulated host for NCCL; the
    # worker tells commlib the ranks are one node, so the flex layer runs on the NVLink engine.
    launch = dict(use_gpu=True, group_backend="nccl", emulate_hosts=True, ranks_per_node=1) if cuda else {}
    out = parallel_launch(R, worker, spec, timeout_s=900, **launch)
    gpus = torch.cuda.device_count() if cuda else 0
    note = ("HBM loopback (ranks share one GPU under MPS; alltoall's NCCL crosses its socket transport "
            "between the emulated hosts, flex goes through commlib's one-node engine)" if cuda and gpus < R
            else f"{R} GPUs, alltoall's NCCL between emulated hosts" if cuda
            else "CPU ranks (gloo): times are host times, not a performance figure")
    print_table(out, shape, note)
    if args.json:
        doc = results.result_document("megatron_moe", "python -m benchmarks.megatron_moe " + shlex.join(
            sys.argv[1:] if argv is None else argv), out["rows"], world_size=R, mode=note, shape=dataclasses.asdict(shape),
            engine=out["engine"], num_sms=out["num_sms"], megatron=_megatron_version(), patched=out["shims"],
            tolerance={"rtol": RTOL, "atol_frac_of_max": ATOL_FRAC})
        print(f"# wrote {results.write_result(doc, None if args.json == 'auto' else args.json)}")
    return results.exit_status(out["rows"])


def _megatron_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
