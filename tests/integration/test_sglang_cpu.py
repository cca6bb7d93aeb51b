"""The real SGLang engine (0.5.23, CPU) under the project's trainer: the tiny run with the distributed sync and
per-step verification, a disk sync, and kill -9 of a real server mid-run.

Needs the engine's environment (`bash tools/install_sglang_cpu.sh`, SGLANG_CPU_VENV naming it; CI sets it): without
the variable every test here skips, saying so; with it set, nothing skips. One real server for the module (the
fixture; every run starts it at the card's weights, version 0, and reaches it through inference.addresses), and one
more for the kill test, which the run launches itself (only a server the run launched is restarted by it).
"""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mega_async.inference.servers import ServerLauncher, ServerSpec
from mega_async.bridge.model_cards import ensure_weights
from tests.commands import train_command
from .conftest import REAL_ENGINE, get, post

pytestmark = REAL_ENGINE

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "models" / "tiny-qwen3-moe"
CONFIG = ROOT / "configs" / "tiny_cpu_sglang.yaml"
PROMPT = [(7 * i + 3) % 1000 + 1 for i in range(24)]


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    """One real CPU SGLang server for the module, started by the project's launcher, returning routed experts (R3)."""
    ensure_weights(CARD)
    spec = ServerSpec("sglang", str(CARD), device="cpu", dtype="float32", num_threads=1,
                      extra_args=["--enable-return-routed-experts"])
    t0 = time.monotonic()
    with ServerLauncher(spec, log_dir=str(tmp_path_factory.mktemp("sglang_logs")), startup_timeout=300) as launcher:
        print(f"real SGLang server ready in {time.monotonic() - t0:.1f} s")
        yield launcher.addresses[0]


def at_card_weights(address: str) -> None:
    """The fixture's server back at the card's weights, labelled version 0 (what a run starts from)."""
    status, body = post(address, "/update_weights_from_disk", {"model_path": str(CARD), "weight_version": "0"})
    assert status == 200 and body["success"], body


def train(tmp_path: Path, *overrides: str, timeout: float = 900) -> Path:
    cmd = train_command(CONFIG, tmp_path, *overrides)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(f"mega-async train {' '.join(overrides)}: {time.monotonic() - t0:.1f} s")
    assert p.returncode == 0, p.stderr[-4000:]
    return tmp_path / "tiny_cpu_sglang" / "run0"


def server_logprobs(address: str, ids: list[int]) -> torch.Tensor:
    """The server's logprob of each prompt token after the first (prefill-only scoring)."""
    status, body = post(address, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 0},
                                               "return_logprob": True, "logprob_start_len": 0})
    assert status == 200, body
    return torch.tensor([lp for lp, _tok, _ in body["meta_info"]["input_token_logprobs"][1:]], dtype=torch.float64)


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def assert_serves(address: str, run: Path, version: int) -> None:
    """The server reports the run's last version and its logprobs are final_hf's (transformers, fp32)."""
    status, info = get(address, "/model_info")
    assert status == 200 and info["weight_version"] == str(version), info
    diff = (server_logprobs(address, PROMPT) - hf_logprobs(run / "final_hf", PROMPT)).abs().max().item()
    print(f"server vs final_hf logprobs: max |diff| {diff:.2e}")
    assert diff < 1e-4
    assert (server_logprobs(address, PROMPT) - hf_logprobs(CARD, PROMPT)).abs().max().item() > 1e-3  # it moved


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def trainer_ranks(run: Path) -> set[int]:
    """The ranks that trained a step (the run's timeline: every trainer rank appends its own)."""
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    return {e["rank"] for e in events if e.get("kind") == "train_step_start"}


