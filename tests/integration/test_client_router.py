"""The client's side of a router in front of its servers (`SGLangClient(router=...)`, inference.router*), in the
default suite: two embedded servers, and a third embedded server as the router's HTTP front (it answers /generate and
/health as smg does; smg itself, with real servers, is tests/integration/test_router.py, slow). Generation goes
through the router while every server serves the synced version; an answer the router got from a server behind that
version puts the server out and generation straight to the serving one; a router that dies is gone around, never
dropped; control goes straight to the servers, never to the router."""
import asyncio
import time

import pytest

from mega_async.inference.client import SGLangClient
from mega_async.api.types import ModelRequest, WeightVersion
from .conftest import post
from .server_inproc import InProcessServer

PROMPT = [5, 17, 300, 42, 7, 99]


@pytest.fixture(scope="module")
def fleet(weights_root):
    """(server a, server b, router front), each an in-process embedded server (one set for the module)."""
    servers = [InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root)) for _ in range(3)]
    try:
        yield servers
    finally:
        for s in servers:
            s.close()


def ask(client: SGLangClient, n: int) -> list:
    async def go():
        reqs = [ModelRequest(input_ids=PROMPT, max_new_tokens=3) for _ in range(n)]
        try:
            return await asyncio.gather(*(client.agenerate(r) for r in reqs))
        finally:
            await client.aclose()
    return asyncio.run(go())


def label(address: str, version: str) -> None:
    assert post(address, "/update_weight_version", {"new_version": version})[0] == 200


def test_generation_goes_through_the_router_and_around_it_while_a_server_is_behind(fleet):
    a, b, front = fleet
    version = WeightVersion()
    client = SGLangClient([a.address, b.address], router=front.address, version=version, health_check_interval=0.2)
    ask(client, 4)
    assert client.router_stats() == {"answers": 4, "around": 0}
    for s in (a, b, front):  # as a sync to version 3 leaves them
        label(s.address, "3")
    client.synced(3)
    version.set(3)
    label(b.address, "2")  # b restarted at older weights ...
    label(front.address, "2")  # ... and the router sent a request to it
    got = ask(client, 3)
    assert all(set(r.output_versions) == {3} for r in got), [r.output_versions for r in got]  # stale answers dropped
    assert client.router_stats()["around"] == 3  # b found behind: straight to a
    assert not client.servers[1].healthy and client.servers[1].behind and client.servers[0].healthy
    label(front.address, "3")
    label(b.address, "3")  # b has the synced weights again
    time.sleep(0.3)
    ask(client, 1)  # on its way around, the request probes b: re-admitted
    assert client.servers[1].healthy
    before = client.router_stats()
    ask(client, 5)
    assert client.router_stats() == {"answers": before["answers"] + 5, "around": before["around"]}


def test_a_dead_router_is_gone_around_and_used_again_once_it_answers(fleet, weights_root):
    a, b, _ = fleet
    front = InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root))
    client = SGLangClient([a.address, b.address], router=front.address, health_check_interval=0.2, retry_backoff=0.05)
    ask(client, 2)
    front.close()  # the router's process ends: connections refused
    got = ask(client, 4)
    assert len(got) == 4 and all(r.stop_reason == "length" for r in got)
    stats = client.router_stats()
    assert stats["answers"] == 2 and stats["around"] == 4
    assert not client.router.healthy and client.router.dropped is None  # never dropped for good
    assert all(s.healthy for s in client.servers)  # a failing router says nothing about the servers
    back = InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root))
    try:
        client.router = type(client.router)(f"http://{back.address}")  # the restarted router (a new port here)
        client.router.healthy = False
        time.sleep(0.3)
        ask(client, 1)  # probes the router on its way: it answers /health, so the request goes through it
        ask(client, 3)
        assert client.router_stats() == {"answers": 2 + 1 + 3, "around": 4}
    finally:
        back.close()


def test_control_goes_straight_to_the_servers_never_to_the_router(fleet):
    a, b, front = fleet
    client = SGLangClient([a.address, b.address], router=front.address)

    async def go():
        try:
            await client.pause_generation("abort", timeout=10)
            paused = [s.server._paused for s in (a, b, front)]
            await client.continue_generation(timeout=10)
            return paused, await client.model_info()
        finally:
            await client.aclose()

    paused, infos = asyncio.run(go())
    assert paused == [True, True, False]  # the servers paused, the router untouched
    assert len(infos) == 2 and not any(s.server._paused for s in (a, b, front))
    assert client.router_stats() == {"answers": 0, "around": 0}
