"""Radix tree over token ids holding the KV of cached prefixes (the embedded server's SGLang radix cache).

The shape of SGLang's `mem_cache/radix_cache.py`, written for a transformers KV cache: each node keeps the
per-layer keys/values of its token segment (SGLang keeps indices into a KV pool). `match_prefix` returns the
longest cached prefix (splitting a node where the match ends inside it), `insert` adds what is not cached yet,
`evict` drops least-recently-used unlocked leaves, `lock`/`unlock` protect the path of a running request.
The tree never holds more than `max_tokens` tokens: an insert first evicts, then keeps only what fits.
`reset` (weights changed, /flush_cache, KV memory released) bumps `epoch`, so a lock or a request's KV from
before it is recognised as stale and never reaches the new tree.

The engine's accounting is SGLang's: a request matches at most `len(prompt) - 1` tokens (the last token is
always computed, SGLang's `_compute_max_prefix_len`), at most `logprob_start_len` when it asks prompt
logprobs, and `cached_tokens` is the match at its first admission. After a prefill the prompt's KV is
inserted (SGLang's checkpoint after prefill); when a request finishes, prompt + output minus the last token.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys [H, n, D], values [H, n, D])
KVSource = Callable[[int, int], Optional[KV]]  # (start, end) -> the KV of tokens[start:end]

# SGLang's in-batch prefix caching (schedule_policy.py): a request whose cached prefix is at most CHECK
# tokens and that shares at least DEPRIORITIZE tokens with a request admitted in the same round waits for
# that request's prefill, then matches what it inserted.
IN_BATCH_CHECK_THRESHOLD = 32
IN_BATCH_DEPRIORITIZE_THRESHOLD = 32


def common_prefix_len(a: Sequence[int], b: Sequence[int], offset: int = 0) -> int:
    """Length of the common prefix of a and b[offset:], by galloping slice compares (no per-token loop)."""
    n = min(len(a), len(b) - offset)
    lo, step = 0, 1
    while lo < n:
        hi = min(lo + step, n)
        if tuple(a[lo:hi]) != tuple(b[offset + lo:offset + hi]):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if tuple(a[lo:mid]) == tuple(b[offset + lo:offset + mid]):
                    lo = mid
                else:
                    hi = mid
            return lo
        lo, step = hi, step * 2
    return n


def _slice_kv(kv: Optional[KV], a: int, b: Optional[int] = None) -> Optional[KV]:
    if kv is None:
        return None
    return [(k[:, a:b].clone(), v[:, a:b].clone()) for k, v in kv]


class Node:
    __slots__ = ("children", "parent", "key", "kv", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...] = (), kv: Optional[KV] = None, parent: Optional["Node"] = None):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key
        self.kv = kv
        self.lock_ref = 0
        self.last_access = 0

    def __lt__(self, other: "Node") -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


@dataclass
class Match:
    length: int  # tokens of the key found in the tree
    node: Node  # the node that ends the match (the root for none)


@dataclass(frozen=True)
class Lock:
    node: Node
    epoch: int


class RadixCache:
    """Prefix tree of token ids -> KV, at most `max_tokens` tokens; `max_tokens = 0` disables it."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens}: must be at least 0 (0 disables the cache)")
        self.max_tokens = max_tokens
        self.epoch = 0
        self.hits = 0  # requests admitted with cached_tokens > 0
        self.hit_tokens = 0  # their cached tokens in all
        self.queries = 0  # requests admitted
        self.query_tokens = 0  # their prompt tokens in all
        self.evicted_tokens = 0
        self.reset()

    # ---- state --------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @property
    def num_tokens(self) -> int:
        return self._total

    @property
    def protected_tokens(self) -> int:
        """Tokens on the paths of locked nodes (not evictable)."""
        return self._protected

    def __len__(self) -> int:
        """Number of nodes holding tokens."""
        return self._nodes

    def reset(self) -> None:
        """Drop everything (the KV no longer matches the weights); outstanding locks become stale."""
        stack = [self.root] if hasattr(self, "root") else []
        while stack:  # free the old KV now: a stale lock still pins its node objects until its request ends
            node = stack.pop()
            stack.extend(node.children.values())
            node.kv, node.children = None, {}
        self.root = Node()
        self.root.lock_ref = 1
        self._total = self._protected = self._nodes = 0
        self._clock = 0
        self._evictable: set[Node] = set()
        self.epoch += 1

    clear = reset

    def record(self, prompt_len: int, cached: int) -> None:
        """Count one admitted request for the hit rate (what /server_info and the benchmark report)."""
        self.queries += 1
        self.query_tokens += prompt_len
        if cached > 0:
            self.hits += 1
            self.hit_tokens += cached

    # ---- match / insert -----------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> Match:
        """Longest cached prefix of `tokens`; splits the node where the match ends inside it, refreshes LRU."""
        node, pos = self.root, 0
        self._touch(node)
        if not self.enabled:
            return Match(0, node)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            self._touch(child)
            n = common_prefix_len(child.key, tokens, pos)
            if n < len(child.key):
                node = self._split(child, n)
                pos += n
                break
            node, pos = child, pos + n
        return Match(pos, node)

    def gather(self, node: Node) -> Optional[KV]:
        """The KV of the path root -> node, concatenated per layer ([H, n, D]); None for the root."""
        parts = []
        while node is not self.root:
            parts.append(node.kv)
            node = node.parent
        if not parts or parts[0] is None:
            return None
        parts.reverse()
        return [(torch.cat([p[li][0] for p in parts], 1), torch.cat([p[li][1] for p in parts], 1))
                for li in range(len(parts[0]))]

    def insert(self, tokens: Sequence[int], kv_of: KVSource) -> Match:
        """Add `tokens`; `kv_of(a, b)` gives the KV of tokens[a:b] for the part not cached yet (SGLang's insert).

        Returns how many tokens the tree now holds of `tokens` and the node ending them (fewer than asked
        when the budget is taken by locked nodes)."""
        node, pos = self.root, 0
        self._touch(node)
        if not self.enabled:
            return Match(0, node)
        tokens = tuple(tokens)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            self._touch(child)
            n = common_prefix_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        if pos < len(tokens):
            want = len(tokens) - pos
            if self._total + want > self.max_tokens:
                node.lock_ref += 1  # the path we extend must survive the eviction
                self.evict(self._total + want - self.max_tokens)
                node.lock_ref -= 1
            take = min(want, self.max_tokens - self._total)
            if take > 0:
                leaf = Node(tokens[pos:pos + take], kv_of(pos, pos + take), node)
                node.children[tokens[pos]] = leaf
                self._touch(leaf)
                self._total += take
                self._nodes += 1
                self._update_leaf(node)
                self._update_leaf(leaf)
                node, pos = leaf, pos + take
        return Match(pos, node)

    # ---- locks / eviction ---------------------------------------------------------------------
    def lock(self, node: Node) -> Lock:
        """Protect root -> node from eviction until `unlock` (a running request's prefix)."""
        n = node
        while n is not self.root:
            if n.lock_ref == 0:
                self._protected += len(n.key)
            n.lock_ref += 1
            self._update_leaf(n)
            n = n.parent
        return Lock(node, self.epoch)

    def unlock(self, lock: Optional[Lock]) -> None:
        """Undo `lock`; a lock from before the last reset is a no-op (its nodes are gone)."""
        if lock is None or lock.epoch != self.epoch:
            return
        n = lock.node
        while n is not self.root:
            if n.lock_ref == 1:
                self._protected -= len(n.key)
            n.lock_ref -= 1
            self._update_leaf(n)
            n = n.parent

    def is_current(self, lock: Optional[Lock]) -> bool:
        return lock is not None and lock.epoch == self.epoch

    def evict(self, num_tokens: int) -> int:
        """Drop least-recently-used unlocked leaves until `num_tokens` are freed (or none is left to drop)."""
        heap = list(self._evictable)
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self._evictable.discard(leaf)
            self._total -= len(leaf.key)
            self._nodes -= 1
            freed += len(leaf.key)
            leaf.kv = None
            self._update_leaf(parent)
            if parent in self._evictable:
                heapq.heappush(heap, parent)
        self.evicted_tokens += freed
        return freed

    # ---- internals ----------------------------------------------------------------------------
    def _touch(self, node: Node) -> None:
        self._clock += 1
        node.last_access = self._clock

    def _split(self, child: Node, n: int) -> Node:
        """parent -> child becomes parent -> new (child.key[:n]) -> child (child.key[n:]); returns new."""
        new = Node(child.key[:n], _slice_kv(child.kv, 0, n), child.parent)
        new.lock_ref, new.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[0]] = new
        child.key, child.kv, child.parent = child.key[n:], _slice_kv(child.kv, n), new
        new.children[child.key[0]] = child
        self._nodes += 1
        return new

    def _update_leaf(self, node: Node) -> None:
        if node is not self.root and node.lock_ref == 0 and not node.children:
            self._evictable.add(node)
        else:
            self._evictable.discard(node)

    def check(self) -> None:
        """Assert the bookkeeping (tests): totals, protected sizes, leaf set, KV lengths, child keys."""
        total = protected = nodes = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for tok, c in node.children.items():
                assert c.parent is node and c.key and c.key[0] == tok, "child key/parent mismatch"
                assert c.kv is None or all(k.shape[1] == len(c.key) == v.shape[1] for k, v in c.kv)
                total += len(c.key)
                nodes += 1
                protected += len(c.key) if c.lock_ref > 0 else 0
                assert (c in self._evictable) == (c.lock_ref == 0 and not c.children)
                stack.append(c)
        assert (total, protected, nodes) == (self._total, self._protected, self._nodes), \
            (total, protected, nodes, self._total, self._protected, self._nodes)
        assert total <= self.max_tokens or not self.enabled


