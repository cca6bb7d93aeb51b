"""Our real client, executor and sync pause bracket drive 8 simulated fleet servers: a few hundred episodes with
weight syncs in the middle, none lost or trained twice, every token labelled with the version that made it
(the fleet's logprobs encode it), within max_staleness. Cheap: the fleet runs in a thread of this process."""
import asyncio
import contextlib
import time

import pytest
import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.sim.fleet import Fleet, FleetConfig
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.workflow import RLVRWorkflow
from mega_async.trainer.sync import RolloutSide, Transport, WeightSync
from mega_async.api.types import ModelRequest, WeightVersion

ETA, B = 2, 48


class ControlPlane(Transport):
    """The distributed sync's control messages (session, one bucket, commit, end), no broadcast."""

    def update(self, target):
        ctx = self.ctx
        c, t = ctx.rollout.client, ctx.timeout
        ctx.loop.run(c.begin_weight_update(timeout=t), t)
        ctx.loop.run(c.update_weights_from_distributed(["w"], ["bfloat16"], [[8, 8]], "g", timeout=t,
                                                       load_format="flattened_bucket", flush_cache=False), t)
        ctx.loop.run(c.update_weights_from_distributed([], [], [], "g", version=target, timeout=t,
                                                       flush_cache=ctx.flush_cache), t)
        ctx.loop.run(c.end_weight_update(timeout=t), t)


class Tagged(RLVRWorkflow):
    async def arun_episode(self, engine, data):
        out = await super().arun_episode(engine, data)
        out["uid"] = data["uid"]
        return out


async def one_reward(prompt, completion, **item):
    return 1.0


@pytest.fixture
def fleet():
    cfg = FleetConfig(length_median=30, length_sigma=1.0, token_latency_s=0.002, batch_latency_s=1e-4, ttft_s=0.005,
                      load_s=0.0, pause_poll_s=1.0)  # SGLang's abort pause: 1 s more when it finds requests running
    with Fleet(8, cfg, in_thread=True) as f:
        yield f


