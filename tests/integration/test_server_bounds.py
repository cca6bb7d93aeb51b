"""What an outsider's body may cost the embedded server (issue 18, "Also"): SGLang's --max-queued-requests
refusal, unparsable JSON answered as SGLang in one line with nothing logged, OpenAI streams whose deltas add
up to the non-streaming text (stop strings included), and max_new_tokens 0 prefilled into the radix cache."""
import json
import logging
import threading
import time
import urllib.request

import pytest

from .conftest import post
from .server_inproc import InProcessServer

PROMPT = [5, 17, 300, 42, 7, 99]
QUEUE_FULL = {"object": "error", "message": "The request queue is full.", "type": "503", "param": None, "code": 503}


@pytest.fixture(scope="module")
def bounded(weights_root):
    with InProcessServer(str(weights_root / "v0"), weights_root=str(weights_root), max_queued_requests=2) as s:
        yield s


def sse(address: str, path: str, body: dict) -> list:
    req = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        events = [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def fill_the_queue(bounded) -> tuple[dict, threading.Thread]:
    """Pause (in_place) and hold two requests, filling the queue of 2; held["r"] gets their answer."""
    addr = bounded.address
    assert post(addr, "/pause_generation", {"mode": "in_place"})[0] == 200
    held: dict = {}
    body = {"input_ids": [PROMPT, PROMPT[:3]], "sampling_params": {"max_new_tokens": 2}}
    t = threading.Thread(target=lambda: held.setdefault("r", post(addr, "/generate", body)))
    t.start()
    deadline = time.monotonic() + 30
    while bounded.server._held < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return held, t


def test_past_max_queued_requests_sglangs_503(bounded):
    """Two requests held while paused fill a queue of 2: the next body is SGLang's 503 (native and OpenAI),
    a stream's request finishes aborted with status_code 503 (native) or ends on SGLang's error chunk
    (OpenAI); the held ones run once generation continues."""
    addr = bounded.address
    held, t = fill_the_queue(bounded)
    try:
        one = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        assert post(addr, "/generate", one) == (503, QUEUE_FULL)
        assert post(addr, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}) == (503, QUEUE_FULL)
        chunks = sse(addr, "/generate", {**one, "stream": True})
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "abort", "status_code": 503,
                                                           "message": "The request queue is full."}
        chunks = sse(addr, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True})
        assert chunks == [{"error": {"object": "error", "message": "The request queue is full.",
                                     "type": "SERVICE_UNAVAILABLE", "param": None, "code": 503}}]
    finally:
        assert post(addr, "/continue_generation", {})[0] == 200
        t.join(60)
    st, outs = held["r"]
    assert st == 200 and [len(o["output_ids"]) for o in outs] == [2, 2]


