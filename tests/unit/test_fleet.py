"""The simulated fleet (mega_async.inference.sim.fleet): its model, schedules and SGLang protocol, served in a thread of
this process. Cheap: latencies of a millisecond per token."""
import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from mega_async.inference.sim.fleet import Fleet, FleetConfig, random_schedule, version_of_logprob
from mega_async.inference.sim.fleet.model import TokenModel, logprob_for
from mega_async.inference.sim.fleet.schedule import FailureEvent, parse_fractions, parse_schedule
from mega_async.api.sglang_releases import BEGIN_TWICE, session_refusal

FAST = dict(length_median=40, length_sigma=0.5, token_latency_s=0.001, batch_latency_s=0.0, ttft_s=0.0,
            load_s=0.01)


def call(address, path, body=None, timeout=30.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{address}{path}", data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers.get("Content-Type", "")
    return status, (json.loads(text) if "json" in ctype and text else text)


def generate(address, prompt, max_new=200, rid=None, **extra):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "stop_token_ids": [2]},
            "return_logprob": True, **extra}
    if rid:
        body["rid"] = rid
    return call(address, "/generate", body)


def in_background(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)))
    t.start()
    return t, out


def wait_running(address, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while call(address, "/server_info")[1]["num_running_reqs"] < n:
        assert time.monotonic() < deadline, "requests never started"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def fleet():
    with Fleet(2, FleetConfig(**FAST), in_thread=True) as f:
        yield f


@pytest.fixture
def slow_fleet():
    """One server whose requests run ~2 s: pauses catch them in flight."""
    with Fleet(1, FleetConfig(**{**FAST, "token_latency_s": 0.01, "length_median": 10_000, "length_sigma": 0.0}),
               in_thread=True) as f:
        yield f


# ---- the model ---------------------------------------------------------------------------------------
def test_lengths_are_seeded_and_long_tailed():
    m = TokenModel(FleetConfig(length_median=200, length_sigma=1.0))
    lengths = sorted(m.length(k) for k in range(4000))
    assert [m.length(k) for k in range(50)] == [TokenModel(FleetConfig(length_median=200)).length(k)
                                                for k in range(50)]
    assert 170 < lengths[len(lengths) // 2] < 230  # the median
    assert lengths[int(0.99 * len(lengths))] > 5 * lengths[len(lengths) // 2]  # a long tail


@pytest.mark.parametrize("version", [0, 1, 7, 123])
def test_logprobs_encode_the_version(version):
    for u in (0.0, 0.3, 0.999):
        assert version_of_logprob(logprob_for(version, u)) == version


def test_logprob_json_is_each_tokens_own_entry_across_spans_the_pool_end_and_a_stop_token():
    import json

    from mega_async.inference.sim.fleet.model import ENTRY_TABLES, POOL_SIZE

    m = TokenModel(FleetConfig())
    for offset, n, spans in [(5, 10, [(0, 10, 3)]), (POOL_SIZE - 4, 9, [(0, 2, 1), (2, 9, 2)]),
                             (POOL_SIZE - 1, 1, [(0, 1, 0)]), (70000, 0, []),
                             (POOL_SIZE - 2, 5, [(0, 4, 1), (4, 4, 3), (4, 5, 2)]),
                             (9, 4, [(0, 4, 5), (4, 4, 6)])]:  # an empty last span: the stop token is in the one before
        ids = m.tokens(offset, n)
        if ids:
            ids[-1] = 999_999  # the stop token, put last (not the pool's)
        got = json.loads(m.logprob_json(offset, ids, spans))
        want = [[logprob_for(v, m.spread[(offset + i) % POOL_SIZE]), ids[i], None]
                for a, b, v in spans for i in range(a, b)]
        assert got == want
    before = m.logprob_json(0, m.tokens(0, 3), [(0, 3, 0)])
    for v in range(1, ENTRY_TABLES + 3):  # old versions' tables are dropped, and built again when asked
        m.logprob_json(0, m.tokens(0, 3), [(0, 3, v)])
    assert len(m._tables) == ENTRY_TABLES
    assert m.logprob_json(0, m.tokens(0, 3), [(0, 3, 0)]) == before
    warm = TokenModel(FleetConfig())
    warm.warm("7")  # what a fleet worker does for its starting version before it serves
    assert list(warm._tables) == [7]
    assert warm.logprob_json(0, warm.tokens(0, 3), [(0, 3, 7)]) == m.logprob_json(0, m.tokens(0, 3), [(0, 3, 7)])


def test_config_and_schedule_errors_are_one_line():
    with pytest.raises(ValueError, match="max_running_requests"):
        FleetConfig(max_running_requests=0)
    with pytest.raises(ValueError, match="unknown keys"):
        FleetConfig.from_dict({"lenght_median": 3})
    with pytest.raises(ValueError, match="failure kind 'melt'"):
        parse_schedule({"events": [{"server": 0, "at": 1, "kind": "melt"}]})
    with pytest.raises(ValueError, match="lacks 'at'"):
        parse_schedule([{"server": 0, "kind": "crash"}])
    with pytest.raises(ValueError, match="kind=fraction"):
        parse_fractions("crash:0.1")


def test_random_schedule_is_seeded_one_failure_per_server():
    a = random_schedule(64, 7, (10, 60), {"crash": 0.1, "hang": 0.05}, (5, 20))
    assert a == random_schedule(64, 7, (10, 60), {"crash": 0.1, "hang": 0.05}, (5, 20))
    assert a != random_schedule(64, 8, (10, 60), {"crash": 0.1, "hang": 0.05}, (5, 20))
    assert sum(e.kind == "crash" for e in a) == 6 and sum(e.kind == "hang" for e in a) == 3
    assert len({e.server for e in a}) == len(a) and all(10 <= e.at <= 60 and 5 <= e.duration <= 20 for e in a)
    assert parse_schedule({"events": [e.to_dict() for e in a]}) == a


# ---- the protocol ------------------------------------------------------------------------------------
def test_generate_answers_sglang_meta_info(fleet):
    a = fleet.addresses[0]
    status, out = generate(a, [5, 6, 7, 8], max_new=10_000, rid="m1")
    meta = out["meta_info"]
    n = len(out["output_ids"])
    assert status == 200 and meta["id"] == "m1" and meta["completion_tokens"] == n > 0
    assert meta["finish_reason"] == {"type": "stop", "matched": 2} and out["output_ids"][-1] == 2
    assert meta["weight_version"] == "0" and meta["weight_versions"] == [{"version": "0", "start": 0, "end": n}]
    assert meta["prompt_tokens"] == 4 and meta["cached_tokens"] == 0
    assert [x[1] for x in meta["output_token_logprobs"]] == out["output_ids"]
    assert {version_of_logprob(x[0]) for x in meta["output_token_logprobs"]} == {0}
    assert generate(a, [5, 6, 7, 8], max_new=10_000)[1]["output_ids"] == out["output_ids"]  # seeded by the prompt
    status, out = generate(a, [5, 6, 7, 8], max_new=3)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3} and len(out["output_ids"]) == 3
    status, out = call(a, "/generate", {"text": "hi"})
    assert status == 400 and "no tokenizer" in out["error"]["message"]
    info = call(a, "/server_info")[1]
    assert info["version"] == "0.5.23" and info["fleet"]["data_plane"] == "none" and "embedded_server" not in info
    assert call(a, "/nope")[0] == 404 and call(a, "/health")[0] == 200


def test_abort_pause_returns_partial_output_and_a_resubmission_continues_it(slow_fleet):
    a = slow_fleet.addresses[0]
    prompt = [9, 8, 7]
    t, res = in_background(generate, a, prompt, 150)
    wait_running(a, 1)
    time.sleep(0.3)
    assert call(a, "/pause_generation", {"mode": "abort"}) == (200, {"message": "Generation paused successfully.",
                                                                       "status": "ok"})
    t.join(10)
    part = res["r"][1]
    k = len(part["output_ids"])
    assert part["meta_info"]["finish_reason"]["type"] == "abort" and 0 < k < 150
    assert call(a, "/update_weights_from_disk", {"model_path": "/w/v1", "weight_version": "1",
                                                 "flush_cache": False})[0] == 200  # the KV cache stays
    t2, res2 = in_background(generate, a, prompt + part["output_ids"], 150 - k)  # held while paused
    time.sleep(0.2)
    assert t2.is_alive()
    call(a, "/continue_generation", {})
    t2.join(10)
    rest = res2["r"][1]
    assert rest["meta_info"]["finish_reason"]["type"] == "length"
    assert rest["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": 150 - k}]
    assert rest["meta_info"]["cached_tokens"] == len(prompt) + k - 1  # its KV was cached by the abort
    whole = generate(a, prompt, 150)[1]  # the same prompt without a pause: the same tokens
    assert part["output_ids"] + rest["output_ids"] == whole["output_ids"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_retract_and_in_place_spans_two_versions(slow_fleet, mode):
    a = slow_fleet.addresses[0]
    t, res = in_background(generate, a, [4, 4, 4], 120)
    wait_running(a, 1)
    time.sleep(0.3)
    call(a, "/pause_generation", {"mode": mode})
    info = call(a, "/server_info")[1]
    assert (info["num_running_reqs"], info["num_waiting_reqs"]) == ((0, 1) if mode == "retract" else (1, 0))
    if mode == "in_place":  # SGLang 0.5.21+: a flush finding running requests fails the update
        status, out = call(a, "/update_weights_from_disk", {"model_path": "/w", "weight_version": "5"})
        assert status == 400 and "cache was not flushed" in out["message"]
    status, _ = call(a, "/update_weights_from_disk", {"model_path": "/w", "weight_version": "5", "flush_cache": False})
    assert status == 200
    call(a, "/continue_generation", {})
    t.join(10)
    meta = res["r"][1]["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "5"] and spans[0]["start"] == 0 and spans[-1]["end"] == 120
    assert spans[0]["end"] == spans[1]["start"] > 0 and meta["finish_reason"]["type"] == "length"
    labels = [version_of_logprob(x[0]) for x in meta["output_token_logprobs"]]
    assert labels == [0] * spans[0]["end"] + [5] * (120 - spans[0]["end"])


def test_weight_update_control_plane_follows_sglang_0_5_23(fleet):
    a = fleet.addresses[1]
    bucket = {"names": ["w.a", "w.b"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [2, 2]],
              "group_name": "g", "load_format": "flattened_bucket", "weight_version": "3"}
    status, out = call(a, "/update_weights_from_distributed", bucket)
    assert status == 400 and out["message"] == session_refusal("update_weights_from_distributed")
    assert call(a, "/begin_weight_update", {})[0] == 200
    assert call(a, "/begin_weight_update", {})[1]["message"] == BEGIN_TWICE
    status, out = call(a, "/update_weights_from_distributed", bucket)
    assert status == 400 and "no weight update group 'g'" in out["message"]
    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 3, "group_name": "g"}
    assert call(a, "/init_weights_update_group", init) == (200, {
        "success": True, "message": "Succeeded to initialize custom process group."})
    status, out = call(a, "/update_weights_from_distributed", bucket)  # bf16 (6 bytes) then fp32 at offset 6
    assert status == 400 and "Unaligned received tensor w.b: byte offset 6" in out["message"]
    before = call(a, "/weights_checker", {"action": "checksum"})[1]["per_engine_checksum"]
    ok = {**bucket, "names": ["w.b", "w.a"], "dtypes": ["float32", "bfloat16"], "shapes": [[2, 2], [3]]}
    assert call(a, "/update_weights_from_distributed", ok)[0] == 200
    assert call(a, "/end_weight_update", {})[0] == 200
    assert call(a, "/model_info")[1]["weight_version"] == "3"
    assert call(a, "/weights_checker", {"action": "checksum"})[1]["per_engine_checksum"] != before
    assert call(a, "/destroy_weights_update_group", {"group_name": "g"})[0] == 200
    assert call(a, "/rollback_weights", {})[0] == 404  # real SGLang has none


def test_a_release_before_0_5_21_has_no_sessions():
    with Fleet(1, FleetConfig(**FAST, sglang_version="0.5.20"), in_thread=True) as f:
        a = f.addresses[0]
        assert call(a, "/begin_weight_update", {})[0] == 404
        call(a, "/init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 1,
                                               "world_size": 2})
        assert call(a, "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": [],
                                                            "weight_version": "1"})[0] == 200


