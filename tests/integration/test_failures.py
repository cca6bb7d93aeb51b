"""Failure semantics of the rollout layer against real servers: every path stops with one clear error,
within a bound, instead of resubmitting without end."""
import asyncio
import json
import logging
import socket
import threading
import urllib.request
import time

import pytest
from aiohttp import web

from mega_async.utils.comm import free_port
from mega_async.inference.client import SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.rollout.executor import RolloutError, WorkflowExecutor
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow
from tests.commands import train_command

ITEMS = [{"input_ids": [1 + i % 50, 2, 3], "answer": i} for i in range(500)]


def executor(client, max_new_tokens=4, max_failures=32):
    wf = GroupWorkflow(RLVRWorkflow(lambda p, c, **kw: 1.0, max_new_tokens=max_new_tokens), 2)
    return WorkflowExecutor(client, wf, consumer_batch_size=2, max_staleness=1, max_consecutive_failures=max_failures)


class BrokenServer:
    """A server whose /health answers 200 and whose /generate always answers 500 (a wedged engine)."""

    def __init__(self, model_info_status=None):
        self.port = free_port()
        self.generate_calls = 0
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        app.router.add_post("/generate", self._generate)
        if model_info_status is not None:  # failing as a whole (overloaded, restarting): /model_info fails too
            app.router.add_get("/model_info", lambda r: web.Response(text="busy", status=model_info_status))
        self._runner = web.AppRunner(app)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._main, daemon=True).start()
        self._ready.wait(10)

    async def _generate(self, request):
        self.generate_calls += 1
        return web.json_response({"error": {"message": "CUDA error: an illegal memory access"}}, status=500)

    def _main(self):
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"


def test_no_server_alive_stops_within_unhealthy_timeout():
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    client = SGLangClient(dead, unhealthy_timeout=2.0, health_check_interval=0.2, retry_backoff=0.05)
    t0 = time.monotonic()
    with executor(client) as ex:
        with pytest.raises(RolloutError, match=r"no usable inference server for 2s \(http://127\.0\.0\.1:\d+: "
                                                   r"down \(ClientConnectorError: Cannot connect"):
            ex.prepare_batch(ITEMS)
    assert time.monotonic() - t0 < 2.0 + 8.0
    assert ex.stats["failed"] <= 4  # the first admitted episodes, not thousands of resubmissions


def test_no_server_error_says_why_each_server_is_out():
    broken = BrokenServer(model_info_status=503)  # out (not dropped) until /model_info answers, which it never does
    client = SGLangClient([broken.address], max_retries=2, retry_backoff=0.01, unhealthy_timeout=2.0,
                          health_check_interval=0.2)
    with executor(client) as ex:
        with pytest.raises(RolloutError, match=r"no usable inference server for 2s \(http://127\.0\.0\.1:\d+: "
                                               r"down \(/generate answered 500 \d+ times in a row.*\(and /model_info "
                                               r"fails too\)\)\); check the servers' logs"):
            ex.prepare_batch(ITEMS)
    assert client.servers[0].dropped is None


def held_ports(monkeypatch, module, n):
    """Listening sockets on n free ports that `module.free_port` hands out first (then real free ports): a port
    another process took between free_port() and the launched process's bind."""
    held = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
    given = iter([s.getsockname()[1] for s in held])
    real = module.free_port
    monkeypatch.setattr(module, "free_port", lambda host="127.0.0.1": next(given, None) or real(host))
    return held


def test_a_server_whose_port_is_taken_before_it_binds_is_started_at_another(weights_root, tmp_path, monkeypatch,
                                                                              caplog):
    import mega_async.inference.servers as servers

    held = held_ports(monkeypatch, servers, 1)
    taken = f"127.0.0.1:{held[0].getsockname()[1]}"
    spec = ServerSpec("embedded", str(weights_root / "v0"), weights_root=str(weights_root), num_threads=1)
    try:
        with caplog.at_level(logging.WARNING, "mega_async"):
            with ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120) as launcher:
                assert launcher.addresses[0] != taken
                with urllib.request.urlopen(f"http://{launcher.addresses[0]}/health", timeout=10) as r:
                    assert r.status == 200
                log = launcher.log_path(0).read_text()
        assert log.count("Address already in use") == 1, log  # the first port lost, the second one served
        said = [r.getMessage() for r in caplog.records if "could not listen" in r.getMessage()]
        assert len(said) == 1 and taken in said[0] and launcher.addresses[0] in said[0], said
    finally:
        for s in held:
            s.close()