@pytest.mark.parametrize("raw, what", [(b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
                                       (b'{"input_ids": [' + b"7" * 5000 + b"]}", "more than 4300 digits")],
                         ids=["deep", "bigint"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/update_weights_from_disk"])
def test_unparsable_json_is_sglangs_400_and_logs_nothing(bounded, caplog, raw, what, path):
    """Nesting past Python's parser and a 5000-digit integer: FastAPI's "There was an error parsing the body"
    in SGLang's ErrorResponse (type "400"), one line, and no traceback in the log (the old server logged one
    for every such request)."""
    with caplog.at_level(logging.INFO, logger="mega_async"):
        st, out = post(bounded.address, path, raw=raw)
    assert st == 400 and out["type"] == "400" and out["code"] == 400 and out["object"] == "error"
    assert out["message"].startswith("There was an error parsing the body") and what in out["message"]
    assert "\n" not in out["message"]
    assert not [r for r in caplog.records if r.name.startswith("mega_async") and r.levelno >= logging.WARNING]


def test_openai_stream_deltas_add_up_to_the_text(bounded):
    """Sampled output of the random tiny model (stray and split UTF-8 bytes), with and without a stop string
    taken from its own text: the concatenated stream deltas are the non-streaming text (the old stream sent
    the start of the stop string, then the whole trimmed text again)."""
    addr = bounded.address
    req = {"prompt": PROMPT, "max_tokens": 32, "temperature": 1.0, "seed": 3, "ignore_eos": True}
    st, full = post(addr, "/v1/completions", req)
    assert st == 200, full
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3].replace("\ufffd", "")
    assert stop and "\ufffd" in text  # the sampled bytes do split characters
    r = {**req, "stop": [stop]}
    want = post(addr, "/v1/completions", r)[1]["choices"][0]["text"]
    chunks = sse(addr, "/v1/completions", {**r, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want


def test_max_new_tokens_0_is_prefilled_into_the_radix_cache(bounded):
    """SGLang prefills a max_new_tokens 0 request even without logprobs (its KV enters the tree): the same
    prompt afterwards finds all but its last token cached. The old server finished it without a forward."""
    ids = [3 + (i * 7) % 1000 for i in range(90)]
    st, out = post(bounded.address, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}})
    assert st == 200 and out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length",
                                                                                           "length": 0}
    st, out = post(bounded.address, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert st == 200 and out["meta_info"]["cached_tokens"] == len(ids) - 1


def _busy_round(addr: str, n: int, hold_s: float, **client_kw):
    """n concurrent 8-token requests through SGLangClient while generation is paused for hold_s: two are held
    (the queue of 2 is full), the others are answered 503 until /continue_generation. Returns each request's
    result (a ModelResponse or the exception) and the client's servers."""
    import asyncio

    from mega_async.inference.client import SGLangClient
    from mega_async.api.types import ModelRequest

    async def main():
        client = SGLangClient([addr], retry_backoff=0.05, max_retries=1, **client_kw)
        try:
            reqs = [ModelRequest(input_ids=PROMPT[:3 + i % 3], max_new_tokens=8, ignore_eos=True) for i in range(n)]
            tasks = [asyncio.ensure_future(client.agenerate(r)) for r in reqs]
            await asyncio.sleep(hold_s)
            assert post(addr, "/continue_generation", {})[0] == 200
            return await asyncio.gather(*tasks, return_exceptions=True), client.servers
        finally:
            await client.aclose()

    assert post(addr, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        return asyncio.run(main())
    finally:
        post(addr, "/continue_generation", {})


def test_a_busy_server_is_waited_for_never_dropped(bounded, caplog):
    """SGLang answers 503 for a full queue (and for "retry later" aborts): backpressure, not a failing server. The
    client waits (Retry-After, else a growing backoff) and every request finishes; before, 503s counted as
    failures and after max_retries the server was dropped for good as a wedged engine (/model_info answers)."""
    with caplog.at_level(logging.WARNING, logger="mega_async"):
        results, servers = _busy_round(bounded.address, 5, 2.0)
    assert [type(r).__name__ for r in results] == ["ModelResponse"] * 5, results
    assert all(len(r.output_tokens) == 8 for r in results)
    assert [(s.healthy, s.dropped) for s in servers] == [(True, None)]
    assert any("is busy (503: The request queue is full.)" in r.getMessage() for r in caplog.records)


def test_busy_past_the_request_timeout_fails_in_one_line(bounded):
    """A queue that stays full past request_timeout: the request fails naming the server, the 503 and the fix."""
    import asyncio

    from mega_async.inference.client import SGLangClient
    from mega_async.api.types import ModelRequest

    addr = bounded.address
    held, t = fill_the_queue(bounded)
    try:

        async def one():
            client = SGLangClient([addr], retry_backoff=0.05, max_retries=1, request_timeout=1.0)
            try:
                return await client.agenerate(ModelRequest(input_ids=PROMPT, max_new_tokens=4))
            finally:
                await client.aclose()

        with pytest.raises(Exception) as e:
            asyncio.run(one())
    finally:
        assert post(addr, "/continue_generation", {})[0] == 200
        t.join(60)
    msg = str(e.value)
    assert "answered 503 (busy: The request queue is full.)" in msg and "--max-queued-requests" in msg, msg
    assert "\n" not in msg and held["r"][0] == 200
