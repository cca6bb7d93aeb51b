"""The continuous-batching engine in-process, MoE and dense: staggered arrivals join the running batch."""
import threading
import time

import pytest
import torch

from mega_async.server.engine import GenerationEngine, GenRequest
from mega_async.server.weights import WeightLoadError, checkpoint_names, load_named_tensors, read_safetensors_dir
from mega_async.bridge.model_cards import TINY_DENSE, TINY_MOE, init_random_weights

from .conftest import ref_logprobs


@pytest.fixture(scope="module", params=[TINY_MOE, TINY_DENSE], ids=["qwen3-moe", "qwen3-dense"])
def model_dir(request, tmp_path_factory):
    return init_random_weights(request.param, tmp_path_factory.mktemp("m") / "w", seed=0)


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_continuous_batching_matches_reference(model_dir):
    ref = load(model_dir)
    eng = GenerationEngine(load(model_dir), max_batch_size=4)
    done, lock, all_done = [], threading.Lock(), threading.Event()
    n = 9

    def fin(r):
        with lock:
            done.append(r)
            if len(done) == n:
                all_done.set()

    reqs = [GenRequest(rid=str(i), input_ids=list(range(3, 5 + 3 * i)), max_new_tokens=10 + 3 * i,
                       temperature=[0.0, 1.0, 0.6][i % 3], top_k=[-1, -1, 50][i % 3], ignore_eos=True, on_finish=fin)
            for i in range(n)]
    try:
        for i, r in enumerate(reqs):  # arrive while others decode; more than max_batch_size wait their turn
            eng.add_request(r)
            time.sleep(0.01 * (i % 3))
        assert all_done.wait(120)
        assert eng.steps < sum(r.max_new_tokens for r in reqs)  # rows really shared decode steps
    finally:
        eng.shutdown()
    for r in reqs:
        assert r.finish_reason == {"type": "length", "length": r.max_new_tokens}
        exp = ref_logprobs(ref, r.input_ids, r.output_ids, r.temperature)
        assert torch.allclose(torch.tensor(r.output_logprobs), exp, atol=1e-4), r.rid


def test_abort_waiting_and_running(model_dir):
    eng = GenerationEngine(load(model_dir), max_batch_size=1)
    try:
        a = GenRequest(rid="run-a", input_ids=[1, 2], max_new_tokens=5000, ignore_eos=True)
        b = GenRequest(rid="wait-b", input_ids=[1, 2], max_new_tokens=5, ignore_eos=True)
        eng.add_request(a)
        time.sleep(0.2)
        eng.add_request(b)
        assert eng.abort(abort_all=True).result(30) == 2
        assert a.finish_reason["message"] == "Aborted" and 0 < len(a.output_ids) < 5000
        assert b.finish_reason["message"] == "Abort in waiting queue" and b.output_ids == []
        assert eng.is_idle()
    finally:
        eng.shutdown()


def test_weight_loader_equals_from_pretrained_and_rolls_back(model_dir, tmp_path):
    target = init_random_weights(model_dir, tmp_path / "other", seed=7)
    m = load(model_dir)
    n = load_named_tensors(m, read_safetensors_dir(target), strict=True)
    ref = load(target)
    assert n == len(list(read_safetensors_dir(target)))
    for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k
    names = dict(checkpoint_names(m))
    assert set(names) >= {k for k, _ in read_safetensors_dir(target)}
    before = {k: v.clone() for k, v in m.state_dict().items()}
    good = next(iter(names))
    with pytest.raises(WeightLoadError, match="does not exist"):
        load_named_tensors(m, [(good, names[good] + 1), ("model.layers.99.mlp.gate.weight", torch.zeros(1))])
    with pytest.raises(WeightLoadError, match="lacks"):
        load_named_tensors(m, [(good, names[good])], strict=True)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # nothing half-applied
