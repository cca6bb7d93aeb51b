"""Weight broadcasts into the embedded server from "another framework's trainer", with real processes.

The shared server mirrors SGLang 0.5.23, so the trainer opens a weight-update session around its buckets
(/begin_weight_update ... /end_weight_update) as every trainer must since SGLang 0.5.21.

The trainer is a separate script (TRAINER below) that imports nothing of mega_async: it builds the group
with its own copy of SGLang's `init_custom_process_group`, posts each bucket from a thread and then
broadcasts it (one broadcast per tensor, or SGLang's flattened uint8 bucket), as slime and AReaL do.
References are plain transformers forwards of the weights the trainer sent.
"""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from mega_async.utils.comm import free_port
from mega_async.server.protocol import TensorSpec, byte_ranges, unflatten

from .conftest import get, greedy_ok, post, ref_logprobs

PROMPT = [5, 17, 300, 42, 7, 99]

TRAINER = r'''
"""Trainer rank 0 of some other RL framework: urllib for HTTP, torch.distributed for the weights."""
import datetime, json, os, sys, threading, time, urllib.error, urllib.request

import torch
import torch.distributed as dist
from safetensors.torch import load_file


# SGLang's helper, python/sglang/srt/utils/common.py (copied there from PyTorch and OpenRLHF), verbatim except
# the options-name check: SGLang compares version strings (str(torch.__version__) >= "2.6"), which picks the
# pre-2.6 name on torch 2.10+; the parameter list is asked instead.
def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                              group_name=None, pg_options=None, device_id=None):
    import inspect

    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."

    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"

    if backend:
        backend = Backend(backend)
    else:
        backend = Backend("undefined")

    if timeout is None:
        timeout = default_pg_timeout

    # backward compatible API
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)

        # Use a PrefixStore to avoid accidental overrides of keys used by
        # different systems (e.g. RPC) in case the store is multi-tenant.
        store = PrefixStore(group_name, store)

    pg_options_param_name = (
        "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters
        else "pg_options"
    )
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        store,
        group_name=group_name,
        **{pg_options_param_name: pg_options},
        timeout=timeout,
        device_id=device_id,
    )

    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}

    return pg


def post(addr, path, body, timeout):
    req = urllib.request.Request(f"http://{addr}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    return {"status": status, "body": json.loads(text) if text else None, "seconds": time.monotonic() - t0}


def flattened(tensors):
    """SGLang's FlattenedTensorBucket: each tensor's bytes, in order, in one uint8 tensor."""
    return torch.cat([t.flatten().view(torch.uint8) for t in tensors], dim=0)


def wait_for(path):
    while not os.path.exists(path):
        time.sleep(0.05)


def main(plan_path, out_path):
    plan = json.load(open(plan_path))
    addr, results, pg = plan["server"], [], None
    for step in plan["steps"]:
        op = step["op"]
        if op == "init":
            body = {"master_address": "127.0.0.1", "master_port": step["port"], "rank_offset": 1, "world_size": 2,
                    "group_name": step["group"], **step.get("body", {})}
            res = {}
            th = threading.Thread(target=lambda: res.update(r=post(addr, "/init_weights_update_group", body, 60)))
            th.start()
            pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{step['port']}",
                                           world_size=2, rank=0, group_name=step["group"],
                                           timeout=datetime.timedelta(seconds=60))
            th.join()
            results.append(res["r"])
            if step.get("ready"):
                open(step["ready"], "w").close()
        elif op in ("pause", "continue"):
            results.append(post(addr, f"/{op}_generation", {}, 60))
        elif op == "begin":  # SGLang 0.5.21+: distributed updates run inside a weight-update session
            results.append(post(addr, "/begin_weight_update", {"selector": step.get("selector", "all")}, 60))
        elif op == "end":
            results.append(post(addr, "/end_weight_update", {}, 60))
        elif op == "update":
            src = load_file(step["src"]) if step.get("src") else {}
            dtypes = step["dtypes"]
            tensors = [src[n].to(getattr(torch, d.replace("torch.", ""))).contiguous()
                       for n, d in zip(step["tensors"], dtypes)]
            body = step.get("raw_body") or {"names": step.get("names") or step["tensors"], "dtypes": dtypes,
                                            "shapes": [list(t.shape) for t in tensors], "group_name": step["group"],
                                            **step.get("body", {})}
            res = {}
            th = None
            if step.get("post", True):
                th = threading.Thread(target=lambda: res.update(
                    r=post(addr, "/update_weights_from_distributed", body, step.get("http_timeout", 60))))
                th.start()
            if step.get("go"):
                wait_for(step["go"])
            if step.get("broadcast", True):
                if body.get("load_format") == "flattened_bucket":
                    dist.broadcast(flattened(tensors), src=0, group=pg)
                else:
                    for i, t in enumerate(tensors):
                        dist.broadcast(t, src=0, group=pg)
                        if step.get("die_after") == i + 1:
                            time.sleep(0.3)
                            os._exit(3)  # the trainer dies in the middle of the bucket
            if th is not None:
                th.join()
                results.append(res["r"])
        elif op == "destroy":
            results.append(post(addr, "/destroy_weights_update_group", {"group_name": step["group"]}, 60))
            dist.destroy_process_group(pg)
        json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


def run_trainer(tmp_path, address: str, steps: list, wait: bool = True):
    """Start the foreign trainer on a plan; with wait, return (exit code, one result per HTTP call)."""
    script, plan, out = tmp_path / "trainer.py", tmp_path / "plan.json", tmp_path / "results.json"
    script.write_text(TRAINER)
    plan.write_text(json.dumps({"server": address, "steps": steps}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(plan), str(out)], env=env)
    if not wait:
        return proc
    try:
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, json.loads(out.read_text()) if out.exists() else []


def tensor_names(path):
    with safe_open(str(path), "pt") as f:
        return sorted(f.keys())


def generate(address, temperature=0.0, n=16):
    st, out = post(address, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": n, "temperature": temperature,
                                                              "ignore_eos": True}})
    assert st == 200, out
    return out["output_ids"], torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]]), out


def serves(address, model, temperature=1.0):
    """The logprobs of the server's sampled tokens are `model`'s (a plain transformers forward)."""
    ids, lps, _ = generate(address, temperature)
    return bool(torch.allclose(lps, ref_logprobs(model, PROMPT, ids, temperature), atol=1e-4))


def version(address):
    return get(address, "/model_info")[1]["weight_version"]


@pytest.fixture()
def restore_v0(server, weights_root):
    yield
    st, out = post(server.addresses[0], "/update_weights_from_disk",
                   {"model_path": str(weights_root / "v0"), "weight_version": "0"})
    assert st == 200, out


def test_unflatten_is_sglangs_byte_layout():
    """Each tensor's bytes in order, no padding; a slice at an offset its dtype cannot view is copied."""
    parts = [torch.arange(3, dtype=torch.bfloat16), torch.randn(2, 2), torch.tensor([1, -2], dtype=torch.int64)]
    flat = torch.cat([t.flatten().view(torch.uint8) for t in parts])
    specs = [TensorSpec(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(parts)]
    assert byte_ranges(specs) == [(0, 6), (6, 22), (22, 38)]
    for (name, got), want in zip(unflatten(flat, specs), parts):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_foreign_trainer_plain_and_flattened_buckets(server, hf_models, weights_root, tmp_path, restore_v0):
    """Three buckets of v1 (plain, flattened_bucket, plain with 'torch.' dtypes) -> the server serves v1."""
    addr, src = server.addresses[0], str(weights_root / "v1" / "model.safetensors")
    names = tensor_names(src)
    k = len(names) // 3
    buckets = [(names[:k], "float32", {}), (names[k:2 * k], "float32", {"load_format": "flattened_bucket"}),
               (names[2 * k:], "torch.float32", {"load_format": None})]
    steps = [{"op": "init", "port": free_port(), "group": "foreign"}, {"op": "begin"}]  # no backend: gloo on CPU
    steps += [{"op": "update", "group": "foreign", "src": src, "tensors": b, "dtypes": [dt] * len(b),
               "body": {**extra, "weight_version": "7", "flush_cache": True}} for b, dt, extra in buckets]
    steps += [{"op": "end"}, {"op": "destroy", "group": "foreign"}]
    rc, results = run_trainer(tmp_path, addr, steps)
    assert rc == 0 and len(results) == 7, results
    assert all(r["status"] == 200 and r["body"]["success"] for r in results), results
    assert results[2]["body"]["message"] == "Succeeded to update parameter online. Weight version updated to 7."
    assert results[1]["body"] == results[5]["body"] == {"success": True, "message": "Success"}
    assert version(addr) == "7"
    ids, _, out = generate(addr, 0.0, 20)
    assert out["meta_info"]["weight_version"] == "7"
    assert bool(greedy_ok(hf_models["v1"], PROMPT, ids).all())
    assert serves(addr, hf_models["v1"])


def test_flattened_bucket_with_mixed_dtypes(server, hf_models, weights_root, tmp_path, restore_v0):
    """One flattened bucket of every weight in bf16, fp16 and fp32: each slice is reinterpreted in its dtype."""
    addr, src = server.addresses[0], str(weights_root / "v1" / "model.safetensors")
    names = tensor_names(src)
    dtypes = [("bfloat16", "float16", "float32")[i % 3] for i in range(len(names))]
    steps = [{"op": "init", "port": free_port(), "group": "mixed", "body": {"backend": "gloo"}},
             {"op": "begin", "selector": "target"},
             {"op": "update", "group": "mixed", "src": src, "tensors": names, "dtypes": dtypes,
              "body": {"load_format": "flattened_bucket", "weight_version": "mixed"}},
             {"op": "end"}, {"op": "destroy", "group": "mixed"}]
    rc, results = run_trainer(tmp_path, addr, steps)
    assert rc == 0 and [r["status"] for r in results] == [200] * 5, results
    with safe_open(src, "pt") as f:  # the reference: v1 rounded to what was sent, loaded by transformers
        rounded = {n: f.get_tensor(n).to(getattr(torch, d)).float() for n, d in zip(names, dtypes)}
    ref_dir = tmp_path / "rounded"
    ref_dir.mkdir()
    shutil.copy(weights_root / "v1" / "config.json", ref_dir / "config.json")
    save_file(rounded, str(ref_dir / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert version(addr) == "mixed"
    assert serves(addr, ref) and not serves(addr, hf_models["v1"])


def test_malformed_requests_are_refused_before_any_collective(server, hf_models, weights_root, tmp_path):
    """Each answers 400 at once and joins no broadcast: the next well-formed bucket on the group still works.
    A bucket whose broadcast never comes answers 400 when the group's timeout (from the init body) expires."""
    addr, src = server.addresses[0], str(weights_root / "v0" / "model.safetensors")
    one = ["model.norm.weight"]
    bad = [({"load_format": "bogus"}, {}), ({}, {"dtypes": ["float33"]}), ({}, {"dtypes": ["float32", "float32"]}),
           ({}, {"shapes": [[-1, 64]]}), ({}, {"shapes": [[1 << 20, 1 << 20]]}), ({"group_name": "nope"}, {}),
           ({"load_format": "flattened_bucket"},  # SGLang 0.5.23: a float32 at byte 6 is refused before receiving
            {"names": ["a.weight", "b.weight"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [4]]})]
    steps = [{"op": "init", "port": free_port(), "group": "strict", "body": {"timeout": 3}}, {"op": "begin"}]
    for extra, override in bad:
        raw = {"names": one, "dtypes": ["float32"], "shapes": [[64]], "group_name": "strict", **extra, **override}
        steps.append({"op": "update", "group": "strict", "src": src, "tensors": one, "dtypes": ["float32"],
                      "raw_body": raw, "broadcast": False, "http_timeout": 20})
    steps += [{"op": "update", "group": "strict", "src": src, "tensors": one, "dtypes": ["float32"]},
              {"op": "update", "group": "strict", "src": src, "tensors": one, "dtypes": ["float32"],
               "broadcast": False, "body": {"weight_version": "stalled"}},
              {"op": "end"}, {"op": "destroy", "group": "strict"}]
    rc, results = run_trainer(tmp_path, addr, steps)
    assert rc == 0 and len(results) == len(bad) + 6, results
    refused = results[2:2 + len(bad)]
    assert all(r["status"] == 400 and r["body"]["success"] is False and r["seconds"] < 5 for r in refused), refused
    needles = ["load_format", "dtype", "same length", "negative", "exceeds", "no weight update group",
               "Unaligned received tensor b.weight: byte offset 6, dtype torch.float32"]
    assert all(n in r["body"]["message"] for n, r in zip(needles, refused)), refused
    assert results[-4]["status"] == 200 and results[-2]["status"] == 200 and results[-1]["status"] == 200, results
    stalled = results[-3]
    assert stalled["status"] == 400 and "Timed out" in stalled["body"]["message"] and 2 < stalled["seconds"] < 20
    # group init problems answer 400 and leave no group behind
    st, out = post(addr, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                        "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert st == 400 and out["success"] is False and "CUDA" in out["message"]
    t0 = time.monotonic()
    st, out = post(addr, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": free_port(),
                                                        "rank_offset": 1, "world_size": 2, "group_name": "lonely",
                                                        "timeout": 1})
    assert st == 400 and out["success"] is False and time.monotonic() - t0 < 20, out
    assert post(addr, "/destroy_weights_update_group", {"group_name": "lonely"})[0] == 400
    st, out = post(addr, "/update_weights_from_distributed", {"names": "x", "dtypes": [], "shapes": []})
    assert st == 400 and out["object"] == "error"
    assert version(addr) == "0" and serves(addr, hf_models["v0"])


def test_weight_update_sessions_as_sglang_0_5_23(server):
    """Outside a session SGLang 0.5.21+ refuses distributed and tensor updates before any collective; a
    second begin and an end without begin are refused; a bad selector is a validation error."""
    addr = server.addresses[0]
    upd = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "none"}
    st, out = post(addr, "/update_weights_from_distributed", upd)
    assert (st, out) == (400, {"success": False, "message": "update_weights_from_distributed must run between "
                                                            "begin_weight_update() and end_weight_update()"})
    st, out = post(addr, "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert st == 400 and out["message"].startswith("update_weights_from_tensor must run between")
    assert post(addr, "/end_weight_update", {}) == (400, {"success": False, "message": "no weight-update session is "
                                                          "open; call begin_weight_update() first"})
    st, out = post(addr, "/begin_weight_update", {"selector": "everything"})
    assert st == 400 and out["object"] == "error" and "selector" in out["message"]
    assert post(addr, "/begin_weight_update", {}) == (200, {"success": True, "message": "Success"})
    try:
        assert post(addr, "/begin_weight_update", {"selector": "target"}) == (400, {
            "success": False, "message": "a weight-update session is already open; call end_weight_update() first"})
        st, out = post(addr, "/update_weights_from_distributed", upd)  # inside: the next check speaks
        assert st == 400 and "no weight update group 'none'" in out["message"]
    finally:
        assert post(addr, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    info = get(addr, "/server_info")[1]
    assert info["version"] == "0.5.23" and info["embedded_server"] == "mega_async"
    assert get(addr, "/get_weight_version")[0] == 404  # gone since 0.5.21 (deprecated 404 before)


def test_failed_bucket_in_pause_window_restores_the_old_weights(server, hf_models, weights_root, tmp_path):
    """Bucket 1 of 3 loads, bucket 2 names a weight the model lacks: everything since the pause is undone."""
    addr, src = server.addresses[0], str(weights_root / "v1" / "model.safetensors")
    before, _, _ = generate(addr)
    names = tensor_names(src)
    k = len(names) // 3
    b1, b2, b3 = names[:k], names[k:2 * k], names[2 * k:]
    wrong = list(b2)
    wrong[1] = "model.layers.0.mlp.no_such_proj.weight"
    upd = {"op": "update", "group": "window", "src": src, "body": {"weight_version": "1"}}
    steps = [{"op": "init", "port": free_port(), "group": "window"}, {"op": "pause"}, {"op": "begin"},
             {**upd, "tensors": b1, "dtypes": ["float32"] * len(b1)},
             {**upd, "tensors": b2, "names": wrong, "dtypes": ["bfloat16"] * len(b2),
              "body": {"weight_version": "1", "load_format": "flattened_bucket"}},
             {**upd, "tensors": b3, "dtypes": ["float32"] * len(b3)},
             {"op": "end"}, {"op": "continue"}, {"op": "destroy", "group": "window"}]
    rc, results = run_trainer(tmp_path, addr, steps)
    assert rc == 0 and [r["status"] for r in results] == [200, 200, 200, 200, 400, 400, 200, 200, 200], results
    assert "does not exist" in results[4]["body"]["message"] and "Rolled back" in results[4]["body"]["message"]
    assert "earlier weight update" in results[5]["body"]["message"]
    assert version(addr) == "0"
    assert generate(addr)[0] == before
    assert serves(addr, hf_models["v0"])


def test_rollback_on_request_undoes_the_pause_window(server, hf_models, weights_root):
    """/rollback_weights (what the trainer's sync calls when a push failed elsewhere) restores the pause state."""
    addr = server.addresses[0]
    assert post(addr, "/rollback_weights", {})[0] == 400  # not paused: nothing to undo
    assert post(addr, "/pause_generation", {"mode": "abort"})[0] == 200
    try:
        st, out = post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v1"),
                                                           "weight_version": "1"})
        assert st == 200 and version(addr) == "1", out
        st, out = post(addr, "/rollback_weights", {})
        assert st == 200 and out["success"] and version(addr) == "0", out
    finally:
        assert post(addr, "/continue_generation", {})[0] == 200
    assert serves(addr, hf_models["v0"])


def test_sender_dies_mid_broadcast(server, hf_models, weights_root, tmp_path):
    """The trainer exits after the first tensor of a bucket: 400 with the error, old weights, still serving."""
    addr, src = server.addresses[0], str(weights_root / "v1" / "model.safetensors")
    names = tensor_names(src)[:3]
    ready, go = tmp_path / "ready", tmp_path / "go"
    steps = [{"op": "init", "port": free_port(), "group": "doomed", "ready": str(ready)},
             {"op": "update", "group": "doomed", "src": src, "tensors": names, "dtypes": ["float32"] * 3,
              "post": False, "go": str(go), "die_after": 1}]
    proc = run_trainer(tmp_path, addr, steps, wait=False)
    with safe_open(src, "pt") as f:
        shapes = [list(f.get_slice(n).get_shape()) for n in names]
    body = {"names": names, "dtypes": ["float32"] * 3, "shapes": shapes, "group_name": "doomed",
            "weight_version": "dead"}
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the trainer did not join the group"
        assert post(addr, "/begin_weight_update", {})[0] == 200
        res = {}
        th = threading.Thread(target=lambda: res.update(r=post(addr, "/update_weights_from_distributed", body)))
        th.start()
        time.sleep(0.5)
        go.touch()
        th.join(60)
        assert proc.wait(30) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
    st, out = res["r"]
    assert st == 400 and out["success"] is False, out
    assert "receiving the broadcast failed at tensor 2 of 3" in out["message"] and "unchanged" in out["message"]
    assert version(addr) == "0" and serves(addr, hf_models["v0"])
    st, out = post(addr, "/update_weights_from_distributed", body)  # refused at once: the group is broken
    assert st == 400 and "broken" in out["message"]
    assert post(addr, "/end_weight_update", {})[0] == 200
    assert post(addr, "/destroy_weights_update_group", {"group_name": "doomed"})[0] == 200
    assert post(addr, "/destroy_weights_update_group", {"group_name": "doomed"})[0] == 400


def test_weights_checker_and_checksum_verify(server, hf_models, weights_root):
    """/weights_checker hashes each weight as SGLang hashes a CPU tensor; the sync's checksum verify passes
    after a sync that changed the weights and fails when a server's weights did not change."""
    import hashlib

    from mega_async.inference.client import SGLangClient
    from unittest.mock import ANY

    from mega_async.trainer.sync import ReloadTransport, RolloutSide, WeightSync
    from mega_async.trainer.sync.verify import _unchanged_verdict
    from mega_async.api.types import WeightVersion

    addr = server.addresses[0]
    st, out = post(addr, "/weights_checker", {"action": "checksum"})
    assert st == 200 and out["success"] and set(out) == {"success", "message", "ranks", "per_engine_checksum"}
    rank = out["ranks"][0]
    assert rank["parallelism_info"][0]["role"] == "target"  # 0.5.21+: one entry per role
    ref = {n: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy()).digest()[:8].hex()
           for n, p in hf_models["v0"].named_parameters()}
    assert {n: c for n, c in rank["checksums"].items() if n in ref} == ref
    assert out["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
    assert post(addr, "/weights_checker", {"action": "compare"})[0] == 400  # no snapshot yet
    assert post(addr, "/weights_checker", {"action": "snapshot"})[0] == 200
    assert post(addr, "/weights_checker", {"action": "compare"})[0] == 200
    assert post(addr, "/weights_checker", {"action": "bogus"})[0] == 400

    sync = WeightSync([], WeightVersion(), RolloutSide(SGLangClient([addr])), ReloadTransport(str(weights_root / "v1")),
                      timeout=60, verify_method="checksum")
    verifier = sync.verifier  # the sync's verifier, asked as rank 0 asks it: (replies, unchanged, verdict)
    try:
        assert verifier._auto_method() == "checksum"  # the embedded server hashes what it holds: the exact digest
        assert verifier._verify_checksums(0, None)[2] is None  # the first check records the checksums
        assert post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v1"),
                                                        "weight_version": "1"})[0] == 200
        assert verifier._verify_checksums(1, None) == ([(ANY, ANY)], [], None)  # changed with the "sync" to 1
        assert post(addr, "/update_weight_version", {"new_version": "2"})[0] == 200
        _, unchanged, verdict = verifier._verify_checksums(2, None)
        assert verdict is None  # the same weights at version 2: judged by the digest, or ...
        assert "did not change with the sync to version 2" in _unchanged_verdict(2, unchanged, set())  # ... not
        assert _unchanged_verdict(2, unchanged, {unchanged[0][0]}) is None  # the digest found it equal
        assert "reports weight_version '2', expected 3" in verifier._verify_checksums(3, None)[2]
    finally:
        sync.close()
        assert post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"),
                                                        "weight_version": "0"})[0] == 200
