"""The project's trainer-side weight sync against SGLang's OWN receive path, for the oldest and newest SGLang
releases supported (sglang_releases.OLDEST, NEWEST), on CPU with gloo.

Each release is pip-installed without its dependencies (sglang_releases.ensure_sglang) and runs as a receiver
(sglang_receiver.py) assembled from that release's HTTP server, tokenizer-manager control path, scheduler-side
weight updater, TP worker and model runner WeightUpdater (init_custom_process_group, broadcast receive,
FlattenedTensorBucket); only CUDA-only imports are stubbed (sglang_stubs.py). The model that receives is ours
(HF-named tensors of the tiny Qwen3-MoE card, loaded by name with SGLang's default_weight_loader): the receive
path is SGLang's. Megatron trainers at TP1 and TP2 (torchrun, one launch per layout covering every receiver and
both load formats) push through distributed_sync and SGLangClient; the receiving model must end with
exactly the trainer's weights, at the version the trainer set.

If a release cannot be installed the test fails (it needs PyPI once; the cache is reused): it never skips.
"""
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mega_async.utils.comm import free_port
from mega_async.bridge.model_cards import TINY_MOE, init_random_weights

from .sglang_releases import NEWEST, OLDEST, ensure_sglang
from .sglang_stubs import for_version

pytestmark = pytest.mark.slow  # two SGLang imports (~30 s each on 2 cores) and two torchrun launches

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
VERSIONS = (OLDEST, NEWEST)
LAYOUTS = {"tp1": ("megatron:d1", 1), "tp2": ("megatron:t2", 2)}
FORMATS = ("tensor", "flattened_bucket")


def _sessions(version: str) -> bool:
    return tuple(int(x) for x in version.split(".")) >= (0, 5, 21)


@pytest.fixture(scope="module")
def card(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("interop") / "moe", seed=5)


def _get(address: str, path: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def receivers(card, tmp_path_factory):
    """One receiver per release (started together, reused by every case); their logs on failure."""
    dirs = {v: ensure_sglang(v) for v in VERSIONS}
    logs = tmp_path_factory.mktemp("receivers")
    procs, addresses = {}, {}
    try:
        for v in VERSIONS:
            port = free_port()
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(dirs[v])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
            log = open(logs / f"sglang-{v}.log", "w")
            procs[v] = (subprocess.Popen([sys.executable, str(HERE / "sglang_receiver.py"), "--model", str(card),
                                          "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env), log)
            addresses[v] = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        for v, address in addresses.items():
            proc = procs[v][0]
            while True:
                try:
                    _get(address, "/model_info")
                    break
                except OSError:
                    pass
                text = (logs / f"sglang-{v}.log").read_text()
                assert proc.poll() is None, f"the SGLang {v} receiver exited ({proc.returncode}):\n{text[-5000:]}"
                assert time.monotonic() < deadline, f"the SGLang {v} receiver did not start in 300 s:\n{text[-5000:]}"
                time.sleep(0.5)
        yield addresses
    finally:
        for proc, log in procs.values():
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()


@pytest.fixture(scope="module")
def runs(card, receivers, tmp_path_factory):
    """runs(layout) -> (out dir, result.json): one torchrun launch per trainer layout, run on first use."""
    done: dict = {}

    def run(layout: str):
        if layout not in done:
            spec, nproc = LAYOUTS[layout]
            out = tmp_path_factory.mktemp(f"sync_{layout}")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   f"--master-port={free_port()}", str(HERE / "sglang_sync_worker.py"), "--model", str(card),
                   "--layout", spec, "--out", str(out), *[f"--server={v}={a}" for v, a in receivers.items()]]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            done[layout] = (out, r)
        out, r = done[layout]
        assert r.returncode == 0 and (out / "result.json").exists(), \
            f"the {layout} trainer failed:\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
        return out, json.loads((out / "result.json").read_text())

    return run


def test_receivers_are_the_releases_with_only_cuda_imports_stubbed(receivers):
    for v, address in receivers.items():
        info = _get(address, "/get_server_info")
        assert info["version"] == v  # SGLang's own /get_server_info, from the installed release
        assert _get(address, "/interop/log")["stubbed"] == list(for_version(v))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("version", VERSIONS)
def test_trainer_weights_arrive_through_sglangs_receive_path(runs, version, layout, fmt):
    out, res = runs(layout)
    case = res["cases"][f"{version}_{fmt}"]
    assert case["error"] is None, f"the sync into SGLang {version} ({layout}, {fmt}) failed: {case['error']}"
    assert case["dump"]["status"] == 200, case["dump"]
    expected = load_file(str(out / f"expected_{version}_{fmt}.safetensors"))
    received = load_file(str(out / f"received_{version}_{fmt}.safetensors"))
    assert set(received) == set(expected) and len(expected) == 135
    differ = [n for n in expected if not torch.equal(expected[n], received[n])]
    assert not differ, f"{len(differ)} tensors differ from the trainer's, e.g. {differ[:3]}"
    assert case["model_info"]["weight_version"] == str(case["version"])  # the version the trainer set
    requests = res["logs"][version]["requests"]
    updates = [r for r in requests if r["type"] == "UpdateWeightsFromDistributedReqInput"
               and r.get("load_format") == (fmt if fmt == "flattened_bucket" else None) and r["names"]]
    assert updates and all(r["success"] for r in updates)
    if _sessions(version):  # every session the sync opened is closed again
        ok = [r["type"] for r in requests if r.get("success")]
        assert ok.count("BeginWeightUpdateReqInput") == ok.count("EndWeightUpdateReqInput") >= 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("version", VERSIONS)
def test_checksum_verify_reads_sglangs_weights_checker(runs, version, layout):
    """verify_method="checksum" (trainer.verify_sync on real servers) against the release's /weights_checker."""
    _, res = runs(layout)
    for fmt in FORMATS:
        case = res["cases"][f"{version}_{fmt}"]
        assert case["error"] is None, f"the sync into SGLang {version} ({layout}, {fmt}) failed: {case['error']}"
        assert case["verify"] is None, f"verify_sync against SGLang {version} ({layout}, {fmt}): {case['verify']}"
    checks = [r for r in res["logs"][version]["requests"] if r["type"] == "CheckWeightsReqInput"]
    assert len(checks) >= len(FORMATS) and all(r["success"] for r in checks)  # the log spans both layouts' runs