def test_failures_crash_hang_error_and_restart():
    with Fleet(2, FleetConfig(**FAST), in_thread=True) as f:
        a, b = f.addresses
        call(a, "/update_weight_version", {"new_version": "4"})
        f.fail(0, "crash")
        with pytest.raises(urllib.error.URLError):
            call(a, "/health", timeout=2)
        state = f.recover(0)
        assert state["restarts"] == 1 and not state["crashed"]
        assert call(a, "/model_info")[1]["weight_version"] == "0"  # a new process: its launch weights
        f.fail(1, "error", status=502)
        assert call(b, "/generate", {"input_ids": [1]})[0] == 502 and call(b, "/health")[0] == 200
        f.recover(1)
        f.fail(1, "hang", duration=0.6)
        t0 = time.monotonic()
        assert call(b, "/health")[0] == 200 and time.monotonic() - t0 > 0.3  # held until the hang ended
        assert [s["counters"].get("crashes", 0) for s in f.state()] == [1, 0]


def test_a_scheduled_crash_happens_on_time():
    with Fleet(2, FleetConfig(**FAST), in_thread=True, schedule=[FailureEvent(1, 0.3, "crash", 0.5)]) as f:
        assert call(f.addresses[1], "/health")[0] == 200
        time.sleep(0.5)
        assert f.state()[1]["crashed"]
        time.sleep(0.6)
        assert call(f.addresses[1], "/health")[0] == 200 and f.state()[1]["restarts"] == 1


