"""Shared fixtures: tiny model weights (two versions) and embedded servers started by the launcher."""
import asyncio
import os
import json
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from mega_async.inference.sglang import cpu as sglang_cpu
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights


@pytest.fixture(scope="session")
def weights_root(tmp_path_factory) -> Path:
    """<root>/v0 and <root>/v1: the tiny Qwen3-MoE with two different random inits."""
    root = tmp_path_factory.mktemp("weights")
    init_random_weights(TINY_MOE, root / "v0", seed=0)
    init_random_weights(TINY_MOE, root / "v1", seed=1)
    return root


@pytest.fixture(scope="session")
def hf_models(weights_root):
    from transformers import AutoModelForCausalLM

    return {v: AutoModelForCausalLM.from_pretrained(weights_root / v, dtype=torch.float32).eval() for v in ("v0", "v1")}


@pytest.fixture(scope="module")
def server(weights_root, tmp_path_factory):
    spec = ServerSpec("embedded", str(weights_root / "v0"), num_servers=1, weights_root=str(weights_root))
    with ServerLauncher(spec, log_dir=str(tmp_path_factory.mktemp("logs")), startup_timeout=120) as launcher:
        yield launcher


def post(address: str, path: str, body=None, raw: bytes | None = None, headers=None):
    """Plain HTTP POST (urllib), returning (status, parsed JSON or text)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(f"http://{address}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    return _send(req)


def get(address: str, path: str, headers=None):
    return _send(urllib.request.Request(f"http://{address}{path}", headers=headers or {}))


def wait_decoding(address: str, past: int, requests: int = 1, timeout: float = 120.0) -> dict:
    """Wait for the event a test orders on, not for a guessed time: `requests` requests running on the embedded
    server at `address` with more than `past` tokens between them (prompts plus outputs: `/v1/loads`'
    num_active_tokens), i.e. already decoding. Returns that load snapshot; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    load: dict = {}
    while time.monotonic() < deadline:
        status, out = get(address, "/v1/loads")
        load = out["loads"][0] if status == 200 and out.get("loads") else {}
        if load.get("num_running_reqs", 0) >= requests and load.get("num_active_tokens", 0) > past:
            return load
        time.sleep(0.01)
    raise AssertionError(f"no {requests} request(s) decoding past {past} tokens on {address} within {timeout:g}s "
                         f"(last load: {load})")


def _send(req):
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, text, ctype = e.code, e.read().decode(), e.headers.get("Content-Type", "")
    return status, (json.loads(text) if "json" in ctype and text else text)


def ref_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from a plain transformers forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    T = temperature if temperature > 1e-6 else 1.0
    lp = torch.log_softmax(logits / T, -1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def greedy_ok(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Per output token: is it the argmax of `model` given everything before it?"""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1) == torch.tensor(output)


def run(coro):
    return asyncio.run(coro)


# the real SGLang CPU engine's tests: slow, marked sglang, skipped (saying how to build it) without its environment
REAL_ENGINE = [
    pytest.mark.slow, pytest.mark.sglang,
    pytest.mark.skipif(not os.environ.get(sglang_cpu.VENV_ENV),
                       reason=f"the real SGLang engine's environment is not built here: run "
                              f"`bash tools/install_sglang_cpu.sh` and export {sglang_cpu.VENV_ENV}=<its directory>"),
]
