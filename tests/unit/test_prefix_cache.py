"""The embedded server's radix cache (prefix_cache.py): match, insert, split, LRU eviction by a token budget,
lock refs, reset, and the admission plan; KV here is a fake one-layer tensor holding the token ids, so every
gathered prefix can be checked against the tokens it claims to be."""
import torch

from mega_async.server.prefix_cache import (IN_BATCH_DEPRIORITIZE_THRESHOLD, RadixCache, common_prefix_len,
                                                      plan_round, row_source, stack_prefixes)


def src(tokens):
    """kv_of for `tokens`: keys [1, n, 1] = the ids, values = -ids."""

    def kv_of(a, b):
        t = torch.tensor(tokens[a:b], dtype=torch.float32).view(1, -1, 1)
        return [(t.clone(), -t)]

    return kv_of


def tokens_of(tree, node):
    kv = tree.gather(node)
    return [] if kv is None else kv[0][0].view(-1).long().tolist()


def test_common_prefix_len():
    a = list(range(1000))
    assert common_prefix_len(a, a) == 1000
    assert common_prefix_len(a, a[:10] + [-1] + a[11:]) == 10
    assert common_prefix_len(a[5:], a, offset=5) == 995
    assert common_prefix_len([], a) == 0 and common_prefix_len(a, [7]) == 0


def test_match_insert_split_gather():
    t = RadixCache(1000)
    t.insert([1, 2, 3], src([1, 2, 3]))
    t.insert([1, 2, 4, 5], src([1, 2, 4, 5]))  # splits [1, 2, 3] at 2
    assert t.num_tokens == 5 and len(t) == 3  # [1, 2] -> [3], [4, 5]
    m = t.match_prefix([1, 2, 3, 9])
    assert m.length == 3 and tokens_of(t, m.node) == [1, 2, 3]
    m = t.match_prefix([1, 2, 4])  # ends inside [4, 5]: split there
    assert m.length == 3 and tokens_of(t, m.node) == [1, 2, 4] and len(t) == 4
    assert t.match_prefix([7, 1]).length == 0 and t.match_prefix([]).length == 0
    res = t.insert([1, 2, 4, 5, 6], src([1, 2, 4, 5, 6]))  # only [6] is new
    assert res.length == 5 and t.num_tokens == 6 and tokens_of(t, res.node) == [1, 2, 4, 5, 6]
    kv = t.gather(res.node)
    assert torch.equal(kv[0][1], -kv[0][0])  # values travel with their keys through the splits
    t.check()


def test_sglang_cached_tokens_sequence():
    """SGLang's accounting on the tree alone: match at most len - 1, insert the prompt after prefill and
    prompt + output[:-1] at finish. Prompts 0..99, 0..999, 0..999, 0..499, 0..1099 -> 0, 100, 999, 499, 1000."""
    t = RadixCache(1 << 16)
    base = list(range(1100))
    got = []
    for n in (100, 1000, 1000, 500, 1100):
        prompt, out = base[:n], [5000 + n, 5001 + n]  # outputs never continue the base sequence
        m = t.match_prefix(prompt[:-1])
        got.append(m.length)
        lock = t.lock(m.node)
        t.insert(prompt, src(prompt))  # checkpoint after prefill
        seq = prompt + out
        t.insert(seq[:-1], src(seq[:-1]))  # finish
        t.unlock(lock)
        t.check()
    assert got == [0, 100, 999, 499, 1000]
    assert t.protected_tokens == 0


def test_evicts_lru_leaves_to_the_budget():
    t = RadixCache(10)
    a, b, c = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    t.insert(a, src(a))
    t.insert(b, src(b))
    t.match_prefix(a)  # a is now the most recent
    t.insert(c, src(c))  # 12 > 10: evicts b (least recently used), not a
    assert t.match_prefix(a).length == 4 and t.match_prefix(b).length == 0 and t.match_prefix(c).length == 4
    assert t.num_tokens == 8 and t.evicted_tokens == 4
    t.check()


def test_eviction_walks_up_emptied_parents():
    t = RadixCache(8)
    t.insert([1, 2, 3, 4], src([1, 2, 3, 4]))
    t.insert([1, 2, 9, 9], src([1, 2, 9, 9]))  # [1, 2] -> [3, 4], [9, 9]
    assert t.evict(6) == 6 and t.num_tokens == 0 and len(t) == 0  # both leaves, then the bare parent
    t.check()


