"""SGLangClient's server choice at scale: the least-loaded healthy server (lowest index on a tie, as before) from a
heap, without scanning every server for each request."""
import asyncio
import random

from mega_async.inference.client import SGLangClient


class CountingList(list):
    """A server list that counts full scans."""

    scans = 0

    def __iter__(self):
        CountingList.scans += 1
        return super().__iter__()


def brute_force(client):
    healthy = [s for s in list.__iter__(client.servers) if s.healthy]
    return min(healthy, key=lambda s: s.in_flight) if healthy else None


def test_least_loaded_matches_the_old_rule_under_random_load_and_health_changes():
    rng = random.Random(0)
    client = SGLangClient([f"127.0.0.1:{10000 + i}" for i in range(37)])
    running = []
    for step in range(5000):
        r = rng.random()
        if r < 0.5 or not running:
            s = client._least_loaded()
            assert s is brute_force(client)
            client._count(s, 1)
            running.append(s)
        elif r < 0.95:
            client._count(running.pop(rng.randrange(len(running))), -1)
        elif r < 0.98:
            client._mark_unhealthy(client.servers[rng.randrange(37)], "test")
        else:  # re-admitted, as a successful /health probe does
            s = client.servers[rng.randrange(37)]
            if not s.healthy:
                s.healthy = True
                client._suspects.discard(client.servers.index(s))
                client._push(s)
    assert len(client._load) <= 4 * 37 + 64 + 1  # stale heap entries are dropped now and then


def test_choosing_a_server_does_not_scan_every_server():
    client = SGLangClient([f"127.0.0.1:{10000 + i}" for i in range(256)])
    client.servers = CountingList(client.servers)

    async def choose_many():
        for i in range(500):
            s = await client._choose(f"r{i}")
            client._count(s, 1)
            client._sticky.pop(f"r{i}")
        return s

    CountingList.scans = 0
    asyncio.run(choose_many())
    assert CountingList.scans == 0  # the old _choose walked all 256 servers three times per request
    assert sorted({s.in_flight for s in client.servers}) == [1, 2]  # spread evenly
