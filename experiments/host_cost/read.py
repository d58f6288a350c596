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
               chunk geometry (``exchange.parse_digest`` + ``geometry.geometry``): the engine's path

Run: python -m experiments.host_cost.read [--reps 20] [--json [PATH]]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from commlib.backends.internode import kernels as IK
from commlib.backends.internode.exchange import INTERNODE_SIG_FIELDS, N_SIG, exchange_digest, parse_digest, row_len
from commlib.backends.internode.geometry import geometry
from commlib.cuda.loader import cupy_available
from experiments import write_json

# (nodes, ranks per node, experts, network chunk cap): V3's 256 experts from 2 GPUs to EP256
TOPOLOGIES = [(2, 1, 256, 1), (8, 8, 256, 4), (32, 8, 256, 4)]


def _rows(M: int, P: int, Kc: int, E: int, device: torch.device) -> tuple:
    """Gathered rows every rank agrees on, with random counts; (g, sig)."""
    R = M * P
    sig = list(range(1, len(INTERNODE_SIG_FIELDS) + 1))
    g = torch.randint(0, 60, (R, row_len(R, M, P, Kc, E)), generator=torch.Generator().manual_seed(R),
                      dtype=torch.int64)
    g[:, 0], g[:, 1:N_SIG], g[:, N_SIG + R:N_SIG + R + 2] = 0, torch.tensor(sig), 0
    return g.to(device), sig


def _after_exchange(g: torch.Tensor, M: int, P: int, Kc: int, E: int, ring: int, on_device: bool) -> None:
    """Rank 0's host path after the exchange: the digest (one launch, or its torch spec), its read,
    its decode and the chunk geometry."""
    kw = dict(n_sig=N_SIG, me=0, node=0, loc=0, M=M, P=P, Kc=Kc, ring=ring, Lx=E // (M * P))
    if on_device:
        digest = torch.empty(IK.digest_len(M, P, Kc, kw["Lx"]), dtype=torch.int64, device=g.device)
        IK.digest(g, digest, **kw)
    else:
        digest = exchange_digest(g, **kw)
    geometry("device", parse_digest(digest.cpu().tolist(), M, P, Kc, kw["Lx"]), ring, Kc)


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
        g, sig = _rows(M, P, Kc, E, device)
        on_device = device.type == "cuda" and cupy_available()
        engine = lambda: _after_exchange(g, M, P, Kc, E, 64, on_device)
        whole = _us(lambda: g.cpu().tolist(), a.reps)
        digest = _us(engine, a.reps)
        print(f"  {f'{M} x {P}':>17} {E:>4} {Kc:>3} {g.numel():>9} {whole:>11.1f} {digest:>9.1f}")
        rows.append({"op": f"read_{M}x{P}", "nodes": M, "ranks_per_node": P, "experts": E, "chunks": Kc,
                     "row_ints": g.numel(), "whole_rows_us": round(whole, 1), "digest_us": round(digest, 1),
                     "digest_on_device": on_device})
    if a.json:
        write_json("host_cost_read", argv, rows, 1, a.json, module="experiments.host_cost.read")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
