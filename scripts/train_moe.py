"""Train a small MoE transformer with expert parallelism (commlib Buffer + autograd + dual pipeline).

Expert parallel (one process per rank; CPU gloo ranks or GPUs):
    torchrun --nproc-per-node 2 scripts/train_moe.py --steps 50
    torchrun --nproc-per-node 4 scripts/train_moe.py --schedule sequential,dual --json losses.json
The single-process equivalent (all experts local, same parameters by seed, same global batch,
the same bf16 rounding of dispatch/combine emulated for --ranks ranks):
    python scripts/train_moe.py --single-process --ranks 2 --steps 50

Model: token embedding + learned positions, --layers blocks of (causal attention, MoE with a
sigmoid group-limited top-k router, routed SwiGLU experts, a shared expert), final norm, LM head.
Data: sequences from a fixed random sparse bigram language (each token has 4 likely successors),
a fresh global batch every step from (seed, step); rank r trains on rows [r * B, (r + 1) * B).

Parallelism: experts are sharded (rank r holds experts [r * E / R, (r + 1) * E / R)); everything
else is replicated, and its gradients are summed over the ranks with one all-reduce per step.
The loss of a rank is its tokens' summed cross-entropy divided by the global token count, so the
summed gradients are those of the global mean loss, which is what the single-process run computes.

Compiled (``--compile``): the blocks run as plain modules (``staged=False``) whose dispatch and
combine are custom ops (commlib.training.ops), and the whole model is ``torch.compile``d with
``fullgraph=True`` (``--compile-backend``, default inductor; aot_eager runs the same kernels as
eager, so it trains to the same losses bit for bit). Sequential schedule only.

Schedules: ``sequential`` runs the staged model on the rank's batch; ``dual`` splits it into two
micro-batches and runs commlib.training.pipeline.dual_forward_backward (one micro-batch's
dispatch/combine overlapping the other's compute on GPUs; the same arithmetic on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from commlib.training import ops  # noqa: E402
from commlib.training.moe import MoEConfig, MoEModel  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--groups", type=int, default=2, help="expert groups of the group-limited router")
    p.add_argument("--topk-groups", type=int, default=2)
    p.add_argument("--expert-hidden", type=int, default=64)
    p.add_argument("--shared", type=int, default=1, help="shared experts (0 = none)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--schedule", default="sequential",
                   help="comma-separated: sequential, dual (each trains a fresh model from the same seed)")
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch (needs hidden %% 128 == 0)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (fullgraph; sequential only)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend with --compile")
    p.add_argument("--single-process", action="store_true", help="the single-process equivalent")
    p.add_argument("--ranks", type=int, default=2, help="ranks the single-process run stands in for")
    p.add_argument("--json", default=None, help="write {schedule: [loss per step]} and the arguments here")
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def _bigram_table(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 12345)
    logits = torch.full((vocab, vocab), -4.0)
    succ = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(vocab)])
    logits.scatter_(1, succ, torch.randn(vocab, 4, generator=g) + 3.0)
    return torch.softmax(logits, dim=1)


def global_batch(step: int, args, num_ranks: int, table: torch.Tensor) -> torch.Tensor:
    """[num_ranks * batch, seq + 1] int64 token ids for this step (same on every rank)."""
    g = torch.Generator().manual_seed(args.seed * 100003 + step)
    n = num_ranks * args.batch
    toks = torch.empty(n, args.seq + 1, dtype=torch.int64)
    toks[:, 0] = torch.randint(0, args.vocab, (n,), generator=g)
    for s in range(args.seq):
        toks[:, s + 1] = torch.multinomial(table[toks[:, s]], 1, generator=g).squeeze(1)
    return toks


def build_model(args, buffer, num_ranks: int, device) -> MoEModel:
    cfg = MoEConfig(hidden=args.hidden, num_experts=args.experts, topk=args.topk, expert_hidden=args.expert_hidden,
                    num_groups=args.groups, topk_groups=args.topk_groups, num_shared_experts=args.shared,
                    fp8_dispatch=args.fp8)
    torch.manual_seed(args.seed)  # identical parameters on every rank and in the single-process run
    # compiled: plain modules (the staged chain's comm stages are not traceable; the custom ops are)
    return MoEModel(cfg, args.layers, args.heads, buffer=buffer, num_ranks=num_ranks, vocab_size=args.vocab,
                    max_seq_len=args.seq, device=device, staged=not args.compile)


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def train(args, schedule: str, buffer=None, rank: int = 0, num_ranks: int = 1, device=None) -> list[float]:
    """Train one model; returns the global mean loss of every step."""
    from commlib.training import pipeline as P
    device = device or torch.device("cpu")
    ep = buffer is not None
    model = build_model(args, buffer, num_ranks, device)
    replicated = [p for n, p in model.named_parameters() if ".experts." not in n]
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    forward = model
    if args.compile:
        if schedule != "sequential":
            raise ValueError("--compile runs the sequential schedule only")
        forward = torch.compile(model, fullgraph=True, backend=args.compile_backend)
    table = _bigram_table(args.vocab, args.seed)
    losses = []
    for step in range(args.steps):
        toks = global_batch(step, args, num_ranks, table).to(device)
        if ep:
            toks = toks[rank * args.batch:(rank + 1) * args.batch]
        inputs, targets = toks[:, :-1], toks[:, 1:]
        num_global_tokens = num_ranks * args.batch * args.seq
        opt.zero_grad(set_to_none=True)
        if schedule == "dual":
            if not ep:
                raise ValueError("the dual schedule needs expert parallelism (a Buffer)")
            half = inputs.shape[0] // 2
            # both forwards then both backwards, one schedule (micro-batch 0's backward starts beside
            # micro-batch 1's last forward steps)
            l0, l1 = P.dual_forward_backward(
                model, (inputs[:half],), (inputs[half:],),
                criterion=(lambda o: _ce_sum(o, targets[:half]) / num_global_tokens,
                           lambda o: _ce_sum(o, targets[half:]) / num_global_tokens))
            loss = l0 + l1
        elif schedule == "sequential":
            with ops.compile_config():
                logits = forward(inputs)
            if ep:
                loss = _ce_sum(logits, targets) / num_global_tokens
            else:
                # Per virtual rank, summed in rank order: the sums an expert-parallel run makes.
                loss = sum(_ce_sum(lg, tg) / num_global_tokens
                           for lg, tg in zip(logits.chunk(num_ranks), targets.chunk(num_ranks)))
            loss.backward()
            loss = loss.detach()
        else:
            raise ValueError(f"unknown schedule {schedule!r} (sequential or dual)")
        if ep:
            # One all-reduce for every replicated gradient (the loss is already divided globally).
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
            flat = torch.cat([g.flatten() for g in grads] + [loss.reshape(1).to(grads[0].dtype)])
            dist.all_reduce(flat)
            offset = 0
            for p, g in zip(replicated, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(g)
                offset += g.numel()
            loss = flat[-1]
        opt.step()
        losses.append(float(loss))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[train] schedule={schedule} step {step:4d} loss {losses[-1]:.6f}", flush=True)
    return losses


def main(argv=None) -> dict:
    args = parse_args(argv)
    schedules = [s.strip() for s in args.schedule.split(",") if s.strip()]
    t0 = time.time()
    if args.single_process:
        if any(s != "sequential" for s in schedules):
            raise SystemExit("--single-process runs the sequential schedule only")
        if args.compile:
            raise SystemExit("--compile compiles the expert-parallel model (without --single-process)")
        results = {"sequential": train(args, "sequential", None, 0, args.ranks)}
        rank, world = 0, args.ranks
    else:
        from commlib import Buffer
        try:
            from commlib.utils.dist import init_distributed
            group = init_distributed()
        except ImportError:  # older trees: torchrun's environment directly
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            group = dist.group.WORLD
        rank, world = dist.get_rank(), dist.get_world_size()
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        cfg = Buffer.get_dispatch_config(world)
        rpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        hidden_bytes = args.hidden * 2
        buffer = Buffer(group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(hidden_bytes, rpn),
                        num_rdma_bytes=cfg.get_rdma_buffer_size_hint(hidden_bytes, world) if rpn < world else 0)
        results = {s: train(args, s, buffer, rank, world, device) for s in schedules}
    out = {"losses": results, "args": vars(args), "num_ranks": world, "seconds": time.time() - t0}
    if rank == 0:
        print(f"[train] done: {', '.join(f'{s} final loss {v[-1]:.6f}' for s, v in results.items())} "
              f"({out['seconds']:.1f} s)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if not args.single_process:
        dist.destroy_process_group()
    return out


if __name__ == "__main__":
    from commlib.utils.launch import exit_rank
    main()
    exit_rank(0)  # under torchrun this process is a rank: leave without the interpreter's finalization
