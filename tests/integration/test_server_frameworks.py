"""Other frameworks' own request shapes against the embedded server, end to end (issue 25.1)."""
import multiprocessing as mp

import pytest
import torch

from mega_async.utils.comm import free_port

from .conftest import get, post, ref_logprobs
from .test_server import _trainer_rank0

pytestmark = pytest.mark.slow  # a trainer rank in its own process: CI's second step


def test_areal_distributed_weight_sync_with_its_own_request_bodies(server, hf_models, weights_root):
    """AReaL's sglang_remote.py bodies, as it sends them: /init_weights_update_group with master_port a string
    (the old server answered 400 and AReaL's sync never started), /update_weights_from_distributed with
    abort_all_requests, and its disk update's misspelt abort_all_request (ignored, as SGLang ignores unknown
    keys). Only the backend is gloo instead of AReaL's nccl (this server has no CUDA); the session calls are
    SGLang 0.5.21+'s, which this server mirrors."""
    from safetensors import safe_open

    addr = server.addresses[0]
    path = str(weights_root / "v1" / "model.safetensors")
    with safe_open(path, "pt") as f:
        names = sorted(f.keys())
        shapes = [tuple(f.get_slice(n).get_shape()) for n in names]
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    trainer = ctx.Process(target=_trainer_rank0, args=(port, names, path, q))
    trainer.start()
    try:
        st, out = post(addr, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "group_name": "wu"})
        assert st == 200 and out["success"], out
        assert post(addr, "/begin_weight_update", {})[0] == 200
        st, out = post(addr, "/update_weights_from_distributed", {
            "names": names, "dtypes": ["float32"] * len(names), "shapes": [list(s) for s in shapes],
            "group_name": "wu", "abort_all_requests": True})
        assert st == 200 and out["success"], out
        assert post(addr, "/end_weight_update", {})[0] == 200
        assert post(addr, "/destroy_weights_update_group", {"group_name": "wu"})[0] == 200
        trainer.join(60)
        assert q.get(timeout=5) == "ok"
        prompt = [5, 17, 300, 42]
        st, out = post(addr, "/generate", {"input_ids": prompt, "return_logprob": True,
                                           "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}})
        lps = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(lps, ref_logprobs(hf_models["v1"], prompt, out["output_ids"], 1.0), atol=1e-4)
    finally:
        if trainer.is_alive():
            trainer.kill()
        trainer.join(10)
    st, out = post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"),
                                                       "abort_all_request": True})
    assert st == 200 and out["success"], out
    st, out = post(addr, "/update_weights_from_disk", {"model_path": str(weights_root / "v0"),
                                                       "abort_all_requests": True, "weight_version": "0"})
    assert st == 200 and get(addr, "/model_info")[1]["weight_version"] == "0"