def in_flight_with_tokens(fleet, timeout: float = 1.0) -> bool:
    """Whether, within `timeout`, a request running on the fleet has made tokens (the fleet's running_tokens): a
    sync then interrupts an episode with tokens of the old version. The fleet runs in this process's thread."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(s["running_tokens"] for s in fleet.state()):
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("interrupt", ["abort", "retract"])
def test_episodes_across_syncs_keep_their_versions(fleet, interrupt):
    """Syncs until a trained episode spans two versions (at least 4, at most 12): whether a sync finds episodes in
    flight depends on how fast this machine consumes batches, so the test counts, never sleeps on a guess."""
    version = WeightVersion()
    client = SGLangClient(fleet.addresses, version=version)
    ex = WorkflowExecutor(client, Tagged(one_reward, max_new_tokens=120, stop_token_ids=[2]), consumer_batch_size=B,
                          max_staleness=ETA, version=version)
    sync = WeightSync([], version, RolloutSide(client, ex), ControlPlane(), timeout=30, interrupt=interrupt)
    sync._loop.run(client.init_weights_update_group("127.0.0.1", 1, "g", timeout=30), 30)
    for i in (0, 1):  # two servers 4x slower: long episodes, likely in flight at a sync
        fleet.fail(i, "slow", factor=4.0)
    state0 = {s["index"]: s["counters"] for s in fleet.state()}
    items = iter({"uid": k, "input_ids": [k % 97 + 3, k % 89 + 5, 7, k]} for k in range(10_000))
    seen, labels, spans, steps, interrupting = set(), 0, 0, 0, 0
    with ex, contextlib.closing(sync):
        while steps < 4 or (not spans and steps < 12):
            batch = ex.prepare_batch(items)
            for traj in batch:
                assert traj["uid"] not in seen  # nobody is trained twice
                seen.add(traj["uid"])
                m = traj["loss_mask"][0].bool()
                v, lp = traj["versions"][0][m], traj["logprobs"][0][m]
                assert torch.equal(torch.floor(-lp).long(), v)  # each token's label is what made it
                assert int(v.min()) >= version.value - ETA and bool((v[1:] >= v[:-1]).all())
                assert int(v.max()) <= version.value
                labels += v.numel()
                spans += int(v.numel() and int(v.min()) != int(v.max()))
            interrupting += in_flight_with_tokens(fleet)
            sync.push()
            steps += 1
        st = ex.stats
    assert version.value == steps and len(seen) == steps * B and labels > 1000
    assert interrupting > 0  # some syncs found episodes in flight with tokens (with slow servers: most)
    assert spans > 0  # ... and they went on under the new weights, each token labelled by the version that made it
    assert st["failed"] == st["rejected"] == 0
    counters = {s["index"]: s["counters"] for s in fleet.state()}
    interrupted = sum(c.get("aborted", 0) - state0[i].get("aborted", 0) for i, c in counters.items())
    assert (interrupted > 0) == (interrupt == "abort")
    # the bracket aborted them and let their answers come back before it paused: no abort pause found one running
    # and slept SGLang's second (it would have, at every sync that found episodes in flight)
    assert sum(c.get("pause_polls", 0) - state0[i].get("pause_polls", 0) for i, c in counters.items()) == 0
    assert all(s["session"] is None and s["version"] == str(steps) for s in fleet.state())


def test_held_requests_wait_on_one_future_not_a_timer_each(fleet):
    """While the client is paused, held requests cost nothing: no per-request polling timer (they used to wake
    every 10 ms each, which starved the sync's own HTTP thread at thousands of requests in flight)."""
    client = SGLangClient(fleet.addresses)

    async def main():
        client.pause()
        tasks = [asyncio.ensure_future(client.agenerate(ModelRequest([1, 2, i], max_new_tokens=4)))
                 for i in range(200)]
        await asyncio.sleep(0.1)
        timers = len(asyncio.get_running_loop()._scheduled)  # noqa: SLF001 - the loop's pending timers
        client.resume()
        out = await asyncio.gather(*tasks)
        return timers, out

    timers, out = asyncio.run(main())
    assert timers < 10 and len(out) == 200 and all(1 <= len(r.output_tokens) <= 4 for r in out)


def test_calls_of_one_loop_reuse_kept_alive_connections(fleet):
    client = SGLangClient(fleet.addresses[:1])
    before = fleet.state()[0]["counters"].get("connections", 0)

    async def main():
        for i in range(30):
            await client.agenerate(ModelRequest([5, i], max_new_tokens=2))
        await client.pause_generation()
        await client.continue_generation()

    asyncio.run(main())
    # one connection for the generations, one for the control calls: not one per call
    assert fleet.state()[0]["counters"]["connections"] - before == 2


def test_a_connection_the_server_closed_while_idle_is_not_a_dead_server(caplog):
    """The server drops an idle keep-alive connection (uvicorn after 5 s) while this loop is busy: the next call
    goes out on it, fails, and is sent again on a new connection; the server is never marked unhealthy."""
    with Fleet(1, FleetConfig(token_latency_s=0.001, keepalive_s=0.2), in_thread=True) as f:
        client = SGLangClient(f.addresses)

        async def main():
            await client.agenerate(ModelRequest([1, 2], max_new_tokens=2))
            time.sleep(0.6)  # the loop is blocked: the server's close is not seen before the next call
            await client.pause_generation()
            await client.continue_generation()
            time.sleep(0.6)
            return await client.agenerate(ModelRequest([1, 3], max_new_tokens=2))

        with caplog.at_level("WARNING", logger="mega_async.inference.client"):
            out = asyncio.run(main())
        assert len(out.output_tokens) == 2 and client.servers[0].healthy
        assert "marked unhealthy" not in caplog.text
        assert f.state()[0]["counters"]["connections"] >= 3


def test_a_server_back_behind_is_kept_out_until_it_has_the_current_weights(fleet):
    """A server that crashes and restarts comes back with its launch weights: the client keeps it out of
    generation (no token of an old version reaches a sample) and the run's recover hook brings it to the synced
    version, after which it serves again. Without a hook it waits, behind, and stays in the next sync's servers."""
    version = WeightVersion()
    client = SGLangClient(fleet.addresses[:2], version=version, health_check_interval=0.05, retry_backoff=0.01)
    recovered = []

    async def recover(address):
        recovered.append(address)
        await client.update_weights_from_disk("/weights/v3", 3, addresses=[address])

    async def generate_until(cond, n=8):
        outs, deadline = [], time.monotonic() + 30
        while not cond() and time.monotonic() < deadline:
            outs += await asyncio.gather(*(client.agenerate(ModelRequest([1, 2, len(outs) + i], max_new_tokens=6))
                                           for i in range(n)))
        assert cond(), "timed out"
        return outs

    async def main():
        await client.update_weights_from_disk("/weights/v3", 3)  # the run's weight sync: both at version 3
        version.set(3)
        client.synced(3)
        fleet.fail(1, "crash", duration=0.3)  # back as a new process at its launch version
        back = client.servers[1]
        outs = await generate_until(lambda: back.behind)
        assert not back.healthy and [s.address for s in client.sync_targets()] == client.addresses
        served = fleet.state()[1]["counters"].get("finished", 0)
        outs += await asyncio.gather(*(client.agenerate(ModelRequest([5, i], max_new_tokens=6)) for i in range(16)))
        assert fleet.state()[1]["counters"].get("finished", 0) == served  # kept out while behind
        client.recover = recover
        outs += await generate_until(lambda: back.healthy)
        assert recovered == [back.address] and not back.behind
        outs += await asyncio.gather(*(client.agenerate(ModelRequest([7, i], max_new_tokens=6)) for i in range(16)))
        return outs

    outs = asyncio.run(main())
    for r in outs:  # every token came from the synced weights (the fleet's logprobs encode the version)
        assert r.output_versions and set(r.output_versions) == {3}
        assert {int(-lp // 1) for lp in r.output_logprobs} == {3}
    st = fleet.state()[1]
    assert st["version"] == "3" and st["counters"].get("finished", 0) > 0


def test_an_answer_from_a_server_restarted_between_requests_is_dropped_and_sent_again(fleet):
    """A server that restarted while no request of ours was on it is not known to be down: its first answer
    (launch weights, version 0, older than the version the request was sent at) is dropped, the server is taken
    out, and the request is served again by an up-to-date one."""
    version = WeightVersion()
    client = SGLangClient(fleet.addresses[2:4], version=version, health_check_interval=0.05, retry_backoff=0.01)

    async def main():
        await client.update_weights_from_disk("/weights/v5", 5)
        version.set(5)
        client.synced(5)
        fleet.fail(3, "crash")
        fleet.recover(3)  # back at once as a new process: the client saw nothing
        assert fleet.state()[3]["version"] != "5"
        return await asyncio.gather(*(client.agenerate(ModelRequest([9, i], max_new_tokens=5, ignore_eos=True))
                                      for i in range(12)))

    outs = asyncio.run(main())
    assert client.servers[1].behind and not client.servers[1].healthy
    assert all(set(r.output_versions) == {5} and len(r.output_tokens) == 5 for r in outs)
    assert all({int(-lp // 1) for lp in r.output_logprobs} == {5} for r in outs)


def _run_limited(code: str) -> None:
    """Run `code` (it sets its own open-file limit) in a fresh interpreter: it must print ok and no server may be
    marked unhealthy."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    assert "marked unhealthy" not in r.stderr


def test_more_requests_in_flight_than_open_files_wait_for_connections():
    """16,384 requests in flight once ran the controller out of file descriptors ('Too many open files'), and the
    client marked every server down for it. Here a process limited to 300 open files sends 600 requests at once
    to 8 servers (in the same process: each connection costs two descriptors): they queue for the client's
    connections and all finish, no server is marked down."""
    code = """
import asyncio, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
from mega_async.inference.client import SGLangClient
from mega_async.inference.sim.fleet import Fleet, FleetConfig
from mega_async.api.types import ModelRequest
with Fleet(8, FleetConfig(length_median=20, length_sigma=0.0, token_latency_s=0.002, ttft_s=0.01), in_thread=True) as f:
    client = SGLangClient(f.addresses, retry_backoff=0.01)
    async def main():
        return await asyncio.gather(*(client.agenerate(ModelRequest([3, i % 50, i], max_new_tokens=8, ignore_eos=True))
                                      for i in range(600)))
    out = asyncio.run(main())
    assert len(out) == 600 and all(len(r.output_tokens) == 8 for r in out)
    assert all(s.healthy for s in client.servers)
print("ok")
"""
    _run_limited(code)


def test_requests_waiting_for_a_connection_neither_time_out_nor_block_control_calls():
    """65,536 requests in flight (most waiting for one of the client's connections) once marked every server down:
    the wait for a connection counted against the request's timeout, and the health probes that should have
    re-admitted the servers queued behind the waiting requests until they timed out too. Here a process whose
    open-file limit leaves the client 64 connections sends 400 requests, each taking ~0.4 s on the server, with
    a 1.5 s request timeout (the last ones wait ~2.5 s for a connection): all finish, no server is marked down,
    and a control call made while most are still waiting is answered before they finish."""
    code = """
import asyncio, resource
resource.setrlimit(resource.RLIMIT_NOFILE, (1152, 1152))
from mega_async.inference.client import SGLangClient, connection_budget
from mega_async.inference.sim.fleet import Fleet, FleetConfig
from mega_async.api.types import ModelRequest
assert connection_budget() == 64, connection_budget()
with Fleet(4, FleetConfig(length_median=40, length_sigma=0.0, token_latency_s=0.01, ttft_s=0.0,
                          max_running_requests=1000), in_thread=True) as f:
    client = SGLangClient(f.addresses, request_timeout=1.5, retry_backoff=0.01)
    async def main():
        tasks = [asyncio.ensure_future(client.agenerate(ModelRequest([3, i % 50, i], max_new_tokens=40,
                                                                     ignore_eos=True))) for i in range(400)]
        await asyncio.sleep(0.2)
        infos = await client.server_info(timeout=1.0)  # queued behind 336 waiting requests before the fix
        pending = sum(not t.done() for t in tasks)
        return infos, pending, await asyncio.gather(*tasks)
    infos, pending, out = asyncio.run(main())
    assert len(infos) == 4 and all(isinstance(i, dict) for i in infos), infos
    assert pending > 200, pending
    assert len(out) == 400 and all(len(r.output_tokens) == 40 for r in out)
    assert all(s.healthy for s in client.servers)
print("ok")
"""
    _run_limited(code)


def test_a_control_call_reaches_every_server_of_a_large_fleet_at_once():
    """A weight update's collective calls (/init_weights_update_group, each bucket) finish on a server only when
    every server's request has arrived (they join one group). Here 300 servers answer /server_info only after all
    300 requests are in: the client's control connections are per server, so none waits for another's."""
    from aiohttp import web

    n = 300

    async def main():
        arrived, everyone = [0], asyncio.Event()

        async def info(_request):
            arrived[0] += 1
            if arrived[0] == n:
                everyone.set()
            await asyncio.wait_for(everyone.wait(), 20)
            return web.json_response({"version": "0.5.23"})

        app = web.Application()
        app.router.add_get("/server_info", info)
        runner = web.AppRunner(app)
        await runner.setup()
        sites = [web.TCPSite(runner, "127.0.0.1", 0) for _ in range(n)]
        for site in sites:
            await site.start()
        addresses = [f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}" for site in sites]
        client = SGLangClient(addresses)
        try:
            return await client.server_info(timeout=30)
        finally:
            await client.aclose()
            await runner.cleanup()

    infos = asyncio.run(main())
    assert len(infos) == n and all(i == {"version": "0.5.23"} for i in infos)


def test_requests_not_yet_sent_stay_in_the_client_while_it_is_paused():
    """65,536 in flight made a 25.7 s pause bracket: most requests were waiting for one of the client's
    connections, and each abort answer freed one for a waiting request, which went out to the paused server (and
    waited there). Here 12 requests share 4 connections to one server: the pause aborts the 4 running ones and
    the 8 unsent stay in the client until resume; then all 12 finish."""
    with Fleet(1, FleetConfig(length_median=60, length_sigma=0.0, token_latency_s=0.01, ttft_s=0.0),
               in_thread=True) as f:
        client = SGLangClient(f.addresses, max_connections=4)

        async def main():
            tasks = [asyncio.ensure_future(client.agenerate(ModelRequest([3, i], max_new_tokens=60, ignore_eos=True)))
                     for i in range(12)]
            deadline = time.monotonic() + 10
            while f.state()[0]["counters"].get("requests", 0) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            client.pause()
            await client.pause_generation("abort")
            await asyncio.sleep(0.3)  # the abort answers are in: their connections are free
            paused = dict(f.state()[0]["counters"])
            client.resume()
            await client.continue_generation()
            return paused, await asyncio.gather(*tasks)

        paused, out = asyncio.run(main())
    assert paused["aborted"] == 4 and paused["received"] == 4, paused  # 8 before: 4 more went to the paused server
    assert all(len(r.output_tokens) == 60 for r in out)
    assert sum(r.num_interruptions for r in out) == 4


@pytest.mark.parametrize("embedded", [False, True], ids=["sglang", "embedded"])
def test_abort_in_flight_aborts_ahead_of_sglangs_pause_and_leaves_the_embedded_servers_pause_alone(embedded):
    """SGLang's abort pause sleeps a second while request handlers hold its lock (the fleet's pause_poll_s): the
    client aborts first on such servers and waits for the answers, so the pause finds none running. The embedded
    server's pause has no such wait: nothing is aborted ahead there (its answers are read after the pause, with
    the rollout loop parked)."""
    from mega_async.api.sglang_releases import Release

    with Fleet(1, FleetConfig(length_median=200, length_sigma=0.0, token_latency_s=0.01, ttft_s=0.0,
                              pause_poll_s=1.0), in_thread=True) as f:
        client = SGLangClient(f.addresses, request_timeout=30)
        if embedded:
            client.servers[0].release = Release.of("0.5.23", embedded=True)

        async def main():
            tasks = [asyncio.ensure_future(client.agenerate(ModelRequest([3, i], max_new_tokens=200, ignore_eos=True)))
                     for i in range(6)]
            deadline = time.monotonic() + 10
            while f.state()[0]["running"] < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            client.pause()
            left = await client.abort_in_flight(5.0)
            before = dict(f.state()[0]["counters"])
            await client.pause_generation("abort")
            paused = dict(f.state()[0]["counters"])
            client.resume()
            await client.continue_generation()
            return left, before, paused, await asyncio.gather(*tasks)

        left, before, paused, out = asyncio.run(main())
    if embedded:  # the pause aborted them, and slept its second (the fleet knows no embedded server)
        assert left == 6 and before.get("aborted", 0) == 0 and paused["aborted"] == 6 and paused["pause_polls"] == 1
    else:
        assert left == 0 and before["aborted"] == 6 and paused["aborted"] == 6 and not paused.get("pause_polls")
    assert all(len(r.output_tokens) == 200 for r in out) and sum(r.num_interruptions for r in out) == 6


def test_max_connections_must_be_positive():
    with pytest.raises(ValueError, match="max_connections must be at least 1"):
        SGLangClient(["127.0.0.1:1"], max_connections=0)


def test_a_server_lost_after_the_last_bucket_does_not_fail_the_commit_for_the_others(fleet):
    """Every bucket reached every server; then one server goes down and another restarts as a new process (no
    session, no group, launch weights). The commit sets the version on the rest and names the two as lost: the
    down one is out of the next sync, the restarted one is behind. Any other refusal still fails the commit."""
    client = SGLangClient(fleet.addresses[4:7], health_check_interval=0.05, retry_backoff=0.01)

    async def main():
        await client.update_weights_from_disk("/weights/v3", 3)  # the run's last sync: all at version 3
        client.synced(3)
        await client.init_weights_update_group("127.0.0.1", 1, "g", timeout=30)
        await client.begin_weight_update(timeout=30)
        await client.update_weights_from_distributed(["w"], ["bfloat16"], [[8, 8]], "g", timeout=30,
                                                     load_format="flattened_bucket", flush_cache=False)
        fleet.fail(5, "crash")  # down until recovered
        fleet.fail(6, "crash")
        fleet.recover(6)  # back at once as a new process
        lost = await client.commit_distributed("g", 4, timeout=30)
        await client.end_weight_update(timeout=30)
        client.synced(4)  # as the sync does after its commit
        return lost

    lost = asyncio.run(main())
    up, down, restarted = client.servers
    assert sorted(lost) == sorted([down.address, restarted.address])
    st = fleet.state()
    assert st[4]["version"] == "4" and st[4]["session"] is None and st[6]["version"] != "4"
    assert not down.healthy and not down.behind and restarted.behind and not restarted.session_open
    fleet.recover(5)
    asyncio.run(client.probe_down())  # the down one answers again: back, and behind (it missed version 4)
    assert down.behind

    async def refused():  # the group is unknown on a server that did not restart: a real failure
        return await client.commit_distributed("no-such-group", 5, timeout=30)

    client._group = [up]
    with pytest.raises(Exception, match="answered 400"):
        asyncio.run(refused())


def test_a_behind_server_that_goes_down_again_leaves_the_sync_targets(fleet):
    """A restarted server is behind (out of generation, still a sync target). If it crashes again before the next
    sync, the probe before that sync finds it down and leaves it out: the weight-update group is not built with a
    server that cannot join it."""
    client = SGLangClient(fleet.addresses[:2], health_check_interval=0.05, retry_backoff=0.01)

    async def main():
        await client.update_weights_from_disk("/weights/v2", 2)
        client.synced(2)
        fleet.fail(1, "crash")
        fleet.recover(1)
        assert await client.find_behind() == [client.servers[1].address]
        assert [s.address for s in client.sync_targets()] == client.addresses  # behind: still a target
        fleet.fail(1, "crash")  # down again
        await client.probe_down()
        return [s.address for s in client.sync_targets()]

    assert asyncio.run(main()) == [client.servers[0].address]
    fleet.recover(1)


def test_push_is_done_again_while_servers_keep_going_down_and_then_gives_up(fleet, monkeypatch):
    """A push whose servers go down during it is done again without them, more than once (10% of 64 servers
    crashing put five crashes into one push), up to PUSH_ATTEMPTS; after that the SyncError is raised and the
    version is unchanged."""
    from mega_async.trainer.sync import bracket
    from mega_async.trainer.sync.common import SyncError

    version = WeightVersion()
    client = SGLangClient(fleet.addresses, version=version, health_check_interval=0.05, retry_backoff=0.01)
    crash_on = {1: 1, 2: 2}  # attempt -> the server that crashes during it

    class Crashing(ControlPlane):
        attempts = 0

        def members(self):  # as the distributed sync: the group is built again over the servers up now
            c = self.ctx.rollout.client
            self.ctx.loop.run(c.destroy_weights_update_group("g"), 30)
            self.ctx.loop.run(c.init_weights_update_group("127.0.0.1", 1, "g", timeout=30,
                                                          addresses=[s.address for s in c.sync_targets()]), 30)

        def update(self, target):
            Crashing.attempts += 1
            if Crashing.attempts in crash_on:
                fleet.fail(crash_on[Crashing.attempts], "crash")
            super().update(target)

    sync = WeightSync([], version, RolloutSide(client, None), Crashing(), timeout=30)
    try:
        sync.push()
        assert Crashing.attempts == 3 and version.value == 1
        assert {s.address for s in client.sync_targets()} == set(client.addresses) - {client.addresses[1],
                                                                                       client.addresses[2]}
        monkeypatch.setattr(bracket, "PUSH_ATTEMPTS", 3)
        crash_on.clear()
        crash_on.update({Crashing.attempts + k: 2 + k for k in (1, 2, 3)})
        with pytest.raises(SyncError):
            sync.push()
        assert version.value == 1 and Crashing.attempts == 6
    finally:
        sync.close()
        for i in range(1, 6):
            fleet.recover(i)


def test_a_server_failing_as_a_whole_is_taken_out_not_dropped_and_comes_back(fleet):
    """The fleet's `error` failure answers 503 on /generate and on /model_info: more than max_retries 503s in a row
    take the server out (a wedged engine whose /model_info answers is dropped: test_failures.py); the requests go
    to the other server, and once it recovers it is re-admitted and serves again."""
    client = SGLangClient(fleet.addresses[4:6], health_check_interval=0.05, retry_backoff=0.01, max_retries=1)
    fleet.fail(5, "error")
    try:
        payload = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}

        async def some(n):
            return await asyncio.gather(*(client._generate_once(f"r{i}", dict(payload, rid=f"r{i}")) for i in range(n)))

        answered = asyncio.run(some(8))
        assert {s.address for _, s in answered} == {client.servers[0].address}
        broken = client.servers[1]
        assert broken.dropped is None and not broken.healthy
        fleet.recover(5)
        asyncio.run(client.probe_down())
        assert broken.healthy and broken.failures == 0
        answered = asyncio.run(some(16))
        assert broken.address in {s.address for _, s in answered}
    finally:
        fleet.recover(5)


def test_a_server_whose_calls_fail_while_health_answers_stays_out_of_syncs_until_it_recovers(fleet):
    """The fleet's `error` failure: /health answers 200, every other call 503. A control call's 5xx takes the
    server out of generation and of the sync targets (a sync is then done without it); its /health alone does not
    bring it back (its /model_info still fails), and learn_releases names it down instead of failing the run."""
    from mega_async.inference.client import ServerError

    client = SGLangClient(fleet.addresses[6:8], health_check_interval=0.05, retry_backoff=0.01)
    fleet.fail(7, "error")
    try:
        releases = asyncio.run(client.learn_releases(timeout=10))
        assert releases[0] is not None and releases[1] is None
        assert [s.address for s in client.sync_targets()] == [client.servers[0].address]
        asyncio.run(client.probe_down())  # /health says 200; /model_info says 503: still out
        assert not client.servers[1].healthy and len(client.sync_targets()) == 1
        fleet.recover(7)
        asyncio.run(client.probe_down())
        assert client.servers[1].healthy
        fleet.fail(7, "error")
        with pytest.raises(ServerError, match="answered 503"):
            asyncio.run(client.pause_generation(timeout=10))
        assert not client.servers[1].healthy and len(client.sync_targets()) == 1
        asyncio.run(client.continue_generation())
    finally:
        fleet.recover(7)
