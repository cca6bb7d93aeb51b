"""Timeouts in the weight sync and the client name the server and the phase (asyncio's own say nothing), a server
that gave no answer is not waited for again by the calls that clean up after it, and its generation requests go
to another server at once instead of waiting out request_timeout."""
import asyncio
import pickle
import socket
import threading
import time

import pytest
from aiohttp import web

from mega_async.inference.client import SGLangClient, ServerError, ServerTimeout
from mega_async.inference.sim.simulated import SimulatedEngine
from mega_async.trainer.sync import RolloutSide, SyncError, Transport, WeightSync
from mega_async.trainer.sync.common import HttpLoop, PhaseTimeout
from mega_async.api.types import WeightVersion
from tests.unit.thread_server import ThreadServer


@pytest.fixture
def mute():
    """A server that accepts connections (the kernel does) and never answers: a stopped process."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


class Stub(ThreadServer):
    """A server that answers every control call with success and /generate with two tokens."""

    def __init__(self):
        app = web.Application()
        self.calls: list[str] = []
        for path in ("/pause_generation", "/continue_generation", "/rollback_weights", "/end_weight_update"):
            app.router.add_post(path, self._ok)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._ok)
        super().__init__(app)

    async def _ok(self, request):
        self.calls.append(request.path)
        return web.json_response({"success": True})

    async def _generate(self, request):
        self.calls.append(request.path)
        return web.json_response({"output_ids": [5, 6], "meta_info": {
            "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]], "finish_reason": {"type": "length"},
            "weight_version": "0"}})


def test_a_wait_that_runs_out_names_its_phase_and_cancels_the_call():
    loop = HttpLoop()
    cancelled = threading.Event()

    async def hang():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(PhaseTimeout, match=r"^pause: not done within 0\.2s$"):
            loop.run(hang(), 0.2, "pause")
        assert cancelled.wait(2)  # nothing left running on the HTTP thread

        async def own():
            raise ServerTimeout("http://127.0.0.1:1", "/pause_generation", 3.0)

        with pytest.raises(ServerTimeout, match=r"^http://127\.0\.0\.1:1/pause_generation gave no answer within 3s$"):
            loop.run(own(), 5, "pause")  # the call's own timeout (it names the server) passes through
    finally:
        loop.close()
    e = pickle.loads(pickle.dumps(ServerTimeout("http://h:1", "/x", 2.5)))
    assert str(e) == "http://h:1/x gave no answer within 2.5s" and isinstance(e, TimeoutError)


def test_a_silent_server_is_named_and_not_waited_for_again(mute):
    stub = Stub()
    client = SGLangClient([mute, stub.address])
    quiet, ok = client.servers

    async def scenario():
        with pytest.raises(ServerError, match=rf"^http://{mute}/pause_generation gave no answer within 0\.5s$"):
            await client.pause_generation(timeout=0.5)
        assert quiet.silent and not quiet.healthy and quiet.paused and ok.paused
        assert "no answer within 0.5s" in quiet.down
        t0 = time.monotonic()
        await client.continue_generation(timeout=30)  # not 30 s: the silent server is skipped
        replies = await client.rollback_weights(timeout=30, addresses=[s.address for s in client.answering(
            client.servers)])
        quiet.session_open = True
        await client.end_weight_update(timeout=30)
        return time.monotonic() - t0, replies

    took, replies = asyncio.run(scenario())
    assert took < 5 and replies == [{"success": True}]
    assert ok.paused is False and quiet.paused is True  # continued when it answers again, before re-admission
    assert client.silent == [f"http://{mute}"]
    assert stub.calls.count("/continue_generation") == 1 and "/end_weight_update" not in stub.calls


def test_requests_on_a_server_found_hung_go_to_another_at_once(mute):
    """A request waiting on a server that another call found hung is cut short and sent to the other server, as
    from a dead one, instead of waiting out request_timeout (30 s here) for an answer that is not coming."""
    from mega_async.api.types import ModelRequest

    stub = Stub()
    client = SGLangClient([mute, stub.address], request_timeout=30, retry_backoff=0.01)
    quiet = client.servers[0]
    out: dict = {}

    def generate():
        t0 = time.monotonic()
        out["resp"] = asyncio.run(client.agenerate(ModelRequest(input_ids=[1, 2, 3], max_new_tokens=2)))
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=generate)
    t.start()
    deadline = time.monotonic() + 5
    while not quiet.generating and time.monotonic() < deadline:  # the request went to the mute server (first)
        time.sleep(0.01)
    assert quiet.generating
    client._mark_unhealthy(quiet, "/pause_generation: no answer within 3s", silent=True)  # as the sync's pause does
    t.join(10)
    assert not t.is_alive() and out["resp"].output_tokens == [5, 6] and out["s"] < 5
    assert stub.calls.count("/generate") == 1 and not quiet.generating and not quiet.cut


class Engine(SimulatedEngine):
    def pause_generation(self, mode="abort", timeout=None):
        raise ServerError("http://127.0.0.1:9/pause_generation gave no answer within 3s")

    def continue_generation(self, timeout=None):
        raise TimeoutError()  # a clean-up that fails too must not hide why the sync failed


class NoWeights(Transport):
    sends_new_weights = False

    def update(self, target):
        return None


def test_a_failing_continue_does_not_hide_the_syncs_own_error():
    sync = WeightSync([], WeightVersion(), RolloutSide(Engine()), NoWeights(), timeout=3)
    try:
        with pytest.raises(SyncError, match=r"failed \(pause: ServerError: http://127\.0\.0\.1:9/pause_generation "
                                            r"gave no answer within 3s\)"):
            sync.push()
    finally:
        sync.close()


def test_a_call_on_a_stuck_rollout_loop_says_what_it_waited_for():
    from mega_async.rollout.runner import AsyncTaskRunner

    runner = AsyncTaskRunner()
    runner.start()
    release = threading.Event()
    try:
        runner._loop.call_soon_threadsafe(lambda: release.wait(5))  # the loop is busy

        def snapshot():
            return 1

        with pytest.raises(TimeoutError, match=r"the rollout loop did not run .*snapshot within 0\.2s"):
            runner.call(snapshot, timeout=0.2)
    finally:
        release.set()
        runner.stop()


def test_an_agent_episode_that_runs_out_of_time_says_so():
    from pathlib import Path

    from transformers import AutoTokenizer

    from mega_async.rollout.agent import AgentWorkflow

    tok = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[2] / "models" / "tiny-qwen3-moe")

    async def agent(client, data):
        await asyncio.sleep(30)

    wf = AgentWorkflow(agent, tok, episode_timeout=0.3)
    with pytest.raises(TimeoutError, match=r"agent episode at http://127\.0\.0\.1:\d+/v1 did not finish within "
                                           r"episode_timeout=0\.3s"):
        asyncio.run(wf.arun_episode(SimulatedEngine(), {"question": "1+1"}))


class AbortAheadFails(SimulatedEngine):
    """The step before an abort pause fails (e.g. a server that cannot say its release): the pause aborts anyway."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.paused_with = None

    async def abort_in_flight(self, timeout):
        raise ServerError("http://127.0.0.1:9: cannot learn its SGLang release")

    def pause_generation(self, mode="abort", timeout=None):
        self.paused_with = mode
        return super().pause_generation(mode, timeout)


def test_a_failed_abort_ahead_of_the_pause_does_not_fail_the_sync(caplog):
    version = WeightVersion()
    engine = AbortAheadFails(version=version)
    sync = WeightSync([], version, RolloutSide(engine), NoWeights(), timeout=3)
    try:
        sync.push()
    finally:
        sync.close()
    assert version.value == 1 and engine.paused_with == "abort"
    assert "ahead of the pause failed (ServerError: http://127.0.0.1:9: cannot learn" in caplog.text