@pytest.mark.slow  # starts a server twice
def test_a_process_answering_at_the_servers_port_is_not_taken_for_it(weights_root, tmp_path, monkeypatch, caplog):
    """Another process binds the port between free_port() and the server's bind, and answers /health: the launcher
    asks the kernel who listens (comm.listens), waits for its own server, which loses the port and is started at
    another; the squatter never becomes the run's server (before: it got /server_info and the trainer's
    weight-update address, and the run made no progress)."""
    import mega_async.inference.servers as servers
    from aiohttp import web

    from tests.unit.thread_server import ThreadServer

    seen = []

    async def anything(request):
        seen.append(request.path)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    squatter = ThreadServer(app)
    real = servers.free_port
    given = iter([int(squatter.address.rsplit(":", 1)[1])])
    monkeypatch.setattr(servers, "free_port", lambda host="127.0.0.1": next(given, None) or real(host))
    spec = ServerSpec("embedded", str(weights_root / "v0"), weights_root=str(weights_root), num_threads=1)
    try:
        with caplog.at_level(logging.WARNING, "mega_async"):
            with ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120) as launcher:
                assert launcher.addresses[0] != squatter.address
                with urllib.request.urlopen(f"http://{launcher.addresses[0]}/model_info", timeout=10) as r:
                    assert r.status == 200  # the embedded server itself
        assert set(seen) <= {"/health"}, seen
        assert any("another process answers at" in r.getMessage() for r in caplog.records)
    finally:
        squatter.close()


def test_a_server_that_loses_every_port_fails_with_its_log(weights_root, tmp_path, monkeypatch):
    import mega_async.inference.servers as servers

    monkeypatch.setattr(servers, "PORT_ATTEMPTS", 1)  # the tries are bounded: the last one's failure is the error
    held = held_ports(monkeypatch, servers, 1)
    spec = ServerSpec("embedded", str(weights_root / "v0"), weights_root=str(weights_root), num_threads=1)
    launcher = ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)server 0 exited with code 1 before becoming healthy.*"
                                               r"Address already in use"):
            launcher.start()
        assert all(p.poll() is not None for p in launcher.procs)
    finally:
        for s in held:
            s.close()


@pytest.mark.slow  # starts a server twice
def test_a_restarted_server_whose_port_was_taken_while_it_was_down_is_followed_at_its_new_port(weights_root,
                                                                                               tmp_path, caplog):
    """A server the run launched dies; before the supervisor starts it again, another process listens on its port.
    It is started at a new free port, and the client follows it there (generation reaches it, never the other
    process), with one line saying so and a server_moved event; a later restart keeps the new port."""
    from mega_async.utils.events import EventLog
    from mega_async.inference.service import ServerSupervisor
    from mega_async.api.types import ModelRequest

    spec = ServerSpec("embedded", str(weights_root / "v0"), weights_root=str(weights_root), num_threads=1)
    events = EventLog(tmp_path / "events.jsonl")
    holder = socket.socket()
    try:
        with caplog.at_level(logging.WARNING, "mega_async"), \
                ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120) as launcher:
            old = launcher.addresses[0]
            client = SGLangClient([old], unhealthy_timeout=120)
            launcher.procs[0].kill()
            launcher.procs[0].wait()
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", int(old.rsplit(":", 1)[1])))  # another process takes the port
            holder.listen()
            holder.settimeout(0.0)
            sup = ServerSupervisor(launcher, client, max_restarts=3, interval=0.1, events=events)
            try:
                deadline = time.monotonic() + 30
                while launcher.addresses[0] == old or client.addresses != [f"http://{launcher.addresses[0]}"]:
                    assert time.monotonic() < deadline, launcher.log_tail(0)  # the launcher moves it, then the client
                    time.sleep(0.05)
                new = launcher.addresses[0]
                assert sup.restarts == [1]
                out = asyncio.run(client.agenerate(ModelRequest([1, 2, 3], max_new_tokens=4, temperature=0.0,
                                                                ignore_eos=True)))
                assert len(out.output_tokens) == 4
                with pytest.raises(BlockingIOError):
                    holder.accept()  # nothing was sent to the process that took the old port
                launcher.procs[0].kill()  # its next restart: the new port is free again, so it stays there
                launcher.procs[0].wait()
                while sup.restarts != [2]:
                    assert time.monotonic() < deadline + 30
                    time.sleep(0.05)
                assert launcher.addresses[0] == new and client.addresses == [f"http://{new}"]
            finally:
                sup.stop()
    finally:
        holder.close()
        events.close()
    said = [r.getMessage() for r in caplog.records if "listens at" in r.getMessage()]
    assert len(said) == 1 and old in said[0] and new in said[0], said
    moved = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["server"], e["to"]) for e in moved if e.get("kind") == "server_moved"] == [(old, new)]


@pytest.mark.slow  # starts a server
def test_wrong_api_key_stops_at_once(weights_root, tmp_path):
    spec = ServerSpec("embedded", str(weights_root / "v0"), api_key="right", weights_root=str(weights_root))
    with ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120) as launcher:
        client = SGLangClient(launcher.addresses, api_key="wrong")
        t0 = time.monotonic()
        with executor(client) as ex:
            with pytest.raises(RolloutError, match=r"answered 401 .*API key is missing or wrong.*api_key_env"):
                ex.prepare_batch(ITEMS)
        assert time.monotonic() - t0 < 10
        assert ex.stats["failed"] <= 4


