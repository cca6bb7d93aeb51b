"""Routed experts end to end: the embedded server (--enable-return-routed-experts) through the real client.
The routes equal the top-k of the transformers router on the same tokens, and a request interrupted by a
weight update keeps, for every token generated before it, the routes of the old weights."""
import asyncio

import pytest
import torch

from mega_async.inference.client import SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.rollout.workflow import trajectory_from_response
from mega_async.trainer.sync import reload_sync, RolloutSide
from mega_async.api.types import ModelRequest, WeightVersion

PROMPT = [5, 17, 300, 42, 7, 99]


@pytest.fixture(scope="module")
def routed_server(weights_root, tmp_path_factory):
    spec = ServerSpec("embedded", str(weights_root / "v0"), weights_root=str(weights_root),
                      extra_args=["--enable-return-routed-experts"])
    with ServerLauncher(spec, log_dir=str(tmp_path_factory.mktemp("logs")), startup_timeout=120) as launcher:
        yield launcher


def hf_topk(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), layers * k] top-k expert ids of every position's forward in transformers."""
    gates = [layer.mlp.gate for layer in model.model.layers]
    seen = []
    hooks = [g.register_forward_hook(lambda m, a, out: seen.append(out[2])) for g in gates]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, 1).reshape(len(ids), -1).int()


@pytest.mark.slow  # a server of its own (the default suite's budget); tests/unit/test_routes.py covers the merging
def test_routes_equal_the_transformers_router(routed_server, hf_models):
    client = SGLangClient(routed_server.addresses)

    async def main():
        try:
            return await client.agenerate(ModelRequest(PROMPT, max_new_tokens=24, temperature=0.7,
                                                       return_routed_experts=True))
        finally:
            await client.aclose()

    resp = asyncio.run(main())
    seq = PROMPT + resp.output_tokens
    assert resp.routed_experts.shape[0] == len(seq) - 1  # the last token was never forwarded
    assert resp.routed_experts.equal(hf_topk(hf_models["v0"], seq)[:-1])
    traj = trajectory_from_response(PROMPT, resp, 1.0)
    assert traj["routed_experts"].shape[:2] == traj["versions"].shape


@pytest.mark.slow
def test_interrupted_request_keeps_each_tokens_routes(routed_server, hf_models, weights_root):
    """A request cut after 12 tokens at v0, the servers updated to v1, then resumed by the client (the path an
    abort-mode pause takes; deterministic here): rows before the switch keep v0's routes, the rest are v1's."""
    version = WeightVersion()
    client = SGLangClient(routed_server.addresses, version=version.view())
    sync = reload_sync(version, RolloutSide(client), str(weights_root / "v1"))

    async def update(v: int) -> None:  # the sync's pause bracket around loading v{v % 2} at version v
        sync.transport.path = str(weights_root / f"v{v % 2}")
        await asyncio.to_thread(sync.push)
        assert version.value == v

    async def main():
        try:
            first = await client.agenerate(ModelRequest(PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True,
                                                        return_routed_experts=True))
            await update(1)
            req = ModelRequest(PROMPT, max_new_tokens=24, temperature=0.0, ignore_eos=True, return_routed_experts=True)
            resp = await client.agenerate(req, resume=first)
            await update(2)  # back to v0's weights for the rest of the module
            return resp
        finally:
            sync.close()
            await client.aclose()

    resp = asyncio.run(main())
    assert resp.output_versions == [0] * 12 + [1] * 12
    seq = PROMPT + resp.output_tokens
    cut = len(PROMPT) + 12 - 1  # the forward at `cut` sampled the first v1 token
    routes = resp.routed_experts
    assert routes.shape[0] == len(seq) - 1
    old, new = hf_topk(hf_models["v0"], seq)[:-1], hf_topk(hf_models["v1"], seq)[:-1]
    assert routes[:cut].equal(old[:cut])  # generated before the update: the old weights' routes, kept
    assert routes[cut:].equal(new[cut:])  # generated after it: the new weights' routes
    assert not old[:cut].equal(new[:cut])  # (the two versions do route differently)


@pytest.mark.slow  # a 3-step driver run: about two minutes on 2 loaded cores
def test_driver_trains_with_routing_replay(tmp_path):
    """`mega-async train` with algorithm.routing_replay=true and a bfloat16 server: routes flow from the server
    through the rollouts into every training step, whose forward uses the rollout's experts on every token."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_train_driver import ROOT, leftovers, train_cmd

    from mega_async.bridge.model_cards import TINY_MOE, init_random_weights

    model = init_random_weights(TINY_MOE, tmp_path / "moe", seed=2)
    cmd = train_cmd(model, tmp_path, "sglang:d1+megatron:d1", "algorithm.routing_replay=true",
                    "inference.extra_args=[--dtype,bfloat16]", "trainer.verify_sync_tol=0.05")  # bf16 server
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    steps = [json.loads(x) for x in (tmp_path / "runs" / "tiny_cpu" / "run0" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    measured = [s for s in steps if s.get("train/mismatch/current_tokens", 0) > 0]
    assert measured, "no step had tokens from the current version"
    for s in measured:
        assert s["train/mismatch/route_set_frac"] == 0.0 and "train/mismatch/route_set_frac/layer0" in s
        assert 0 < s["train/mismatch/logprob_abs_mean"] <= s["train/mismatch/logprob_abs_max"]  # bf16 vs fp32
    assert not leftovers(tmp_path)
