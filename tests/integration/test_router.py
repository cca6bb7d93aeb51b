"""A real router, `smg` 1.13.0 (PyPI; installed into the engine's environment by tools/install_sglang_cpu.sh), in front of
a real SGLang 0.5.23 CPU server and an embedded server (this machine runs one real server at a time: two would need
6 GB and both cores while other sessions run; docs/inference.md, "A router in front"): generation through it keeps
SGLang's fields (routed experts, logprobs, per-token weight versions) and reaches both workers; its RL control plane
(`--enable-rl`, `/v1/rl/engine/<route>`) fans pause, weight-update sessions, disk loads, version labels, flush and
continue out to both, as straight calls to the workers would.
"""
import base64
import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from mega_async.comm import free_port
from mega_async.inference import sglang_cpu
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.model_cards import ensure_weights
from .conftest import REAL_ENGINE, get, post

pytestmark = REAL_ENGINE

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "models" / "tiny-qwen3-moe"
P = [3, 14, 15, 92, 65, 35]
SELECT = "?selector=engine%3Dsglang"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(router address, [real server, embedded server]); smg from the engine's environment."""
    ensure_weights(CARD)
    logs = tmp_path_factory.mktemp("router")
    smg = Path(os.environ[sglang_cpu.VENV_ENV]) / "bin" / "smg"
    assert smg.exists(), f"{smg}: smg is not installed in the engine's environment; run tools/install_sglang_cpu.sh"
    extra = ["--enable-return-routed-experts"]
    real = ServerSpec("sglang", str(CARD), device="cpu", dtype="float32", num_threads=1, extra_args=extra)
    emb = ServerSpec("embedded", str(CARD), dtype="float32", num_threads=1, extra_args=extra)
    with ServerLauncher(real, log_dir=str(logs / "real"), startup_timeout=400) as a, \
            ServerLauncher(emb, log_dir=str(logs / "embedded"), startup_timeout=200) as b:
        workers = a.addresses + b.addresses
        port = free_port()
        with open(logs / "smg.log", "w") as log:
            proc = subprocess.Popen([str(smg), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                                     *[f"http://{w}" for w in workers], "--enable-rl", "--policy", "round_robin",
                                     "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        try:
            router = f"127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    if get(router, "/v1/rl/workers")[1]["workers"][1]["health"] == "ready":
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, (logs / "smg.log").read_text()[-2000:]
                time.sleep(0.3)
            yield router, workers
        finally:
            proc.terminate()
            proc.wait(10)


def fanout(router: str, route: str, body: dict) -> dict:
    status, out = post(router, f"/v1/rl/engine/{route}{SELECT}", body)
    assert status == 200 and out["succeeded"] == 2 and out["failed"] == [], out
    return out


def test_generation_through_the_router_keeps_sglangs_fields_and_reaches_both(fleet):
    router, workers = fleet
    for w, label in zip(workers, ("real", "embedded")):  # each worker names itself in its answers' versions
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
    assert seen == {"real", "embedded"}


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