def test_tiny_run_tp2_retract_r3_with_distributed_sync_and_per_step_verification(real_server, tmp_path):
    """A TP2 trainer (two ranks), rollout.interrupt=retract and R3 (algorithm.routing_replay: the trainer replays the
    engine's routed experts): every step's broadcast opens and closes a weight-update session on the real server,
    after every step the server's logprobs for a probe prompt equal the trainer's (verify_sync, probe, 1e-4), the
    trainer's routes equal the engine's on every token (0 mismatches, top-1 and set) and its logprobs the rollout's."""
    at_card_weights(real_server)
    steps = 4
    run = train(tmp_path, f"inference.addresses=[{real_server}]", f"trainer.total_steps={steps}",
                "parallel.allocation=sglang:d1+megatron:t2", "rollout.interrupt=retract",
                "algorithm.routing_replay=true", "trainer.verify_sync=true", "trainer.verify_sync_method=probe")
    rows = [m for m in metrics(run) if "step" in m]
    assert len(rows) == steps
    assert all(m["sync/verify_max_abs_diff"] < 1e-4 for m in rows), [m.get("sync/verify_max_abs_diff") for m in rows]
    assert "0.5.23 (sessions)" in (run / "train.log").read_text()
    assert trainer_ranks(run) == {0, 1}
    for m in rows:
        assert m["train/mismatch/route_top1_frac"] == 0 and m["train/mismatch/route_set_frac"] == 0, m
        assert m["train/mismatch/current_tokens"] > 0 and m["train/mismatch/logprob_abs_max"] < 1e-4, m
    print("TP2 retract R3: logprob mismatch max", max(m["train/mismatch/logprob_abs_max"] for m in rows))
    assert_serves(real_server, run, steps)


def test_checksum_verification_against_the_trainers_digest(real_server, tmp_path):
    """verify_sync_method=checksum on the real engine: after every broadcast the server's /weights_checker checksums,
    over SGLang's own parameters (qkv_proj, gate_up_proj, the fused experts w13_weight/w2_weight), must equal the
    digest the trainer rebuilds from the tensors it sent (issue 37), not only the server's previous answer."""
    at_card_weights(real_server)
    steps = 3
    run = train(tmp_path, f"inference.addresses=[{real_server}]", f"trainer.total_steps={steps}",
                "trainer.verify_sync=true", "trainer.verify_sync_method=checksum")
    log = (run / "train.log").read_text()
    assert "not compared with the trainer's digest" not in log, log[-3000:]
    assert len([m for m in metrics(run) if "step" in m]) == steps
    assert_serves(real_server, run, steps)


def test_a_stale_expert_on_the_real_engine_is_caught_at_the_default_learning_rate(real_server, tmp_path):
    """Issue 50's stale tensor on the real engine: a proxy in front of the server renames one tensor of the first
    sync's bucket to a later one of the same shape (the server receives every byte, loads the later tensor twice and
    keeps the first one's old weights) and answers 200. At the default learning rate (1e-5, where the logprob probe
    is blind), `trainer.verify_sync_method=auto` picks the exact digest on SGLang 0.5.23 and the run fails at that
    sync naming the server and the tensor in SGLang's own names. (A routed expert no token reached in the first step
    has not moved under Adam: its stale copy is the trainer's weight, rightly passed.)"""
    sys.path.insert(0, str(Path(__file__).parent))
    from tamper_proxy import TamperProxy

    at_card_weights(real_server)
    proxy = TamperProxy(real_server, 0).start()
    run, p = tmp_path / "tiny_cpu_sglang" / "run0", None
    try:  # armed after step 1 (the config warms the learning rate up from 0: the first sync changes no weight)
        p = subprocess.Popen(train_command(CONFIG, tmp_path, "trainer.total_steps=5", "trainer.verify_sync=true",
                                           f"inference.addresses=[{proxy.address.split('://')[-1]}]"),
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 600
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.2)
        proxy.set("drop_tensor", bucket=0)
        _, err = p.communicate(timeout=900)
    finally:
        if p is not None and p.poll() is None:
            p.kill()
        proxy.stop()
        at_card_weights(real_server)
    print(last := err.strip().splitlines()[-1])
    last = err.strip().splitlines()[-1]
    assert p.returncode != 0 and proxy.log, (proxy.log, err[-3000:])
    assert proxy.address in last and "does not serve the trainer's weights" in last and " differ: " in last, last
    dropped = proxy.log[0].split(": ")[1].split(" ")[0]  # e.g. model.embed_tokens.weight
    assert dropped in last.split(" differ: ")[1], (dropped, last)