@pytest.mark.slow  # starts a server
def test_request_over_the_context_length_stops_at_once(server):
    client = SGLangClient(server.addresses)
    with executor(client, max_new_tokens=100_000) as ex:
        with pytest.raises(RolloutError, match=r"answered 400: .*context length.*lower rollout.max_new_tokens"):
            ex.prepare_batch(ITEMS)
    assert ex.stats["failed"] <= 4


@pytest.mark.slow  # starts a server
def test_server_answering_500_is_taken_out_although_health_answers(server):
    """A wedged engine (/generate answers 500 while /health and /model_info answer) is taken out of generation, not
    dropped for good: it is asked only by a one-token /generate probe, at most once per health_check_interval,
    until it generates again."""
    broken = BrokenServer()
    client = SGLangClient([broken.address, *server.addresses], max_retries=2, retry_backoff=0.01,
                          health_check_interval=1.0)
    with executor(client) as ex:
        for _ in range(3):
            assert len(ex.prepare_batch(ITEMS)) == 2
            ex.set_version(ex.version + 1)
    s = client.servers[0]
    assert s.dropped is None and not s.healthy and s.wedged and "answered 500 3 times in a row" in s.down
    calls, t0 = broken.generate_calls, time.monotonic()
    with executor(client) as ex:  # out: only the probe asks it, never the batch's requests
        ex.prepare_batch(ITEMS)
    assert broken.generate_calls - calls <= 1 + (time.monotonic() - t0) / client.health_check_interval

    only_broken = SGLangClient([broken.address], max_retries=2, retry_backoff=0.01, unhealthy_timeout=3,
                               health_check_interval=0.5)
    t0 = time.monotonic()
    with executor(only_broken) as ex:
        with pytest.raises(RolloutError, match=r"no usable inference server for 3s \(http://127\.0\.0\.1:\d+: "
                                               r"down \(/generate answered 500 3 times in a row.*out until a "
                                               r"/generate answers"):
            ex.prepare_batch(ITEMS)
    assert time.monotonic() - t0 < 3 + 8


@pytest.mark.slow
def test_driver_stops_when_its_only_server_dies(tmp_path):
    """Killing the only server mid-run, with no restart allowed, ends `mega-async train` within unhealthy_timeout,
    with one line naming it."""
    import os
    import subprocess
    from pathlib import Path

    import psutil

    root = Path(__file__).resolve().parents[2]
    cmd = train_command("tiny_cpu", tmp_path, "trainer.total_steps=50", "inference.unhealthy_timeout=5",
                        "inference.max_server_restarts=0")  # given up on at once
    p = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    metrics = tmp_path / "tiny_cpu" / "run0" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    servers = [c for c in psutil.Process(p.pid).children(recursive=True)
               if "mega_async.server" in " ".join(c.cmdline())]
    assert len(servers) == 1
    servers[0].kill()
    t0 = time.monotonic()
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1
    assert time.monotonic() - t0 < 5 + 60  # unhealthy_timeout plus one step's work, not a hang
    line = err.strip().splitlines()[-1]
    assert line.startswith("mega-async train: ") and "127.0.0.1" in line, err[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["distributed", "disk"])
def test_a_killed_server_is_restarted_and_serves_the_current_version(tmp_path, weight_sync):
    """kill -9 of one of two embedded servers mid-run: the run goes on with the other, the killed one is started
    again at its address, kept out until it has the current weights (distributed: the next sync builds the
    weight-update group again with it; disk: it loads the current version's directory) and then serves again;
    verify_sync checks every server's logprobs against the trainer's after every later sync."""
    import json
    import os
    import subprocess
    from pathlib import Path

    import psutil

    root = Path(__file__).resolve().parents[2]
    steps = 8
    cmd = train_command("tiny_cpu", tmp_path, f"trainer.total_steps={steps}", "parallel.allocation=sglang:d2+megatron:d1",
                        f"trainer.weight_sync={weight_sync}", "trainer.verify_sync=true")
    p = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    run = tmp_path / "tiny_cpu" / "run0"
    deadline = time.monotonic() + 600
    try:
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.1)
        servers = [c for c in psutil.Process(p.pid).children(recursive=True)
                   if "mega_async.server" in " ".join(c.cmdline())]
        assert len(servers) == 2
        servers[0].kill()
        out, err = p.communicate(timeout=900)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-3000:]
    steps_logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in steps_logged if "train/loss" in m or "step" in m]) >= steps
    log = (run / "train.log").read_text()
    assert "exited with code -9; restarting it (1 of 3)" in log
    assert "kept out until it has the current weights" in log
    assert "healthy again at the current weight version; re-admitted" in log
    if weight_sync == "distributed":
        assert "weight-update groups built again" in log
    # disk: it loads the current version by itself ("loaded version") or, found at a sync's start, gets that sync
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert any(e.get("kind") == "server_restarted" for e in events)
