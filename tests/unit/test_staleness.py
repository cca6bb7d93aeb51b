import threading

import pytest

from mega_async.rollout.staleness import StalenessManager


def test_capacity_formula_exact():
    m = StalenessManager(max_concurrent_rollouts=100, consumer_batch_size=4, max_staleness=1)
    # (eta + v + 1) * B = 8 rollouts may be admitted at version 0
    assert m.get_capacity() == 8
    for _ in range(8):
        m.on_enqueued()
        assert m.try_submit() == 0
    assert m.get_capacity() == 0 and m.try_submit() is None
    m.on_accepted()
    assert m.get_capacity() == 0  # accepted still counts against the budget
    m.on_rejected()
    assert m.get_capacity() == 1  # rejected work returns its budget
    m.set_version(1)
    assert m.get_capacity() == 1 + 4
    s = m.stats
    assert (s["accepted"], s["rejected"], s["running"], s["submitted"]) == (1, 1, 6, 8)


def test_concurrency_bound():
    m = StalenessManager(max_concurrent_rollouts=3, consumer_batch_size=8, max_staleness=4)
    for _ in range(3):
        assert m.try_submit() is not None
    assert m.get_capacity() == 0
    m.on_accepted()
    assert m.get_capacity() == 1


def test_eta_zero_is_synchronous():
    m = StalenessManager(100, consumer_batch_size=2, max_staleness=0)
    assert m.get_capacity() == 2
    m.on_submitted(), m.on_submitted(), m.on_accepted(), m.on_accepted()
    assert m.get_capacity() == 0
    m.set_version(1)
    assert m.get_capacity() == 2


def test_recovery_sets_accepted():
    m = StalenessManager(1000, consumer_batch_size=8, max_staleness=2)
    m.on_version_recovered(10)
    assert m.version == 10
    assert m.stats["accepted"] == 80
    assert m.get_capacity() == (2 + 10 + 1) * 8 - 80  # 24, not 104


def test_bad_arguments_and_misuse():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessManager(1, 1, -1)
    m = StalenessManager(1, 1, 0)
    with pytest.raises(RuntimeError, match="never submitted"):
        m.on_accepted()
    m.set_version(3)
    with pytest.raises(ValueError, match="only grow"):
        m.set_version(2)


def test_thread_safety_invariants():
    B, eta, maxc = 4, 2, 7
    m = StalenessManager(maxc, B, eta)
    violations = []

    def worker(seed: int) -> None:
        import random

        rng = random.Random(seed)
        for _ in range(2000):
            v = m.try_submit()
            if v is None:
                continue
            s = m.stats
            if s["running"] > maxc or s["accepted"] + s["running"] > (eta + s["version"] + 1) * B:
                violations.append(s)
            (m.on_accepted if rng.random() < 0.3 else m.on_rejected)()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for i in range(1, 6):
        m.set_version(i)
    for t in threads:
        t.join()
    s = m.stats
    assert not violations
    assert s["running"] == 0
    assert s["accepted"] + s["rejected"] == s["submitted"]
    assert s["accepted"] <= (eta + 5 + 1) * B


def test_version_is_read_from_its_one_owner():
    """The staleness manager and the client read the WeightVersion its owner (the sync) bumps."""
    from mega_async.inference.client import SGLangClient
    from mega_async.api.types import WeightVersion

    wv = WeightVersion()
    sm = StalenessManager(100, 2, 0, version=wv)
    client = SGLangClient(["127.0.0.1:1"], version=wv)
    for _ in range(2):
        assert sm.try_submit() == 0
        sm.on_accepted()
    assert sm.get_capacity() == 0  # eta = 0: one batch per version
    wv.set(1)
    assert (sm.version, client.version, sm.get_capacity()) == (1, 1, 2)
    with pytest.raises(ValueError, match="only grow"):
        wv.set(0)
