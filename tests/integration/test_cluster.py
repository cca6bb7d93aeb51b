"""Several embedded servers from the launcher: failover, API key, no orphans, and the rollout core end to end."""
import asyncio
import os
import time

import pytest

from mega_async.inference.client import NoHealthyServerError, SGLangClient
from mega_async.inference.servers import ServerLauncher, ServerSpec, server_command
from mega_async.rollout.executor import WorkflowExecutor
from mega_async.rollout.workflow import GroupWorkflow, RLVRWorkflow
from mega_async.trainer.sync import reload_sync, RolloutSide
from mega_async.api.types import ModelRequest, WeightVersion

from .conftest import get, post, run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_one_server_mid_rollout_then_both(weights_root, tmp_path):
    spec = ServerSpec("embedded", str(weights_root / "v0"), num_servers=2, weights_root=str(weights_root))
    launcher = ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120)
    launcher.start()
    pids = [p.pid for p in launcher.procs]
    try:
        client = SGLangClient(launcher.addresses, unhealthy_timeout=3.0, health_check_interval=0.5, retry_backoff=0.05)

        async def main():
            reqs = [ModelRequest(input_ids=[1 + i, 2, 3], max_new_tokens=400, temperature=1.0, ignore_eos=True)
                    for i in range(12)]
            tasks = [asyncio.create_task(client.agenerate(r)) for r in reqs]
            await asyncio.sleep(0.6)
            assert all(s.in_flight > 0 for s in client.servers)  # both servers were busy
            launcher.kill(0)
            resps = await asyncio.gather(*tasks)
            assert all(len(r.output_tokens) == 400 and r.stop_reason == "length" for r in resps)
            assert not client.servers[0].healthy
            launcher.kill(1)
            t0 = time.monotonic()
            with pytest.raises(NoHealthyServerError, match="no usable inference server"):
                await client.agenerate(ModelRequest(input_ids=[1, 2], max_new_tokens=4))
            elapsed = time.monotonic() - t0
            await client.aclose()
            return elapsed

        elapsed = run(main())
        assert elapsed < 3.0 + 2.5  # the configured timeout plus one probe round, not a hang
    finally:
        launcher.stop()
    assert not any(_alive(p) for p in pids)


def test_api_key_and_commands(weights_root, tmp_path):
    spec = ServerSpec("embedded", str(weights_root / "v0"), api_key="s3cret", weights_root=str(weights_root))
    with ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120) as launcher:
        addr = launcher.addresses[0]
        assert get(addr, "/health")[0] == 200  # always open
        st, out = get(addr, "/model_info")
        assert st == 401 and out == {"error": "Unauthorized"}
        st, out = get(addr, "/model_info", headers={"Authorization": "Bearer s3cret"})
        assert st == 200
        client = SGLangClient([addr], api_key="s3cret")

        async def main():
            r = await client.agenerate(ModelRequest(input_ids=[1, 2, 3], max_new_tokens=4))
            await client.aclose()
            return r

        assert len(run(main()).output_tokens) == 4
        pid = launcher.procs[0].pid
        assert b"s3cret" not in open(f"/proc/{pid}/cmdline", "rb").read()  # the key travels in the environment
    keyed = server_command(ServerSpec("sglang", "/m", api_key="s3cret"), 30000)
    assert "mega_async.inference.sglang.entry" in keyed and "--api-key" not in keyed and "s3cret" not in keyed
    assert not _alive(pid)
    sg = ServerSpec("sglang", "/m", tp_size=16, ep_size=16, dp_size=2, enable_dp_attention=True,
                    moe_a2a_backend="deepep", extra_args=["--enable-eplb"])
    cmd = server_command(sg, 30000)
    for flag in ("sglang.launch_server", "--tp-size", "--ep-size", "--enable-dp-attention", "--moe-a2a-backend",
                 "deepep", "--enable-eplb", "--disable-radix-cache"):
        assert flag in cmd
    # servers after the trainer's GPUs: server i starts at base + i * tp
    two = ServerSpec("sglang", "/m", num_servers=2, tp_size=2, base_gpu_id=4)
    assert [c[c.index("--base-gpu-id") + 1] for c in (server_command(two, 1, 0), server_command(two, 2, 1))] == ["4", "6"]


def test_launcher_reports_a_server_that_fails_to_start(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "not-a-model"}')
    launcher = ServerLauncher(ServerSpec("embedded", str(bad)), log_dir=str(tmp_path / "logs"), startup_timeout=60)
    with pytest.raises(RuntimeError, match="exited with code"):
        launcher.start()
    assert all(p.poll() is not None for p in launcher.procs)


def test_rollout_core_against_embedded_servers(weights_root, tmp_path):
    """The executor + RLVR group workflow on two launched servers, with two disk weight updates mid-run."""
    from transformers import AutoTokenizer

    spec = ServerSpec("embedded", str(weights_root / "v0"), num_servers=2, weights_root=str(weights_root))
    tok = AutoTokenizer.from_pretrained(weights_root / "v0")
    with ServerLauncher(spec, log_dir=str(tmp_path), startup_timeout=120) as launcher:
        version = WeightVersion()
        client = SGLangClient(launcher.addresses, version=version.view())

        def reward(prompt, completion, output_tokens, **_):
            return float(len(set(output_tokens)) % 2)

        wf = GroupWorkflow(RLVRWorkflow(reward, tok, max_new_tokens=48, temperature=1.0), 4)
        data = [{"prompt": f"Question {i}: how many apples?"} for i in range(64)]
        eta, B = 1, 4
        seen_versions = set()
        with WorkflowExecutor(client, wf, consumer_batch_size=B, max_staleness=eta, version=version.view()) as ex:
            sync = reload_sync(version, RolloutSide(client, ex), str(weights_root / "v1"))
            try:
                for step in range(4):
                    batch = ex.prepare_batch(data)
                    for g in batch:
                        out_v = g["versions"][g["loss_mask"].bool()]
                        assert step - int(out_v.min()) <= eta
                        seen_versions.update(out_v.tolist())
                        lp = g["logprobs"][g["loss_mask"].bool()]
                        assert lp.lt(0).all(), lp[lp >= 0]
                    sync.transport.path = str(weights_root / ("v1" if (step + 1) % 2 else "v0"))  # the servers alternate
                    sync.push()
            finally:
                sync.close()
        assert len(seen_versions) >= 2 and seen_versions <= {0, 1, 2, 3}
        infos = [get(a, "/model_info")[1] for a in launcher.addresses]
        assert [i["weight_version"] for i in infos] == ["4", "4"]
        # stopping the executor cancels its in-flight requests; the servers abort them and go idle, not paused
        deadline = time.time() + 10
        while time.time() < deadline and not all(post(a, "/flush_cache")[0] == 200 for a in launcher.addresses):
            time.sleep(0.1)
        assert all(post(a, "/flush_cache")[0] == 200 for a in launcher.addresses)
        assert all(get(a, "/server_info")[1]["num_running_reqs"] == 0 for a in launcher.addresses)
