"""`mega-async train` end to end with several trainer ranks (the command starts them itself with torchrun),
embedded servers and the distributed weight sync verified after every step: TP2, EP2 (DP2), PP2 and
TP2+EP2 with one and two servers. A failed sync and Ctrl-C stop every rank and server with one error line.
Some cases are marked slow so the default suite stays under 20 minutes; CI's second step runs them."""
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import TINY_MOE, derive_card, init_random_weights
from tests.commands import train_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("drv") / "moe", seed=2)


def train_cmd(model: Path, tmp: Path, allocation: str, *extra: str) -> list[str]:
    return train_command("tiny_cpu", tmp / "runs", f"model.path={model}", f"parallel.allocation={allocation}",
                         "trainer.total_steps=3", "rollout.max_new_tokens=16", "trainer.sync_timeout=60",
                         "trainer.sync_bucket_bytes=262144", *extra)


def leftovers(tmp: Path) -> list[str]:
    """Processes (servers, ranks) still running for this test's run."""
    me = os.getpid()
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] != me and str(tmp) in cmd:
            out.append(cmd)
    return out


LAYOUTS = [
    pytest.param("sglang:d2+megatron:d1t2", id="tp2-2servers", marks=pytest.mark.slow),  # the default suite's budget
    pytest.param("sglang:d1+megatron:d2e2", id="ep2dp2-1server", marks=pytest.mark.slow),  # suite budget
    pytest.param("sglang:d2+megatron:p2", id="pp2-2servers", marks=pytest.mark.slow),
    pytest.param("sglang:d1+megatron:d1t2e2", id="tp2ep2-1server", marks=pytest.mark.slow),  # 4 ranks
    pytest.param("sglang:d1+megatron:d1t2", id="tp2-1server", marks=pytest.mark.slow),
    pytest.param("sglang:d2+megatron:d2e2", id="ep2dp2-2servers", marks=pytest.mark.slow),
    pytest.param("sglang:d1+megatron:p2", id="pp2-1server", marks=pytest.mark.slow),
    pytest.param("sglang:d2+megatron:d1t2e2", id="tp2ep2-2servers", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("allocation", LAYOUTS)
def test_multi_rank_run_with_distributed_sync(model, tmp_path, allocation):
    r = subprocess.run(train_cmd(model, tmp_path, allocation), capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    run = tmp_path / "runs" / "tiny_cpu" / "run0"
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["version"] for s in steps] == [1, 2, 3]
    servers = int(allocation.split(":d")[1][0])
    for s in steps:
        assert s["sync/verify_max_abs_diff"] < 1e-4  # every server serves the trainer's weights
        assert s["sync/bytes"] > 0 and s["sync/buckets"] >= 1 and s["train/tokens"] > 0
    shards = sorted((run / "final_hf").glob("*.safetensors"))  # with PP each stage head writes its own shard
    assert len(shards) == 1 or (run / "final_hf" / "model.safetensors.index.json").exists()
    final = {k: v for f in shards for k, v in load_file(str(f)).items()}
    src = load_file(str(model / "model.safetensors"))
    assert final.keys() == src.keys() and any(not final[k].equal(src[k]) for k in src)
    assert (run / "final_hf" / "tokenizer.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(run / "final_hf", dtype="float32")  # an ordinary HF checkpoint
    assert hf.model.embed_tokens.weight.equal(final["model.embed_tokens.weight"])
    assert len(list((run / "server_logs").glob("server*.log"))) == servers
    assert not leftovers(tmp_path)


@pytest.mark.slow  # one rank in disk mode runs in the default suite (test_train_loop.py)
def test_disk_sync_keeps_two_versions(model, tmp_path):
    r = subprocess.run(train_cmd(model, tmp_path, "sglang:d1+megatron:d2", "trainer.weight_sync=disk"),
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    run = tmp_path / "runs" / "tiny_cpu" / "run0"
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v2", "v3"]
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(s["sync/verify_max_abs_diff"] < 1e-4 for s in steps) and steps[-1]["version"] == 3


@pytest.fixture
def short_server(tmp_path):
    """An embedded server running a model with one layer fewer: it answers 400 in the middle of a sync."""
    d = derive_card(TINY_MOE, tmp_path / "short", seed=4, num_hidden_layers=3)
    with ServerLauncher(ServerSpec("embedded", str(d), num_threads=1), log_dir=str(tmp_path / "ext")) as launcher:
        yield launcher


@pytest.mark.slow  # CI's second step: the default suite's budget (a two-rank run and a server of its own)
def test_failed_sync_stops_every_rank_with_one_line(model, tmp_path, short_server):
    addr = short_server.addresses[0]
    r = subprocess.run(train_cmd(model, tmp_path, "sglang:d1+megatron:d1t2", f"inference.addresses=['{addr}']"),
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("mega-async train: rank ") and "SyncError" in last and "model.layers.3" in last, last
    assert not leftovers(tmp_path / "runs")
    # the server was continued on its own old weights and version
    from tests.integration.conftest import get, post

    assert get(addr, "/model_info")[1]["weight_version"] == "0"
    status, out = post(addr, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and len(out["output_ids"]) == 4


@pytest.mark.slow  # runs in CI's second step: keeps the default suite under 20 minutes on 2 cores
def test_ctrl_c_stops_all_ranks_and_servers(model, tmp_path):
    # SIGINT as a terminal has it: a test run started in the background (`cmd &` without job control)
    # inherits SIGINT ignored, and Python then keeps ignoring it in the child, as any Unix program does
    p = subprocess.Popen(train_cmd(model, tmp_path, "sglang:d1+megatron:d2", "trainer.total_steps=200"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = tmp_path / "runs" / "tiny_cpu" / "run0" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            assert p.poll() is None, p.stderr.read()[-4000:]
            time.sleep(0.5)
        assert metrics.exists(), "the run never finished a step"
        os.killpg(p.pid, signal.SIGINT)  # what a terminal sends to the whole foreground group
        _, err = p.communicate(timeout=120)
        assert p.returncode != 0
        assert "interrupted" in err.strip().splitlines()[-1]
        time.sleep(1)
        assert not leftovers(tmp_path)
    finally:  # a failing run of this test leaves nothing running (the ranks' servers die with them)
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.info["pid"] != os.getpid() and str(tmp_path) in " ".join(proc.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    proc.kill()


@pytest.mark.slow  # the default suite keeps the distributed failure case
def test_failed_disk_sync_reloads_the_current_version_everywhere(tmp_path, short_server):
    """Disk mode, two servers: one loads version 1, the other (a model with a layer fewer) refuses it. Every
    server reloads version 0 (the model directory, which real SGLang can do too) and the run stops."""
    good_model = init_random_weights(TINY_MOE, tmp_path / "moe", seed=2)
    with ServerLauncher(ServerSpec("embedded", str(good_model), num_threads=1, weights_root=str(tmp_path)),
                        log_dir=str(tmp_path / "good")) as good:
        from tests.integration.conftest import get, post

        probe = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
        before = post(good.addresses[0], "/generate", probe)[1]["output_ids"]
        addrs = ",".join(f"'{a}'" for a in good.addresses + short_server.addresses)
        r = subprocess.run(train_cmd(good_model, tmp_path, "sglang:d2+megatron:d1", "trainer.weight_sync=disk",
                                     f"inference.addresses=[{addrs}]"),
                           capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 1
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("mega-async train: SyncError") and "version 1" in last, last
        assert "could not reload" in last and short_server.addresses[0] in last  # it kept its own weights
        for addr in good.addresses + short_server.addresses:
            assert get(addr, "/model_info")[1]["weight_version"] == "0"
        assert post(good.addresses[0], "/generate", probe)[1]["output_ids"] == before
