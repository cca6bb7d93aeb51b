"""A real router, `smg` 1.13.0 (PyPI; installed into the engine's environment by tools/install_sglang_cpu.sh), in front of
two real SGLang 0.5.23 CPU servers: generation through it keeps SGLang's fields (routed experts, logprobs, per-token
weight versions) and reaches both workers; its RL control plane (`--enable-rl`, `/v1/rl/engine/<route>`) fans pause,
weight-update sessions, disk loads, version labels, flush and continue out to both, as straight calls to the workers
would; a training run sends its generation through it (inference.router_address) with control and weights straight
to the workers, and a run that starts smg itself (inference.router=smg) keeps a server behind the synced weights out
of generation by going around the router until it is back.
"""
import asyncio
import base64
import json
import os
import socket
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest
import torch

from mega_async.api.config_load import load_config
from mega_async.inference.sglang import cpu as sglang_cpu
from mega_async.inference.router import RouterLauncher
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import ensure_weights
from mega_async.api.types import ModelRequest, WeightVersion
from tests.commands import train_command
from .conftest import REAL_ENGINE, get, post

pytestmark = REAL_ENGINE

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "models" / "tiny-qwen3-moe"
P = [3, 14, 15, 92, 65, 35]
SELECT = "?selector=engine%3Dsglang"


