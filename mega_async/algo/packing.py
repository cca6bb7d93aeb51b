"""Token-balanced batching: FFD micro-batches (AReaL Algorithm 1), pipeline-aware counts, 1-D packing
with `cu_seqlens`, and DP redistribution of whole prompt groups."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import torch


def ffd_allocate(lengths: Sequence[int], capacity: int, min_groups: int, n_groups_divisor: int = 1) -> list[list[int]]:
    """First-Fit-Decreasing: longest first, each into the fitting group with the fewest sequences.

    A new group opens when none fits or fewer than `min_groups` exist; the group count is then
    raised until it is a multiple of `n_groups_divisor`. Returns lists of indices into `lengths`.
    """
    if capacity < 1 or min_groups < 1 or n_groups_divisor < 1:
        raise ValueError(f"capacity={capacity}, min_groups={min_groups}, n_groups_divisor={n_groups_divisor} must be >= 1")
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sequence {i} has {n} tokens, more than the micro-batch capacity {capacity}; "
                             "raise trainer.max_tokens_per_mb or cap generation length")
    target = min_groups
    while True:
        if len(lengths) < target:
            raise ValueError(f"{len(lengths)} sequences cannot fill {target} micro-batches (min_groups={min_groups}, "
                             f"multiple of {n_groups_divisor}); use a larger batch or fewer micro-batches")
        groups = _ffd(lengths, capacity, target)
        if len(groups) % n_groups_divisor == 0:
            return groups
        target = -(-len(groups) // n_groups_divisor) * n_groups_divisor


def _ffd(lengths: Sequence[int], capacity: int, min_groups: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    sums: list[int] = []
    for i in order:
        n = lengths[i]
        fitting = [g for g in range(len(groups)) if sums[g] + n <= capacity]
        if not fitting or len(groups) < min_groups:
            groups.append([i])
            sums.append(n)
            continue
        g = min(fitting, key=lambda k: (len(groups[k]), sums[k]))
        groups[g].append(i)
        sums[g] += n
    return groups


def allocate_micro_batches(lengths: Sequence[int], max_tokens_per_mb: int, pp_size: int, dp_size: int = 1,
                           min_count: int = 1) -> list[list[int]]:
    """Pipeline-aware FFD: at least 2 x PP micro-batches and a multiple of PP when PP > 1.

    `min_count` is the count agreed over DP (max over ranks), so every DP rank runs the same number.
    `dp_size` only documents the contract here; the agreement is the engine's all-reduce.
    """
    if pp_size < 1 or dp_size < 1:
        raise ValueError(f"pp_size={pp_size} and dp_size={dp_size} must be >= 1")
    min_groups = max(min_count, 2 * pp_size if pp_size > 1 else 1)
    return ffd_allocate(lengths, max_tokens_per_mb, min_groups, n_groups_divisor=pp_size)


def seq_alignment(tp: int, cp: int) -> int:
    """Per-sequence padding multiple: tp*cp*2 with context parallelism (load-balanced halves), else tp."""
    return tp * cp * 2 if cp > 1 else tp


@dataclass
class Packed:
    """One 1-D stream: `tokens` [T], `position_ids` [T], `cu_seqlens` [n+1] int32 over padded lengths."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: list[int]  # real lengths
    padded_lengths: list[int]

    @property
    def max_seqlen(self) -> int:
        return max(self.padded_lengths)


def pack(seqs: Sequence[torch.Tensor], align: int = 1, pad_to: int | None = None, pad_value: int = 0) -> Packed:
    """Concatenate 1-D sequences, each right-padded to a multiple of `align`; the stream padded to `pad_to`
    (or a multiple of `align`). The stream padding belongs to the last sequence's segment."""
    lengths = [int(s.numel()) for s in seqs]
    padded = [-(-n // align) * align for n in lengths]
    parts, pos = [], []
    for s, n, p in zip(seqs, lengths, padded):
        parts.append(torch.nn.functional.pad(s.flatten(), (0, p - n), value=pad_value))
        pos.append(torch.arange(p))
    total = sum(padded)
    target = pad_to if pad_to is not None else -(-total // align) * align
    if target < total:
        raise ValueError(f"pad_to={pad_to} is smaller than the packed length {total}")
    if target > total:
        parts.append(torch.full((target - total,), pad_value, dtype=parts[0].dtype))
        pos.append(torch.arange(padded[-1], padded[-1] + target - total))
        padded[-1] += target - total
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(padded, dtype=torch.int32).cumsum(0)
    return Packed(torch.cat(parts), torch.cat(pos), cu, lengths, padded)


def cp_partition_index(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions of the packed stream that context-parallel rank `cp_rank` holds, in Megatron's load-balanced
    layout: each sequence in 2 x cp equal chunks, rank r taking chunks r and 2cp-1-r (as TE's
    thd_get_partitioned_indices). Segment lengths in `cu_seqlens` must be multiples of 2 x cp."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside a context-parallel group of {cp_size}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    parts = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if (e - s) % (2 * cp_size):
            raise ValueError(f"a packed segment of {e - s} tokens cannot split into 2 x cp={2 * cp_size} chunks; "
                             f"pad with align=seq_alignment(tp, cp)")
        c = (e - s) // (2 * cp_size)
        parts += [torch.arange(s + cp_rank * c, s + (cp_rank + 1) * c),
                  torch.arange(s + (2 * cp_size - 1 - cp_rank) * c, s + (2 * cp_size - cp_rank) * c)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def unpack(values: torch.Tensor, packed: Packed) -> list[torch.Tensor]:
    """Split a per-token tensor of the stream ([T, ...]) back into the real (unpadded) sequences."""
    starts = packed.cu_seqlens[:-1].tolist()
    return [values[s:s + n] for s, n in zip(starts, packed.lengths)]


def redistribute_groups(group_tokens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Whole prompt groups to DP ranks, balancing tokens: largest group first onto the lightest rank (LPT)."""
    if dp_size < 1:
        raise ValueError(f"dp_size={dp_size} must be >= 1")
    if len(group_tokens) < dp_size:
        raise ValueError(f"{len(group_tokens)} groups cannot give every one of {dp_size} DP ranks one")
    heap = [(0, 0, r) for r in range(dp_size)]  # (tokens, groups, rank)
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for g in sorted(range(len(group_tokens)), key=lambda i: (-group_tokens[i], i)):
        tokens, n, r = heapq.heappop(heap)
        out[r].append(g)
        heapq.heappush(heap, (tokens + group_tokens[g], n + 1, r))
    return [sorted(x) for x in out]
