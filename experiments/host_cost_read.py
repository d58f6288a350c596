"""Host time of a non-cached internode dispatch between its count exchange and its first data step, by
world size: what the host does with the gathered rows. One process, synthetic gathered rows.

The count exchange gathers a row of n_sig + R + 2 + M + M Kc P + E + 1 ints from every rank. Reading
all R rows and walking them on the host grows with R x (R + E): at EP256 (32 nodes x 8, 256
experts, Kc = 4) that walk and the chunk geometry took 11 ms of Python on the development machine.
The engine reads their digest instead (``exchange_digest``; one launch on the device steps), which
grows with nodes, ranks per node and experts per rank. Rows:

  whole_rows   the gathered rows to the host as lists (``g.cpu().tolist()``): what any host walk of
               the whole rows pays before it starts
  digest       the digest (kernel on a GPU with CuPy, else torch ops), its read, its decode and the
               chunk geometry (``_read_counts`` + ``_geometry``): the engine's path

Run: python -m experiments.host_cost_read [--reps 20] [--json [PATH]]
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from commlib.backends.internode import INTERNODE_SIG_FIELDS, InternodeBackend
from commlib.cuda.loader import cupy_available
from experiments import write_json

# (nodes, ranks per node, experts, network chunk cap): V3's 256 experts from 2 GPUs to EP256
TOPOLOGIES = [(2, 1, 256, 1), (8, 8, 256, 4), (32, 8, 256, 4)]


def _backend(M: int, P: int, Kc: int, device: torch.device) -> InternodeBackend:
    """An internode backend with only what the host path after the exchange reads (rank 0)."""
    be = InternodeBackend.__new__(InternodeBackend)
    be.topology = SimpleNamespace(rank=0, num_ranks=M * P, num_nodes=M, ranks_per_node=P, node=0, local_rank=0)
    be.max_chunks, be.host_reads, be.host_read_s, be.host_read_usage, be._head_busy = Kc, 0, 0.0, None, False
    be.device_steps = device.type == "cuda" and cupy_available()
    be.sig_fields, be.ctx = INTERNODE_SIG_FIELDS, SimpleNamespace(max_nodes_per_token=4)
    return be


def _rows(be: InternodeBackend, E: int, device: torch.device) -> tuple:
    """Gathered rows every rank agrees on, with random counts; (g, sig, n_sig)."""
    R = be.topology.num_ranks
    sig = list(range(1, len(INTERNODE_SIG_FIELDS) + 1))
    n_sig = 1 + len(sig)
    g = torch.randint(0, 60, (R, be._row_len(E)), generator=torch.Generator().manual_seed(R), dtype=torch.int64)
    g[:, 0], g[:, 1:n_sig], g[:, n_sig + R:n_sig + R + 2] = 0, torch.tensor(sig), 0
    return g.to(device), sig, n_sig


def _us(fn, reps: int, per: int = 10) -> float:
    """Median over ``reps`` batches of the mean host us of ``per`` calls (each ends in a host read)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        out.append((time.perf_counter() - t0) / per * 1e6)
    return statistics.median(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    print(f"host us after the count exchange, per dispatch (rank 0, {device}):")
    print(f"  {'nodes x per node':>17} {'E':>4} {'Kc':>3} {'row ints':>9} {'whole_rows':>11} {'digest':>9}")
    for M, P, E, Kc in TOPOLOGIES:
        be = _backend(M, P, Kc, device)
        g, sig, n_sig = _rows(be, E, device)
        ring = 64

        def engine():
            be._geometry(be._read_counts(g, be._digest(g, E, n_sig, ring), sig, n_sig, E), ring)
        whole = _us(lambda: g.cpu().tolist(), a.reps)
        digest = _us(engine, a.reps)
        print(f"  {f'{M} x {P}':>17} {E:>4} {Kc:>3} {g.numel():>9} {whole:>11.1f} {digest:>9.1f}")
        rows.append({"op": f"read_{M}x{P}", "nodes": M, "ranks_per_node": P, "experts": E, "chunks": Kc,
                     "row_ints": g.numel(), "whole_rows_us": round(whole, 1), "digest_us": round(digest, 1),
                     "digest_on_device": be.device_steps})
    if a.json:
        write_json("host_cost_read", argv, rows, 1, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
