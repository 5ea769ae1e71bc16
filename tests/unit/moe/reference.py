# SPDX-License-Identifier: Apache-2.0
"""Plain-torch references for MoE tests: gating written token by token, and a model with every expert on one rank.

The gating reference follows the rules stated in deepspeed/moe/sharded_moe.py's docstring with
Python loops over tokens and experts, sharing no code with the runtime: softmax probabilities,
top choices on probabilities, capacity ``min(S, max(ceil(k S / E * cf), min_capacity))``,
position order for top-1 and top-2 (second choices after all first choices), best-probability
order for top-k, renormalised weights for top-2 and top-k, the aux loss and the counts.
"""

import math

import torch
import torch.nn.functional as F


def capacity(S, E, k, cf, min_capacity):
    return max(1, min(S, max(int(math.ceil(k * S / E * cf)), int(min_capacity))))


def reference_routes(logits, k, cf, min_capacity):
    """``(routes, C, l_aux, exp_counts)``; ``routes[s]`` a list of ``(expert, location, weight)`` kept for token s."""
    logits = logits.float()
    S, E = logits.shape
    gates = F.softmax(logits, dim=1)
    C = capacity(S, E, k, cf, min_capacity)
    if k <= 2:
        choices = []
        for s in range(S):
            order = sorted(range(E), key=lambda e: -gates[s, e].item())
            choices.append(order[:k])
        routes = [[] for _ in range(S)]
        fill = [0] * E
        for j in range(k):  # all first choices, then all second choices, in token order
            for s in range(S):
                e = choices[s][j]
                if fill[e] < C:
                    routes[s].append((e, fill[e], gates[s, e].item()))
                fill[e] += 1
        if k == 2:
            for s in range(S):
                total = sum(w for _, _, w in routes[s])
                routes[s] = [(e, loc, w / max(total, torch.finfo(torch.float32).eps)) for e, loc, w in routes[s]]
        first = [choices[s][0] for s in range(S)]
        ce = torch.tensor([first.count(e) / S for e in range(E)])
        l_aux = float((gates.mean(0) * ce).sum() * E)
        counts = [sum(choices[s].count(e) for s in range(S)) for e in range(E)]
        return routes, C, l_aux, counts
    choices = [sorted(range(E), key=lambda e: -gates[s, e].item())[:k] for s in range(S)]
    keep = set()
    for e in range(E):
        takers = sorted((s for s in range(S) if e in choices[s]), key=lambda s: -gates[s, e].item())
        keep.update((s, e) for s in takers[:C])
    routes = [[] for _ in range(S)]
    fill = [0] * E
    for s in range(S):
        kept = [e for e in choices[s] if (s, e) in keep]
        total = sum(gates[s, e].item() for e in kept)
        for e in sorted(kept):
            routes[s].append((e, None, gates[s, e].item() / max(total, torch.finfo(torch.float32).eps)))
    for s in range(S):  # locations: kept routes of an expert in token order
        placed = []
        for e, _, w in routes[s]:
            placed.append((e, fill[e], w))
            fill[e] += 1
        routes[s] = placed
    share = torch.tensor([sum(e in choices[s] for s in range(S)) / S for e in range(E)])
    l_aux = float((gates.mean(0) * share).sum() * E / k)
    counts = [sum(e in choices[s] for s in range(S)) for e in range(E)]
    return routes, C, l_aux, counts


def dense_combine(routes, S, E, C):
    combine = torch.zeros(S, E, C)
    for s in range(S):
        for e, loc, w in routes[s]:
            combine[s, e, loc] += w
    return combine


def reference_moe_output(x, gate_weight, experts, k, cf, min_capacity):
    """The MoE output of tokens ``x`` ``[S, d]`` with every expert in ``experts`` (a list), and ``l_aux``.

    The router is ``x.float() @ gate_weight.float().T``; the output keeps ``x``'s dtype.
    """
    logits = x.float() @ gate_weight.float().t()
    S = x.shape[0]
    gates = F.softmax(logits, dim=1)
    routes, _, _, _ = reference_routes(logits.detach(), k, cf, min_capacity)
    out = torch.zeros(S, experts[0](x[:1]).shape[-1], dtype=x.dtype)
    rows = []
    for s in range(S):
        acc = torch.zeros_like(out[0])
        kept = routes[s]
        if kept:
            if k == 1:
                weights = [gates[s, e] for e, _, _ in kept]
            else:  # renormalised over the kept choices, differentiably
                total = torch.clamp(sum(gates[s, e] for e, _, _ in kept), min=torch.finfo(torch.float32).eps)
                weights = [gates[s, e] / total for e, _, _ in kept]
            for (e, _, _), w in zip(kept, weights):
                acc = acc + experts[e](x[s:s + 1])[0] * w.to(x.dtype)
        rows.append(acc)
    out = torch.stack(rows)
    E = gate_weight.shape[0]
    if k <= 2:
        first = torch.argmax(gates, dim=1)
        ce = F.one_hot(first, E).float().mean(0)
        l_aux = (gates.mean(0) * ce).sum() * E
    else:
        top = torch.topk(gates, k, dim=1).indices
        share = torch.zeros_like(gates).scatter_(1, top, 1.0).mean(0)
        l_aux = (gates.mean(0) * share).sum() * E / k
    return out, l_aux, routes
