"""Token balance of DP redistribution and micro-batching on a long-tailed RL length distribution.

Prompt groups of `--group` responses with lognormal lengths (median ~`--median` tokens, heavy tail,
capped at `--max-len`), spread over `--dp` ranks. Baseline in the same run: the naive split (equal
group counts per rank in arrival order). Reports max/mean tokens per rank for both, and the FFD
micro-batch count per rank against the lower bound ceil(rank tokens / capacity).

    python tools/bench_packing.py --dp 8 --group 8 --groups 256
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from mega_async.algo.packing import allocate_micro_batches, redistribute_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--groups", type=int, default=256)
    ap.add_argument("--median", type=float, default=600)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--capacity", type=int, default=16384, help="max tokens per micro-batch")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(a.seed)
    n = a.groups * a.group
    lengths = torch.exp(math.log(a.median) + a.sigma * torch.randn(n, generator=g)).clamp(16, a.max_len).long().tolist()
    group_tokens = [sum(lengths[i * a.group:(i + 1) * a.group]) for i in range(a.groups)]

    def per_rank(assign: list[list[int]]) -> list[int]:
        return [sum(group_tokens[i] for i in r) for r in assign]

    per = a.groups // a.dp
    naive = [list(range(r * per, (r + 1) * per)) for r in range(a.dp)]
    balanced = redistribute_groups(group_tokens, a.dp)
    naive_t, bal_t = per_rank(naive), per_rank(balanced)
    mean = sum(group_tokens) / a.dp
    mbs, bounds = [], []
    for r in balanced:
        seqs = [lengths[i * a.group + j] for i in r for j in range(a.group)]
        mbs.append(len(allocate_micro_batches(seqs, a.capacity, a.pp)))
        bounds.append(math.ceil(sum(seqs) / a.capacity))
    print(json.dumps({
        "sequences": n, "total_tokens": sum(lengths), "dp": a.dp, "group": a.group,
        "naive_max_over_mean": round(max(naive_t) / mean, 4),
        "balanced_max_over_mean": round(max(bal_t) / mean, 4),
        "micro_batches_per_rank": mbs, "lower_bound_per_rank": bounds,
        "micro_batches_over_lower_bound": round(sum(mbs) / sum(bounds), 4),
    }, indent=1))


if __name__ == "__main__":
    main()
