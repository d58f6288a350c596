"""Random-interleaving model of the NVLink engine's ring protocol (one channel): python -m experiments.rings_protocol_model.

Checks: no deadlock (some actor can always step until all are done), a slot is never overwritten
before its row was consumed, every row arrives. Dispatch: round-based sender (copy warps + barrier +
tail publish), receiver in ring mode (per-source groups + head publisher, batch B) or legacy mode
(source-sequential, when no incoming ring wraps). Combine: per-destination sender groups + tail
publisher (batch), receiver warps striding tokens + head publisher (batch).
"""
import random
import sys


def dispatch_model(rng, R, T, cap, round_tokens, W_send, W_recv, head_batch):
    dests = [[set(d for d in range(R) if d != s and rng.random() < 0.6) for _ in range(T[s])] for s in range(R)]
    # rows per (s, d) in token order
    rows = [[[t for t in range(T[s]) if d in dests[s][t]] for d in range(R)] for s in range(R)]
    n = [[len(rows[s][d]) for d in range(R)] for s in range(R)]
    tail = [[0] * R for _ in range(R)]   # published by s for d
    head = [[0] * R for _ in range(R)]   # published by d for s (seen by s)
    ring = [[[None] * cap for _ in range(R)] for _ in range(R)]  # ring[s][d][slot] = row index or None (consumed)
    got = [[[] for _ in range(R)] for _ in range(R)]
    actors = []

    # ---- senders
    for s in range(R):
        st = {"round": 0, "pos": [0] * W_send, "barrier": False, "done": False}
        # token index of row per dest
        idx_of = {}
        cnt = [0] * R
        for t in range(T[s]):
            for d in sorted(dests[s][t]):
                idx_of[(t, d)] = cnt[d]
                cnt[d] += 1
        rounds = [list(range(a, min(a + round_tokens, T[s]))) for a in range(0, T[s], round_tokens)]

        def warp_tokens(r, w, rounds=rounds):
            return [t for k, t in enumerate(rounds[r]) if k % W_send == w]

        def step_sender_warp(w, s=s, st=st, idx_of=idx_of, rounds=rounds, warp_tokens=warp_tokens):
            if st["done"] or st["round"] >= len(rounds):
                return False
            toks = warp_tokens(st["round"], w)
            if st["pos"][w] >= len(toks):
                return False  # at the barrier
            t = toks[st["pos"][w]]
            # all dests must have room (the warp waits lane by lane, then writes)
            for d in dests[s][t]:
                i = idx_of[(t, d)]
                if head[s][d] < i - cap + 1:
                    return False
            for d in dests[s][t]:
                i = idx_of[(t, d)]
                slot = ring[s][d][i % cap]
                assert slot is None, f"dispatch: overwrite of unconsumed row {slot} by {i} (s{s} d{d})"
                ring[s][d][i % cap] = i
            st["pos"][w] += 1
            return True

        def step_sender_pub(s=s, st=st, rounds=rounds, idx_of=idx_of, warp_tokens=warp_tokens):
            if st["done"]:
                return False
            if st["round"] >= len(rounds):
                st["done"] = True
                return True
            if all(st["pos"][w] >= len(warp_tokens(st["round"], w)) for w in range(W_send)):
                # barrier passed: publish tails = rows of tokens before the round's end
                end = rounds[st["round"]][-1] + 1
                for d in range(R):
                    if d != s:
                        tail[s][d] = sum(1 for t in range(end) if d in dests[s][t])
                st["round"] += 1
                st["pos"] = [0] * W_send
                return True
            return False

        for w in range(W_send):
            actors.append(("send", s, w, step_sender_warp, lambda w=w, st=st: False))
        actors.append(("pub", s, -1, lambda w=None, f=step_sender_pub: f(), None))

    # ---- receivers
    for d in range(R):
        srcs = [s for s in range(R) if s != d]
        ring_mode = any(n[s][d] > cap for s in srcs)
        if ring_mode:
            G = len(srcs)
            nxt = {}
            groups = {}
            for w in range(W_recv):
                j = w % G
                groups.setdefault(j, []).append(w)
            for j, ws in groups.items():
                for gr, w in enumerate(ws):
                    nxt[w] = gr

            def step_recv_warp(w, d=d, srcs=srcs, groups=groups, nxt=nxt, G=G):
                j = w % G
                s = srcs[j]
                gs = len(groups[j])
                i = nxt[w]
                if i >= n[s][d]:
                    return False
                if tail[s][d] < i + 1:
                    return False
                v = ring[s][d][i % cap]
                assert v == i, f"dispatch: row {i} from s{s} at d{d} reads {v}"
                ring[s][d][i % cap] = None if True else v
                got[s][d].append(i)
                nxt[w] = i + gs
                return True

            pub = {s: 0 for s in srcs}

            def step_recv_pub(d=d, srcs=srcs, groups=groups, nxt=nxt, pub=pub, G=G):
                moved = False
                for j, s in enumerate(srcs):
                    m = min([nxt[w] for w in groups.get(j, [])] + [n[s][d]])
                    if m - pub[s] >= head_batch or (m == n[s][d] and m > pub[s]):
                        pub[s] = m
                        head[s][d] = m
                        moved = True
                return moved

            for w in range(W_recv):
                actors.append(("recv", d, w, step_recv_warp, None))
            actors.append(("rpub", d, -1, lambda w=None, f=step_recv_pub: f(), None))
        else:
            # legacy: items source after source, strided over warps; no heads (no ring wraps)
            items = [(s, i) for s in srcs for i in range(n[s][d])]
            nxt = {w: w for w in range(W_recv)}

            def step_legacy(w, d=d, items=items, nxt=nxt):
                k = nxt[w]
                if k >= len(items):
                    return False
                s, i = items[k]
                if tail[s][d] < i + 1:
                    return False
                assert ring[s][d][i % cap] == i
                ring[s][d][i % cap] = None
                got[s][d].append(i)
                nxt[w] = k + W_recv
                return True

            for w in range(W_recv):
                actors.append(("legacy", d, w, step_legacy, None))

    steps = 0
    while True:
        order = list(range(len(actors)))
        rng.shuffle(order)
        progressed = False
        for k in order:
            kind, who, w, fn, _ = actors[k]
            if fn(w):
                progressed = True
                steps += 1
                break
        if not progressed:
            break
    for s in range(R):
        for d in range(R):
            if s != d:
                if sorted(got[s][d]) != list(range(n[s][d])):
                    return f"DEADLOCK/LOSS dispatch: s{s}->d{d} got {len(got[s][d])}/{n[s][d]} (cap {cap}, round {round_tokens}, B {head_batch}, T {T})"
    return None