def stack_prefixes(kvs: list[Optional[KV]], M: int) -> KV:
    """Per layer ([B, H, M, D] keys, values): each row's prefix KV left-padded with zeros to M (None: all zeros)."""
    tmpl = next(kv for kv in kvs if kv is not None)
    out = []
    for li, (k0, v0) in enumerate(tmpl):
        pads = [(kv[li] if kv is not None else (k0[:, :0], v0[:, :0])) for kv in kvs]
        out.append((torch.stack([torch.nn.functional.pad(k, (0, 0, M - k.shape[1], 0)) for k, _ in pads]),
                    torch.stack([torch.nn.functional.pad(v, (0, 0, M - v.shape[1], 0)) for _, v in pads])))
    return out


def row_source(cache: Any, mask: torch.Tensor, i: int) -> KVSource:
    """Row i's KV of its tokens [a, b) out of a batch KV cache (the columns where its mask is 1), copied."""

    def kv_of(a: int, b: int) -> KV:
        cols = mask[i].nonzero().squeeze(1)[a:b]
        return [(layer.keys[i][:, cols], layer.values[i][:, cols]) for layer in cache.layers]

    return kv_of


def plan_round(seqs: list[tuple[int, ...]], cached: list[int],
               tentative: list[bool]) -> tuple[list[int], list[int], list[tuple[int, ...]]]:
    """Which of one admission round's requests to prefill now and which after the others' prefill.

    `seqs[i]` is request i's tokens, `cached[i]` its match in the tree, `tentative[i]` whether it would still
    compute more than its last token (a miss or a partial hit). Returns (now, later, warmups):
    - requests with the same tokens (the `n` samples of one prompt, a GRPO group) all wait behind one
      warm-up prefill of those tokens, so each joins from the cache with len - 1 cached tokens, as SGLang's
      parallel sampling (it prefills the prompt with max_new_tokens=0 first);
    - SGLang's in-batch prefix caching: a request with at most IN_BATCH_CHECK_THRESHOLD cached tokens that
      shares at least IN_BATCH_DEPRIORITIZE_THRESHOLD with an earlier request of the round waits for it.
    """
    count: dict[tuple[int, ...], int] = {}
    for s, t in zip(seqs, tentative):
        if t:
            count[s] = count.get(s, 0) + 1
    probe = RadixCache(1 << 62)  # tokens only (no KV), as SGLang's waiting_queue_radix_tree
    now, later, warm, warmed = [], [], [], set()
    for i, (s, t) in enumerate(zip(seqs, tentative)):
        if not t:
            now.append(i)
        elif count[s] > 1:
            later.append(i)
            if s not in warmed:
                warmed.add(s)
                warm.append(s)
                probe.insert(s, lambda a, b: None)
        elif cached[i] <= IN_BATCH_CHECK_THRESHOLD and probe.match_prefix(s).length >= IN_BATCH_DEPRIORITIZE_THRESHOLD:
            later.append(i)
        else:
            now.append(i)
            probe.insert(s, lambda a, b: None)
    return now, later, warm
