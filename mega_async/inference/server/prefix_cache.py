"""Prefix KV cache of the embedded server: the GRPO group of one prompt shares that prompt's prefill.

An entry is the KV of `prompt[:-1]` (one row, no padding) keyed by those tokens. A request whose prompt
minus its last token is cached skips prefill: it joins the running batch as if mid-decode, with its last
prompt token as the next input, so `cached_tokens = len(prompt) - 1` (as SGLang reports a radix hit, which
always recomputes the last token). LRU over a token budget; flushed whenever the weights change.
"""
from __future__ import annotations

import collections
from typing import Optional

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys [1, H, n, D], values [1, H, n, D])


class PrefixCache:
    """Exact-prefix LRU of per-layer KV tensors, at most `max_tokens` cached tokens in all."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], KV] = collections.OrderedDict()
        self._tokens = 0
        self.hits = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def get(self, prefix: tuple[int, ...]) -> Optional[KV]:
        kv = self._entries.get(prefix)
        if kv is not None:
            self._entries.move_to_end(prefix)
            self.hits += 1
            self.hit_tokens += len(prefix)
        return kv

    def put(self, prefix: tuple[int, ...], kv: KV) -> None:
        if not self.enabled or not prefix or len(prefix) > self.max_tokens or prefix in self._entries:
            return
        self._entries[prefix] = kv
        self._tokens += len(prefix)
        while self._tokens > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._tokens -= len(old)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0