def smg_path() -> Path:
    smg = Path(os.environ[sglang_cpu.VENV_ENV]) / "bin" / "smg"
    assert smg.exists(), f"{smg}: smg is not installed in the engine's environment; run tools/install_sglang_cpu.sh"
    return smg


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(router address, [real server, real server]): two real CPU servers (one thread each) behind smg."""
    ensure_weights(CARD)
    logs = tmp_path_factory.mktemp("router")
    real = ServerSpec("sglang", str(CARD), num_servers=2, device="cpu", dtype="float32", num_threads=1,
                      extra_args=["--enable-return-routed-experts"])
    with ServerLauncher(real, log_dir=str(logs / "real"), startup_timeout=400) as servers:
        workers = servers.addresses
        router = RouterLauncher(str(smg_path()), workers, args=["--enable-rl", "--policy", "round_robin"],
                                log_path=logs / "smg.log", startup_timeout=60)
        try:
            yield router.start(), workers  # ready: smg reports both workers healthy
        finally:
            router.stop()


def fanout(router: str, route: str, body: dict) -> dict:
    status, out = post(router, f"/v1/rl/engine/{route}{SELECT}", body)
    assert status == 200 and out["succeeded"] == 2 and out["failed"] == [], out
    return out


def test_generation_through_the_router_keeps_sglangs_fields_and_reaches_both(fleet):
    router, workers = fleet
    for w, label in zip(workers, ("a", "b")):  # each worker names itself in its answers' versions
        assert post(w, "/update_weight_version", {"new_version": label})[0] == 200
    cfg = json.loads((CARD / "config.json").read_text())
    seen = set()
    for _ in range(4):
        status, out = post(router, "/generate", {"input_ids": P, "return_logprob": True, "return_routed_experts": True,
                                                 "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert status == 200, out
        meta = out["meta_info"]
        seen.add(meta["weight_version"])
        assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 3}]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        routes = base64.b64decode(meta["routed_experts"])  # int32, (tokens - 1) x layers x top-k
        assert len(routes) == 4 * (len(P) + 3 - 1) * cfg["num_hidden_layers"] * cfg["num_experts_per_tok"]
        assert torch.frombuffer(bytearray(routes), dtype=torch.int32).max() < cfg["num_experts"]
    assert seen == {"a", "b"}


def test_rl_fanout_pauses_updates_and_continues_both_workers(fleet):
    router, workers = fleet
    status, listing = get(router, "/v1/rl/workers")
    assert status == 200 and sorted(w["url"] for w in listing["workers"]) == sorted(f"http://{w}" for w in workers)
    fanout(router, "pause_generation", {"mode": "abort"})
    try:
        fanout(router, "begin_weight_update", {"selector": "all"})
        fanout(router, "end_weight_update", {})
        loaded = fanout(router, "update_weights_from_disk", {"model_path": str(CARD), "weight_version": "9"})
        assert all(r["body"]["success"] for r in loaded["results"].values())
        fanout(router, "flush_cache", {})
    finally:
        fanout(router, "continue_generation", {})
    for w in workers:
        assert get(w, "/model_info")[1]["weight_version"] == "9"
    status, out = post(router, "/generate", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and out["meta_info"]["weight_version"] == "9"  # continued: both generate again


def test_a_router_whose_port_is_taken_before_it_binds_is_started_at_another(fleet, tmp_path, monkeypatch):
    import mega_async.inference.router as router_module

    _, workers = fleet
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    given = iter([held.getsockname()[1]])
    real = router_module.free_port
    monkeypatch.setattr(router_module, "free_port", lambda host="127.0.0.1": next(given, None) or real(host))
    router = RouterLauncher(str(smg_path()), workers, log_path=tmp_path / "smg.log", startup_timeout=60)
    try:
        address = router.start()
        assert address != f"127.0.0.1:{held.getsockname()[1]}"
        assert get(address, "/readiness")[0] == 200
        log = (tmp_path / "smg.log").read_text()  # one start lost the port, the next one serves
        assert log.count("Error starting router") == 1 and "Address already in use" in log, log[-2000:]
    finally:
        router.stop()
        held.close()


def test_a_worker_that_moved_to_another_port_is_reached_there_after_the_router_is_started_again(fleet, tmp_path):
    """RouterLauncher.readdress (the run restarted a server at another port): smg, whose worker list is fixed at
    launch, is started again over the new list, at its address, and routes to the worker at its new address."""
    _, workers = fleet
    for w, label in zip(workers, ("old", "new")):
        assert post(w, "/update_weight_version", {"new_version": label})[0] == 200
    router = RouterLauncher(str(smg_path()), [workers[0]], args=["--enable-rl"], log_path=tmp_path / "smg.log",
                            startup_timeout=60)
    try:
        address = router.start()
        with pytest.raises(ValueError, match="is not one of the router's workers"):
            router.readdress("127.0.0.1:1", workers[1])
        router.readdress(workers[0], workers[1])
        assert router.address == address and router.workers == [workers[1]]
        deadline = time.monotonic() + 60
        while True:
            try:  # refused while the new smg starts
                status, listing = get(address, "/v1/rl/workers")
                ready = get(address, "/readiness")[1]
            except urllib.error.URLError:
                status = None
            if status == 200 and [w["url"] for w in listing["workers"]] == [f"http://{workers[1]}"] and \
                    isinstance(ready, dict) and ready.get("healthy_workers") == 1:
                break
            assert time.monotonic() < deadline and router.exited() is None, router.log_tail()
            time.sleep(0.2)
        status, out = post(address, "/generate", {"input_ids": P, "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and out["meta_info"]["weight_version"] == "new", out
    finally:
        router.stop()


def test_a_run_generates_through_the_router_with_control_and_weights_straight_to_the_workers(fleet, tmp_path):
    """The tiny run on the two real servers with its generation through smg (inference.router_address): every
    answer came through the router with the engine's routed experts (replayed by the trainer, R3, with no route
    mismatch), every step's weights were broadcast into both workers (distributed sync, verified against the
    trainer's logprobs) with retract pauses, and both end at the run's last version."""
    router, workers = fleet
    steps = 4
    for w in workers:  # the card's weights (the fan-out test loaded them) under the run's first version, 0
        assert post(w, "/update_weight_version", {"new_version": "0"})[0] == 200
    config = ROOT / "configs" / "tiny_cpu_sglang.yaml"
    out = subprocess.run(train_command(config, tmp_path, f"trainer.total_steps={steps}",
                                       "parallel.allocation=sglang:d2+megatron:d1",
                                       f"inference.addresses=[{','.join(workers)}]", f"inference.router_address={router}",
                                       "algorithm.routing_replay=true", "rollout.interrupt=retract"),
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = next(tmp_path.glob("*/*/metrics.jsonl")).parent
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(steps))
    last = history[-1]
    assert last["router/answers"] > 0 and last["router/around"] == 0, last
    assert all(m["sync/verify_max_abs_diff"] < 1e-4 for m in history)
    # the engine's routed experts came back through smg: replayed with no mismatch. Routes are compared on the tokens
    # the current version generated; a step whose batch is all one version old (eta 1, under load) has none
    current = [m for m in history if m["train/mismatch/current_tokens"] > 0]
    assert current and history[0] in current  # the first step's tokens are all version 0's
    for m in current:
        assert m["train/mismatch/route_top1_frac"] == 0 and m["train/mismatch/route_set_frac"] == 0, m
    for w in workers:
        assert get(w, "/model_info")[1]["weight_version"] == str(steps)


def test_a_server_behind_the_synced_weights_is_kept_out_by_going_around_the_router(tmp_path):
    """inference.router=smg: the run starts smg in front of the servers it launched (embedded here: the client's
    logic is the same for every engine). A server found at an older weight version than the synced one is out of
    generation, so generation goes straight to the serving server, never through the router (which would still send
    it requests); once the server is back at the synced version, generation goes through the router again. A router
    that dies is gone around, restarted by the run, and used again."""
    from mega_async.inference.service import InferenceService

    cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", [
        f"logging.root_dir={tmp_path}", "parallel.allocation=sglang:d2+megatron:d1", "inference.router=smg",
        "inference.router_args=[--policy,round_robin]"])
    version = WeightVersion()
    service = InferenceService(cfg, version)
    try:
        assert service.router is not None and service.router.proc.poll() is None
        client = service.engine
        a, b = service.addresses

        def ask(n: int) -> list:
            async def go():
                reqs = [ModelRequest(rid=f"q{time.monotonic_ns()}-{i}", input_ids=P, max_new_tokens=3)
                        for i in range(n)]
                return await asyncio.gather(*(client.agenerate(r) for r in reqs))
            return asyncio.run(go())

        ask(4)
        assert client.router_stats() == {"answers": 4, "around": 0}
        for w in (a, b):  # as a sync leaves them: both at version 3
            assert post(w, "/update_weight_version", {"new_version": "3"})[0] == 200
        client.synced(3)
        version.set(3)
        assert post(b, "/update_weight_version", {"new_version": "2"})[0] == 200  # b restarted at older weights
        got = ask(8)
        assert all(set(r.output_versions) == {3} for r in got), [r.output_versions for r in got]
        stats = client.router_stats()
        assert stats["around"] >= 1, stats  # b was found behind: around the router to a
        assert not next(s for s in client.servers if s.address.endswith(b)).healthy
        around = stats["around"]
        assert post(b, "/update_weight_version", {"new_version": "3"})[0] == 200  # b has the synced weights again
        time.sleep(client.health_check_interval + 0.1)
        ask(1)  # on its way (around the router: b is still out) the request probes b, which is re-admitted
        assert next(s for s in client.servers if s.address.endswith(b)).healthy
        before = client.router_stats()
        ask(6)  # every server serves again: through the router
        stats = client.router_stats()
        assert stats == {"answers": before["answers"] + 6, "around": before["around"]}, (before, stats)
        assert before["around"] <= around + 1
        service.router.proc.kill()  # the router dies: generation goes around it; the run restarts it
        service.router.proc.wait()
        got = ask(4)
        assert all(set(r.output_versions) == {3} for r in got)
        deadline = time.monotonic() + 60
        while client.router_stats()["answers"] == stats["answers"]:  # restarted: through it again
            assert time.monotonic() < deadline, client.router_stats()
            time.sleep(0.5)
            ask(1)
        assert service._supervisor.router_restarts == 1
    finally:
        service.close()
    assert service.router.proc.poll() is not None  # stopped with the servers: nothing left behind
