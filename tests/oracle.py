"""An independent single-process oracle: from every rank's inputs, what each rank must get.

Written with plain Python loops over tokens (no code shared with commlib's backends), so a bug
in the library's vectorised code cannot hide in the oracle.
"""
from __future__ import annotations

import torch


def ranks_of_token(topk_row, num_experts: int, num_ranks: int) -> list[int]:
    per = num_experts // num_ranks
    return sorted({int(e) // per for e in topk_row if int(e) >= 0})


def dispatch_oracle(xs, topk_idxs, topk_ws, num_experts: int, num_ranks: int, me: int, alignment: int = 1):
    """xs[r]: [T_r, H] (any dtype); returns dict with recv rows and metadata for rank ``me``."""
    per = num_experts // num_ranks
    rows, src_idx, src_rank, tk, tw = [], [], [], [], []
    counts = [[0] * num_ranks for _ in range(num_ranks)]
    for s in range(num_ranks):
        for t in range(xs[s].shape[0]):
            dests = ranks_of_token(topk_idxs[s][t].tolist(), num_experts, num_ranks)
            for d in dests:
                counts[s][d] += 1
            if me not in dests:
                continue
            rows.append(xs[s][t])
            src_idx.append(t)
            src_rank.append(s)
            ids = []
            ws = []
            for k, e in enumerate(topk_idxs[s][t].tolist()):
                if e >= 0 and e // per == me:
                    ids.append(e - me * per)
                    ws.append(float(topk_ws[s][t][k]) if topk_ws is not None else 0.0)
                else:
                    ids.append(-1)
                    ws.append(0.0)
            tk.append(ids)
            tw.append(ws)
    H = xs[me].shape[1]
    K = topk_idxs[me].shape[1]
    recv_x = torch.stack(rows) if rows else torch.empty(0, H, dtype=xs[me].dtype)
    per_expert = [0] * per
    for ids in tk:
        for e in ids:
            if e >= 0:
                per_expert[e] += 1
    per_expert = [(c + alignment - 1) // alignment * alignment for c in per_expert]
    prefix = [[0] * num_ranks for _ in range(num_ranks)]
    for i in range(num_ranks):
        for j in range(num_ranks):
            prefix[i][j] = counts[i][j] + (prefix[i - 1][j] if i else 0)
    return {
        "recv_x": recv_x,
        "recv_src_idx": torch.tensor(src_idx, dtype=torch.int32),
        "recv_src_rank": torch.tensor(src_rank, dtype=torch.int32),
        "recv_topk_idx": torch.tensor(tk, dtype=torch.int64).view(-1, K),
        "recv_topk_weights": torch.tensor(tw, dtype=torch.float32).view(-1, K),
        "per_expert": per_expert,
        "rank_prefix_matrix": torch.tensor(prefix, dtype=torch.int32),
        "counts": counts,
    }


def combine_oracle(ys_by_rank, srcs_by_rank, num_tokens: int, hidden: int, me: int, ranks_per_node: int,
                   num_ranks: int, biases=(), dtype=torch.bfloat16):
    """ys_by_rank[r]: [N_r, H] rows rank r returns; srcs_by_rank[r]: list of (src_rank, src_idx).

    One node: acc = sum over ranks in rank order (float32). Several nodes: per node, sum in local
    order and round to bf16; then sum the node partials in node order. Then + biases, cast.
    """
    num_nodes = num_ranks // ranks_per_node
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    # rows of each token, by rank
    rows = [dict() for _ in range(num_ranks)]
    for r in range(num_ranks):
        for i, (s, t) in enumerate(srcs_by_rank[r]):
            if s == me:
                rows[r][t] = ys_by_rank[r][i].float()
    for t in range(num_tokens):
        if num_nodes == 1:
            acc = torch.zeros(hidden, dtype=torch.float32)
            for r in range(num_ranks):
                if t in rows[r]:
                    acc = acc + rows[r][t]
        else:
            acc = torch.zeros(hidden, dtype=torch.float32)
            for n in range(num_nodes):
                part = torch.zeros(hidden, dtype=torch.float32)
                hit = False
                for p in range(ranks_per_node):
                    r = n * ranks_per_node + p
                    if t in rows[r]:
                        part = part + rows[r][t]
                        hit = True
                if hit:
                    acc = acc + part.to(torch.bfloat16).float()
        out[t] = acc
    for b in biases:
        out = out + b.float()
    return out.to(dtype)


def combine_weights_oracle(ws_by_rank, srcs_by_rank, num_tokens: int, K: int, me: int, ranks_per_node: int,
                           num_ranks: int):
    num_nodes = num_ranks // ranks_per_node
    rows = [dict() for _ in range(num_ranks)]
    for r in range(num_ranks):
        for i, (s, t) in enumerate(srcs_by_rank[r]):
            if s == me:
                rows[r][t] = ws_by_rank[r][i]
    out = torch.zeros(num_tokens, K, dtype=torch.float32)
    for t in range(num_tokens):
        acc = torch.zeros(K, dtype=torch.float32)
        for n in range(num_nodes):
            part = torch.zeros(K, dtype=torch.float32)
            for p in range(ranks_per_node):
                r = n * ranks_per_node + p
                if t in rows[r]:
                    part = part + rows[r][t]
            acc = acc + part if num_nodes > 1 else part
        out[t] = acc
    return out


def min_internode_rows(topk_idxs, num_experts: int, num_ranks: int, ranks_per_node: int) -> int:
    """Rows that must cross between nodes: one per (token, other node it needs)."""
    total = 0
    for s in range(num_ranks):
        home = s // ranks_per_node
        for t in range(topk_idxs[s].shape[0]):
            nodes = {r // ranks_per_node for r in ranks_of_token(topk_idxs[s][t].tolist(), num_experts, num_ranks)}
            total += len(nodes - {home})
    return total
