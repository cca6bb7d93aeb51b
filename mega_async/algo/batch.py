"""Batch helpers: trajectory dicts of different lengths joined into one right-padded batch."""
from __future__ import annotations

from typing import Sequence

import torch

PAD_VALUES = {"input_ids": 0, "loss_mask": 0, "logprobs": 0.0, "versions": -1, "attention_mask": 0,
              "routed_experts": -1}


def concat_padded(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate [n_i, L_i] trajectory dicts along dim 0, right-padding dim 1 to the longest.

    Per-sequence keys (1-D, e.g. `rewards`) are concatenated as they are.
    """
    if not items:
        raise ValueError("concat_padded needs at least one trajectory dict")
    keys = items[0].keys()
    for it in items[1:]:
        if it.keys() != keys:
            raise ValueError(f"trajectory keys differ: {sorted(keys)} vs {sorted(it.keys())}")
    max_len = max(t.shape[1] for it in items for t in it.values() if t.dim() >= 2)
    out = {}
    for k in keys:
        ts = [it[k] for it in items]
        if ts[0].dim() >= 2:
            pad = PAD_VALUES.get(k, 0)
            # dim 1 is the sequence; trailing dims (routed_experts' experts) are not padded
            ts = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, max_len - t.shape[1]), value=pad) for t in ts]
        out[k] = torch.cat(ts, dim=0)
    return out