def test_fleet_processes_serve_many_servers_without_torch(tmp_path):
    with Fleet(40, FleetConfig(**FAST), procs=2, log_dir=str(tmp_path)) as f:
        assert len(set(f.addresses)) == 40
        status, out = generate(f.addresses[39], [1, 2], 5)
        assert status == 200 and len(out["output_ids"]) == 5
        assert len(f.state()) == 40
    code = "import sys, mega_async.inference.sim.fleet.host; print('torch' in sys.modules)"
    import subprocess
    import sys

    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_fleet_workers_end_with_the_process_that_started_them(tmp_path):
    """kill -9 of a benchmark or test that started a fleet leaves no worker serving (before: they kept running,
    ports held, until someone found them)."""
    import os
    import signal
    import subprocess
    import sys

    code = ("import sys, time; from mega_async.inference.sim.fleet import Fleet, FleetConfig; "
            "f = Fleet(2, FleetConfig(), procs=2); f.start(); "
            "print(' '.join(str(p.pid) for p in f._workers), flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(x) for x in p.stdout.readline().split()]
        assert len(workers) == 2
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 30
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [w for w in alive if os.path.exists(f"/proc/{w}") and open(f"/proc/{w}/stat").read().split()[2] != "Z"]
        time.sleep(0.1)
    for w in alive:
        os.kill(w, signal.SIGKILL)
    assert alive == [], f"fleet workers {alive} outlived the process that started them"


def test_many_requests_over_one_loop(fleet):
    async def main():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async def one(i):
                async with s.post(f"http://{fleet.addresses[i % 2]}/generate", json={
                        "input_ids": [i, i + 1], "sampling_params": {"max_new_tokens": 30}}) as r:
                    return (await r.json())["meta_info"]["completion_tokens"]
            return await asyncio.gather(*(one(i) for i in range(300)))

    lengths = asyncio.run(main())
    assert len(lengths) == 300 and all(1 <= n <= 30 for n in lengths)
