"""nccl-tests-style bandwidth benchmark: commlib dispatch / combine vs plain all_to_all_single.

Run it under either launcher (one process per GPU, or CPU processes on gloo):

    mpirun -np 4 python -m benchmarks.alltoall_perf -b 128 -e 4096 -f 2
    torchrun --nproc-per-node 8 -m benchmarks.alltoall_perf -b 128 -e 4K -f 2 -n 20 -w 5

(scripts/launch_mpirun.sh and scripts/launch_torchrun.sh add the usual flags.) Under MPI the
Buffer is built from the communicator, ``Buffer(group=None, comm=MPI.COMM_WORLD)``, which sets
up torch.distributed; under torchrun from the launcher's environment (``commlib.utils.dist``).

For every token count from -b to -e (times -f each step) and every op, one row:
  size   bytes per rank: rows received x row bytes for dispatch (local rows included), rows sent
         back for combine (mean over ranks)
  count  tokens per rank
  time   the slowest rank's median over -n timed iterations (CUDA events, L2 flushed before each)
  algbw  size / time;  busbw = algbw x (n-1)/n, as nccl-tests defines it for all-to-all
  #wrong elements that differ from the oracle (commlib.bench.oracle, summed over ranks); -c 0
         skips the comparison and the column reads N/A. Exit status 1 when a compared row is wrong.
Ops: dispatch (BF16; FP8 with --fp8), dispatch_cached (handle reused, how DeepEP measures),
combine, and the baseline a2a_dispatch / a2a_combine (count exchange + permute +
all_to_all_single + unpermute, what Megatron's all-to-all dispatcher does).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import socket
import sys

import torch
import torch.distributed as dist

from commlib.bench import main as bench
from commlib.bench import results
from commlib.bench.main import OPS, Workload
from commlib.topology import Topology

OP_GROUPS = {
    "dispatch": ["dispatch_bf16"],
    "dispatch_cached": ["dispatch_bf16_cached"],
    "combine": ["combine"],
    "a2a": ["a2a_dispatch_bf16", "a2a_combine"],
}
TITLES = {
    "dispatch_bf16": "commlib dispatch, BF16 (layout + dispatch: the full call)",
    "dispatch_bf16_cached": "commlib dispatch, BF16, cached handle (no layout, no count exchange)",
    "dispatch_fp8": "commlib dispatch, FP8 E4M3 + scales (full call)",
    "combine": "commlib combine, BF16",
    "a2a_dispatch_bf16": "baseline: count exchange + permute + all_to_all_single, BF16",
    "a2a_dispatch_fp8": "baseline: count exchange + permute + all_to_all_single, FP8 + scales",
    "a2a_combine": "baseline: all_to_all_single back + unpermute (sum), BF16",
}
PERF_COLUMNS = [
    ("size", "(B)", "bytes", 13, ".0f"),
    ("count", "(tokens)", "tokens", 14, "d"),
    ("type", "", "type", 8, ""),
    ("time", "(us)", "time_us", 11, ".1f"),
    ("algbw", "(GB/s)", "algbw_gbps", 9, "bw"),
    ("busbw", "(GB/s)", "busbw_gbps", 9, "bw"),
    ("#wrong", "", "wrong", 8, ""),
    ("vs_a2a", "(x)", "speedup", 9, ".2f"),
]


def _tokens(text: str) -> int:
    """'4096', '4K' / '4k' (x1024)."""
    t = text.strip()
    scale = 1
    if t[-1:] in ("k", "K"):
        t, scale = t[:-1], 1024
    value = int(t) * scale
    if value <= 0:
        raise argparse.ArgumentTypeError(f"token count must be positive, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("-b", "--min-tokens", type=_tokens, default=128 if gpu else 32, help="first token count per rank")
    p.add_argument("-e", "--max-tokens", type=_tokens, default=4096 if gpu else 256, help="last token count per rank")
    p.add_argument("-f", "--step-factor", type=int, default=2, help="multiply the token count by this each step")
    p.add_argument("-n", "--iters", type=int, default=20 if gpu else 5, help="timed iterations per row")
    p.add_argument("-w", "--warmup-iters", type=int, default=5 if gpu else 1, help="untimed warm-up iterations")
    p.add_argument("-c", "--check", type=int, default=1, help="1: verify every row against the oracle")
    p.add_argument("--hidden", type=int, default=7168 if gpu else 1024)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="expert groups of the group-limited gate")
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--op", default="dispatch,dispatch_cached,combine,a2a",
                   help="comma list of: dispatch, dispatch_cached, combine, a2a (default: all)")
    p.add_argument("--fp8", action="store_true", help="add FP8 dispatch rows (commlib and baseline)")
    p.add_argument("--backend", default=None, help="auto | reference | nvlink (default: COMMLIB_BACKEND)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between timed runs")
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="write results: a .json file, or a folder for the standard name (default: "
                        "benchmarks/results/alltoall_perf_<gpu>x<n>_<yyyymmdd>_<commit>.json)")
    args = p.parse_args(argv)
    if args.step_factor < 2:
        p.error("-f must be >= 2")
    if args.max_tokens < args.min_tokens:
        p.error("-e must be >= -b")
    ops = []
    for name in args.op.split(","):
        name = name.strip()
        if name not in OP_GROUPS:
            p.error(f"--op: unknown op {name!r} (choose from {', '.join(OP_GROUPS)})")
        ops += OP_GROUPS[name]
    if args.fp8:
        if "dispatch_bf16" in ops:
            ops.insert(ops.index("dispatch_bf16") + 1, "dispatch_fp8")
        if "a2a_dispatch_bf16" in ops:
            ops.insert(ops.index("a2a_dispatch_bf16") + 1, "a2a_dispatch_fp8")
    args.ops = ops
    return args


def token_counts(args) -> list[int]:
    counts, t = [], args.min_tokens
    while t <= args.max_tokens:
        counts.append(t)
        t *= args.step_factor
    return counts


def _under_mpi() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"))


def setup(args):
    """(buffer, reference buffer or None, group): from torchrun's env, else the MPI communicator."""
    from commlib.buffer import Buffer

    if ("RANK" in os.environ and "MASTER_ADDR" in os.environ) or not _under_mpi():
        from commlib.utils.dist import init_distributed
        group = init_distributed()
        rank, size, comm = dist.get_rank(group), dist.get_world_size(group), None
    else:
        from mpi4py import MPI
        comm, group = MPI.COMM_WORLD, None
        rank, size = comm.Get_rank(), comm.Get_size()
    topo = Topology.detect(rank, size)
    nvl, rdma = bench.buffer_bytes(args.hidden, size, topo.ranks_per_node, topo.num_nodes)
    buf = Buffer(group, nvl, rdma, comm=comm, backend=args.backend)
    ref = None
    if args.check and buf.backend_name != "reference":
        ref = Buffer(buf.group, nvl, rdma, backend="reference")
    return buf, ref, buf.group