def test_disk_sync_ep2_in_place(real_server, tmp_path):
    """trainer.weight_sync=disk under an EP2 trainer (two ranks, the experts split) with rollout.interrupt=in_place
    (requests keep their KV cache across the update; no cache flush): the real server loads each version's HF
    directory (/update_weights_from_disk) and ends at final_hf's logprobs."""
    at_card_weights(real_server)
    steps = 3
    run = train(tmp_path, f"inference.addresses=[{real_server}]", f"trainer.total_steps={steps}",
                "trainer.weight_sync=disk", "parallel.allocation=sglang:d1+megatron:d2e2", "rollout.interrupt=in_place")
    assert len([m for m in metrics(run) if "step" in m]) == steps
    assert trainer_ranks(run) == {0, 1}
    assert_serves(real_server, run, steps)


def test_a_killed_real_server_is_restarted_resynced_and_the_run_finishes(tmp_path):
    """kill -9 of the real server the run launched, mid-run, with the distributed sync: the run starts it again at its
    address, waits for it (its only server), the trainer broadcasts the current version into it (the sync's catch-up,
    while rank 0 waits for the step's groups) before it is re-admitted, and the run finishes every step with verify_sync
    (probe) passing after every later sync; the ledger is exact (B groups a step, each episode once, none failed)."""
    import psutil

    steps = 4  # two before the kill, two after the restart and its catch-up
    cmd = train_command(CONFIG, tmp_path, f"trainer.total_steps={steps}", "trainer.verify_sync=true",
                        "trainer.verify_sync_method=probe")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "tiny_cpu_sglang" / "run0"
    try:
        deadline = time.monotonic() + 600
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.2)
        servers = [c for c in psutil.Process(p.pid).children(recursive=True)
                   if "sglang.launch_server" in " ".join(c.cmdline())]
        assert len(servers) == 1, [c.cmdline() for c in servers]
        servers[0].kill()
        out, err = p.communicate(timeout=900)
    finally:
        if p.poll() is None:
            p.kill()
    print(f"run with a kill -9: {time.monotonic() - t0:.1f} s")
    assert p.returncode == 0, err[-4000:]
    rows = [m for m in metrics(run) if "step" in m]
    assert len(rows) == steps and all(m["sync/verify_max_abs_diff"] < 1e-4 for m in rows)
    log = (run / "train.log").read_text()
    assert "exited with code -9; restarting it (1 of 3)" in log
    # the trainer's catch-up starts before the server is re-admitted (which may come as soon as its commit, before the
    # catch-up's verify and its "now at" line)
    caught = re.search(r"bringing server\(s\) \S+ to weight version (\d+)", log)
    admitted = re.search(r"server \S+ is healthy again(?: at the current weight version)?; re-admitted", log)
    assert caught and admitted and caught.start() < admitted.start(), log[-3000:]
    assert re.search(r"server\(s\) \S+ now at weight version " + caught.group(1), log)
    assert f"weights version {steps} on the servers" in out + err
    check_ledger(run, steps, 8)


def check_ledger(run: Path, steps: int, groups: int) -> None:
    """rollouts.jsonl: `groups` accepted a step, every episode once, none failed or rejected."""
    import collections

    lines = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    accepted = [x for x in lines if x["verdict"] == "accepted"]
    assert collections.Counter(x["step"] for x in accepted) == {s: groups for s in range(steps)}
    keys = [(x["epoch"], x["index"]) for x in lines]
    assert len(keys) == len(set(keys)), "an episode has two ledger lines"
    assert not [x for x in lines if x["verdict"] in ("failed", "rejected")]