def test_locked_paths_survive_and_inserts_truncate_to_the_budget():
    t = RadixCache(10)
    a = list(range(100, 106))
    t.insert(a, src(a))
    lock = t.lock(t.match_prefix(a).node)
    assert t.protected_tokens == 6
    b = list(range(200, 208))
    res = t.insert(b, src(b))  # a is locked: only 4 of b fit
    assert res.length == 4 and t.num_tokens == 10 and tokens_of(t, res.node) == b[:4]
    assert t.match_prefix(a).length == 6
    t.unlock(lock)
    assert t.protected_tokens == 0
    res = t.insert(b, src(b))  # now a (older) goes
    assert res.length == 8 and t.match_prefix(a).length == 0 and tokens_of(t, res.node) == b
    t.check()


def test_lock_survives_a_split_below_it():
    t = RadixCache(100)
    t.insert([1, 2, 3, 4], src([1, 2, 3, 4]))
    lock = t.lock(t.match_prefix([1, 2, 3, 4]).node)
    t.match_prefix([1, 2, 7])  # splits the locked node: both halves keep the lock
    t.check()
    assert t.evict(100) == 0
    t.unlock(lock)
    assert t.protected_tokens == 0 and t.evict(100) == 4
    t.check()


def test_reset_makes_locks_stale():
    t = RadixCache(100)
    t.insert([1, 2, 3], src([1, 2, 3]))
    lock = t.lock(t.match_prefix([1, 2, 3]).node)
    t.reset()
    assert not t.is_current(lock) and t.num_tokens == 0
    t.insert([1, 2], src([1, 2]))
    t.unlock(lock)  # the old tree's lock: a no-op on the new one
    t.check()
    assert t.match_prefix([1, 2]).length == 2


def test_disabled_holds_nothing():
    t = RadixCache(0)
    assert not t.enabled
    assert t.insert([1, 2, 3], src([1, 2, 3])).length == 0 and t.match_prefix([1, 2, 3]).length == 0
    assert t.num_tokens == 0


def test_plan_round_warms_groups_and_defers_shared_prefixes():
    p = tuple(range(50))
    group = [p + (7,)] * 3  # one prompt, three samples
    ext = p + (8, 9)  # shares 50 >= 32 tokens with the group
    short = (1, 2, 3)
    seqs = group + [ext, short, short[:2] + (4,)]
    now, later, warm = plan_round(seqs, [0] * len(seqs), [True] * len(seqs))
    assert warm == [p + (7,)] and later == [0, 1, 2, 3] and now == [4, 5]
    assert IN_BATCH_DEPRIORITIZE_THRESHOLD == 32  # SGLang's default
    # a request already hitting more than 32 cached tokens is not held back; a full hit never is
    now, later, warm = plan_round([p + (1,), p + (2,)], [0, 40], [True, True])
    assert now == [0, 1] and later == [] and warm == []
    now, later, warm = plan_round([p, p], [49, 49], [False, False])
    assert now == [0, 1] and warm == []


def test_stack_prefixes_and_row_source():
    kvs = [src([1, 2, 3])(0, 3), None, src([4])(0, 1)]
    (k, v), = stack_prefixes(kvs, 3)
    assert k.shape == (3, 1, 3, 1) and k[:, 0, :, 0].tolist() == [[1, 2, 3], [0, 0, 0], [0, 0, 4]]

    class Layer:
        keys, values = k, v

    class Cache:
        layers = [Layer()]

    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 1]])
    assert row_source(Cache(), mask, 0)(1, 3)[0][0].view(-1).tolist() == [2, 3]
    assert row_source(Cache(), mask, 2)(0, 1)[0][1].view(-1).tolist() == [-4]


def test_reset_frees_the_kv_a_stale_lock_still_points_at():
    t = RadixCache(100)
    t.insert([1, 2, 3], src([1, 2, 3]))
    node = t.match_prefix([1, 2, 3]).node
    lock = t.lock(node)
    t.reset()
    assert node.kv is None and lock.node is node  # the running request's old path holds no tensors