def main(argv=None) -> int:
    args = parse_args(argv)
    buf, ref, group = setup(args)
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    topo = buf.topology
    base = Workload(0, args.hidden, args.experts, args.topk, args.groups, args.topk_groups, args.seed)
    base.validate(R)
    counts = token_counts(args)

    where = [None] * R
    dist.all_gather_object(where, (rank, os.getpid(), socket.gethostname(), str(buf.device)), group=group)
    if rank == 0:
        print("# commlib alltoall_perf: dispatch / combine vs all_to_all_single")
        print(f"#  ranks {R} ({topo.num_nodes} node{'s' if topo.num_nodes > 1 else ''} x {topo.ranks_per_node})"
              f"  backend {buf.backend_name}  process group {dist.get_backend(group)}"
              f"  launcher {'mpirun' if _under_mpi() else 'torchrun/env'}")
        print(f"#  tokens {counts[0]} .. {counts[-1]} (x{args.step_factor})  hidden {args.hidden}  top-{args.topk} of "
              f"{args.experts} experts ({args.topk_groups}/{args.groups} groups)  iters {args.iters}"
              f"  warm-up {args.warmup_iters}  check {args.check}"
              f"{'  (+ bit-exact vs reference backend)' if ref is not None else ''}")
        print("#  busbw = algbw x (n-1)/n; time = slowest rank's median; size = mean bytes per rank")
        print("#")
        for r, pid, host, dev in where:
            print(f"#  Rank {r:3d} Group  0 Pid {pid:7d} on {host:>12} device {dev}")
        print("#", flush=True)

    rows: list[dict] = []
    mine: list[dict] = []  # this rank's rows: their #wrong is already summed over the ranks
    for T in counts:
        per_rank = bench.measure(buf, ref, group, base.with_tokens(T), args.ops, args.iters, args.warmup_iters,
                                 check=bool(args.check), flush_l2=not args.no_flush)
        mine += per_rank
        table = bench.gather(per_rank, group)
        if rank == 0:
            rows += table
            print(f"# {T} tokens done", flush=True)
    total_wrong = results.total_wrong(mine)

    if rank == 0:
        for op in args.ops:
            op_rows = [r for r in rows if r["op"] == op]
            print("#")
            print(f"# op: {op} -- {TITLES[op]}")
            for line in bench.nccl_table(op_rows, PERF_COLUMNS if OPS[op][2] else PERF_COLUMNS[:-1]):
                print(line)
        commlib_rows = [r for r in rows if OPS[r["op"]][0] == "commlib"]
        print("#")
        for r in commlib_rows:
            if "speedup" in r:
                print(f"# vs baseline: {r['op']:<22} {r['tokens']:>6} tokens  {r['speedup']:6.2f}x "
                      f"({r['baseline_op']} {r['speedup'] * r['time_us']:.1f} us -> {r['time_us']:.1f} us)")
        avg = sum(r["busbw_gbps"] for r in commlib_rows) / len(commlib_rows) if commlib_rows else 0.0
        print(results.check_footer(rows))
        print(f"# Avg bus bandwidth    : {avg:.4g} (commlib rows)")
        if args.json is not None:
            command = " ".join(shlex.quote(a) for a in ["-m", "benchmarks.alltoall_perf"] + (sys.argv[1:] if argv is None else argv))
            if _under_mpi():
                launch = f"mpirun -np {R} python"
            else:
                launch = (f"torchrun --nnodes {os.environ.get('GROUP_WORLD_SIZE', 1)} "
                          f"--nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', R)}")
            doc = bench.result_document(
                "alltoall_perf", f"{launch} {command}", rows,
                workload={**dataclasses.asdict(base), "num_tokens": counts}, world_size=R,
                ranks_per_node=topo.ranks_per_node, num_nodes=topo.num_nodes, backend=buf.backend_name,
                process_group=dist.get_backend(group), iters=args.iters, warmup=args.warmup_iters,
                check=args.check, total_wrong=total_wrong if args.check else None)
            print(f"# wrote {results.write_result(doc, args.json)}", flush=True)
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)
    buf.destroy()
    if ref is not None:
        ref.destroy()
    dist.destroy_process_group()
    return results.exit_status(mine)


if __name__ == "__main__":
    from commlib.utils.launch import exit_rank
    exit_rank(main())