def combine_model(rng, R, T, cap, W_send, W_recv, batch):
    # home h's tokens; each token sent to a set of ranks (its rows come back from them)
    dests = [[set(r for r in range(R) if r != h and rng.random() < 0.6) for _ in range(T[h])] for h in range(R)]
    idx = [[{} for _ in range(R)] for _ in range(R)]  # idx[h][r][t] = row index of token t among r's rows for h
    n = [[0] * R for _ in range(R)]  # n[r][h]: rows r returns to h
    for h in range(R):
        for t in range(T[h]):
            for r in sorted(dests[h][t]):
                idx[h][r][t] = n[r][h]
                n[r][h] += 1
    tail = [[0] * R for _ in range(R)]  # tail[r][h] published by sender r
    head = [[0] * R for _ in range(R)]  # head[r][h] published by receiver h, seen by r
    ring = [[[None] * cap for _ in range(R)] for _ in range(R)]  # ring[r][h]
    done_tokens = [set() for _ in range(R)]
    actors = []
    for r in range(R):
        homes = [h for h in range(R) if h != r]
        G = len(homes)
        groups = {}
        for w in range(W_send):
            groups.setdefault(w % G, []).append(w)
        nxt = {}
        for j, ws in groups.items():
            for gr, w in enumerate(ws):
                nxt[w] = gr
        pub = {h: 0 for h in homes}

        def step_send(w, r=r, homes=homes, groups=groups, nxt=nxt, G=G):
            j = w % G
            h = homes[j]
            i = nxt[w]
            if i >= n[r][h]:
                return False
            if head[r][h] < i - cap + 1:
                return False
            assert ring[r][h][i % cap] is None, f"combine overwrite r{r} h{h} row {i}"
            ring[r][h][i % cap] = i
            nxt[w] = i + len(groups[j])
            return True

        def step_spub(w=None, r=r, homes=homes, groups=groups, nxt=nxt, pub=pub):
            moved = False
            for j, h in enumerate(homes):
                m = min([nxt[x] for x in groups.get(j, [])] + [n[r][h]])
                if m - pub[h] >= batch or (m == n[r][h] and m > pub[h]):
                    pub[h] = m
                    tail[r][h] = m
                    moved = True
            return moved

        for w in range(W_send):
            actors.append((step_send, w))
        actors.append((step_spub, None))

    for h in range(R):
        cur = {w: w for w in range(W_recv)}  # current token of each warp
        pubh = {r: 0 for r in range(R) if r != h}

        def step_recv(w, h=h, cur=cur):
            t = cur[w]
            if t >= T[h]:
                return False
            for r in dests[h][t]:
                i = idx[h][r][t]
                if tail[r][h] < i + 1:
                    return False
                assert ring[r][h][i % cap] == i, f"combine: h{h} token {t} from r{r} row {i} reads {ring[r][h][i % cap]}"
            for r in dests[h][t]:
                ring[r][h][idx[h][r][t] % cap] = None
            done_tokens[h].add(t)
            cur[w] = t + W_recv
            return True

        def step_rpub(w=None, h=h, cur=cur, pubh=pubh):
            tmin = min(min(cur.values()), T[h])
            moved = False
            for r in pubh:
                consumed = sum(1 for t in range(tmin) if r in dests[h][t])
                if consumed - pubh[r] >= batch or (tmin >= T[h] and consumed > pubh[r]):
                    pubh[r] = consumed
                    head[r][h] = consumed
                    moved = True
            return moved

        for w in range(W_recv):
            actors.append((step_recv, w))
        actors.append((step_rpub, None))

    while True:
        order = list(range(len(actors)))
        rng.shuffle(order)
        for k in order:
            fn, w = actors[k]
            if fn(w):
                break
        else:
            break
    for h in range(R):
        if len(done_tokens[h]) != T[h]:
            return f"DEADLOCK combine: h{h} {len(done_tokens[h])}/{T[h]} tokens (cap {cap}, batch {batch}, T {T})"
    return None


def main(rounds: int) -> int:
    rng = random.Random(1)
    bad = 0
    for k in range(rounds):
        R = rng.choice([2, 3, 4])
        cap = rng.choice([1, 2, 3, 4, 8, 16])
        T = [rng.randint(0, 8 * cap + 3) for _ in range(R)]
        round_tokens = min(rng.choice([1, 2, 3, 5, 8]), cap)
        head_batch = max(1, min(32, cap - round_tokens + 1))
        err = dispatch_model(rng, R, T, cap, round_tokens, rng.choice([1, 2, 3]), rng.choice([R - 1, R, 2 * R]),
                             head_batch)
        if err:
            print(err)
            bad += 1
        batch = max(1, min(32, (cap + 1) // 2))
        err = combine_model(rng, R, T, cap, rng.choice([R - 1, R + 1, 2 * R]), rng.choice([1, 2, 3, 5]), batch)
        if err:
            print(err)
            bad += 1
    print(f"{rounds} rounds, {bad} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
