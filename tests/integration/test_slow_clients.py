"""Slow and half-sent requests against the embedded server as the CLI runs it (issue 33 item 5): 1,100 connections
that sent half a request took every descriptor of a server with 1,024, and /health stopped answering."""
import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from mega_async.utils.comm import free_port

FDS = 1024  # the server's open-file limit, soft and hard (as in the report)


def _start(model: str, log: Path, *flags: str):
    port = free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FDS, FDS))

    proc = subprocess.Popen([sys.executable, "-m", "mega_async.server", "--model", model, "--port",
                             str(port), "--log-level", "WARNING", *flags], preexec_fn=limit,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"the server did not start:\n{log.read_text()[-3000:]}")


@pytest.fixture
def tiny_server(weights_root, tmp_path, request):
    log = tmp_path / "server.log"
    proc, port = _start(str(weights_root / "v0"), log, *getattr(request, "param", ()))
    yield port, log
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _health(port: int, timeout: float):
    """Seconds /health took (a fresh connection each time), or None when it did not answer 200 in `timeout`."""
    t = time.monotonic()
    try:
        r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
        try:
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            line = await asyncio.wait_for(r.readline(), max(0.01, timeout - (time.monotonic() - t)))
        finally:
            w.close()
        return time.monotonic() - t if b" 200 " in line else None
    except (OSError, asyncio.TimeoutError):
        return None


async def _slow_client(port: int, stop: float, body: bool) -> int:
    """Half a request, then a byte a second (a header line, or the body's next byte), reconnecting a second after
    the server closes it, until `stop`. Returns the connections it opened."""
    opened = 0
    while time.monotonic() < stop:
        try:
            r, w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(1.0)
            continue
        opened += 1
        try:
            w.write(b"POST /generate HTTP/1.1\r\nHost: x\r\n" + (b"Content-Length: 100000\r\n\r\n{" if body else b""))
            i = 0
            while time.monotonic() < stop and not r.at_eof():
                i += 1
                w.write(b" " if body else b"X-%d: 1\r\n" % i)
                await w.drain()
                try:
                    await asyncio.wait_for(r.read(1024), 1.0)
                except asyncio.TimeoutError:
                    pass
        except OSError:
            pass
        finally:
            w.close()
        await asyncio.sleep(1.0)
    return opened


def test_slow_half_sent_requests_do_not_lock_out_health(tiny_server):
    """1,100 clients that send half a request (600 a header line a second, 500 a body byte a second) against a
    server limited to 1,024 descriptors, for 12 s: /health (a new connection each time) keeps answering within 5 s
    (all but the odd probe on a loaded machine: the CPU is shared with the 1,100 clients), and accept() never ran
    out of descriptors. The old server: 1 of 4 probes answered (the rest timed out), 100k 'Too many open files'."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"needs 1,400 open files here (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 16, hard))
    port, log = tiny_server

    async def main():
        stop = time.monotonic() + 12
        clients = [asyncio.ensure_future(_slow_client(port, stop, body=i >= 600)) for i in range(1100)]
        await asyncio.sleep(3)  # all of them connected (or turned away) by now
        latencies = []
        while time.monotonic() < stop - 0.5:
            latencies.append(await _health(port, 5.0))
            await asyncio.sleep(0.3)
        return latencies, sum(await asyncio.gather(*clients))

    try:
        latencies, opened = asyncio.run(main())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    text = log.read_text()
    assert opened >= 1100 and len(latencies) >= 10
    answered = len(latencies) - latencies.count(None)
    assert answered >= 0.8 * len(latencies), f"/health answered {answered} of {len(latencies)} times: {latencies}"
    assert "Too many open files" not in text, text[-2000:]
    assert "made room at the limit" in text  # the log says what happened, once (not a line per connection)


@pytest.mark.parametrize("tiny_server", [("--header-timeout", "1", "--body-timeout", "1")], indirect=True)
def test_a_header_or_body_that_does_not_arrive_in_time_is_cut_off(tiny_server):
    """Half a header: the connection closes within the header timeout; a header whose body stops: 408, then the
    connection closes; a whole request still works on a kept-alive connection and after a pause."""
    port, _ = tiny_server

    def exchange(first: bytes) -> tuple[bytes, float]:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        t = time.monotonic()
        s.sendall(first)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except socket.timeout:
            pass
        s.close()
        return out, time.monotonic() - t

    out, took = exchange(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Ty")
    assert out == b"" and 0.8 < took < 4, (out, took)
    out, took = exchange(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"input_ids\"")
    assert out.startswith(b"HTTP/1.1 408") and b"request body not received within 1s" in out and took < 4, out
    body = json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    for pause in (0, 1.5):  # kept alive: idle longer than the header timeout is fine, a request then arrives whole
        time.sleep(pause)
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % len(body) + body)
        out = b""
        while b"\r\n\r\n" not in out:
            out += s.recv(65536)
        head, _, rest = out.partition(b"\r\n\r\n")
        size = int(next(v for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                        if k.lower() == b"content-length"))
        while len(rest) < size:
            rest += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 200") and len(json.loads(rest)["output_ids"]) == 2, out
    s.close()


@pytest.mark.parametrize("tiny_server", [("--body-timeout", "30", "--max-body-bytes", "4000000")], indirect=True)
def test_request_bodies_held_at_once_are_bounded(tiny_server):
    """Bodies are counted from their Content-Length before a byte is read: with 3 MB being received, a second 3 MB
    body (past the 4 MB budget) is answered 503 + Retry-After at once, unread, while small requests go on; when
    the first ends (its client gone) the budget is back. Before: 1,000 connections each sending 64 MiB would hold
    64 GB (client_max_size is per request)."""
    port, _ = tiny_server
    big = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3000000\r\n\r\n"

    def answer(s: socket.socket) -> bytes:
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out

    s1 = socket.create_connection(("127.0.0.1", port), timeout=30)
    s1.sendall(big + b'{"input_ids": [5, 6], ')  # held: 3 MB of budget while the rest never comes
    time.sleep(0.5)
    s2 = socket.create_connection(("127.0.0.1", port), timeout=30)
    s2.sendall(big)
    out = answer(s2)
    s2.close()
    assert out.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in out, out[:300]
    body = json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # a small body still fits beside the held 3 MB
        assert r.status == 200 and len(json.loads(r.read())["output_ids"]) == 2
    s1.close()  # its handler ends: the 3 MB go back
    pad = b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}, "rid": "'
    whole = pad + b"r" * (3000000 - len(pad) - 2) + b'"}'
    for _ in range(50):  # the server notices the closed connection within a moment
        s3 = socket.create_connection(("127.0.0.1", port), timeout=30)
        s3.sendall(big + whole)
        out = answer(s3)
        s3.close()
        if not out.startswith(b"HTTP/1.1 503"):
            break
        time.sleep(0.2)
    assert out.split(b"\r\n", 1)[0] in (b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request"), out[:300]
