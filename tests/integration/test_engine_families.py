"""The embedded server's engine serves DeepSeek-V3 (MLA, dense first layer, shared expert, sigmoid + bias
group-limited routing) and GLM-4.5 (shared expert, sigmoid + bias, partial rotary, qkv bias) through
transformers' model classes: continuously batched logprobs equal a plain transformers forward, and
`return_routed_experts` gives the experts the router picked, equal to an independent computation of DeepSeek's
group-limited, bias-corrected top-k from each layer's router input."""
import threading
import time

import pytest
import torch

from mega_async.server.engine import GenerationEngine, GenRequest
from mega_async.server.routing import RouteRecorder
from mega_async.server.weights import load_named_tensors, load_pretrained, read_safetensors_dir
from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_GLM, init_random_weights

from .conftest import ref_logprobs


@pytest.fixture(scope="module", params=[TINY_DEEPSEEK, TINY_GLM], ids=["deepseek-v3", "glm4-moe"])
def model_dir(request, tmp_path_factory):
    return init_random_weights(request.param, tmp_path_factory.mktemp("m") / "w", seed=0)


def load(model_dir):
    """The server's model: transformers' plus the MTP layer the cards carry (kept by name, not run)."""
    return load_pretrained(model_dir, torch.float32).eval()


def group_limited_topk(x, weight, bias, cfg):
    """DeepSeek-V3's noaux_tc routing written out: sigmoid scores, + e_score_correction_bias for the choice only,
    groups ranked by the sum of their top-2 biased scores, the topk_group best kept, top-k experts among them;
    weights from the unbiased scores (renormalised, x routed_scaling_factor). Returns (ids sorted by weight,
    weights) per token."""
    scores = torch.sigmoid(x.double() @ weight.double().T)
    choice = scores + bias.double()
    g, E, k = cfg.n_group, cfg.n_routed_experts, cfg.num_experts_per_tok
    per = choice.view(-1, g, E // g)
    group_score = per.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
    masked = choice.masked_fill(~keep.repeat_interleave(E // g, dim=1), float("-inf"))
    ids = masked.topk(k, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor if cfg.norm_topk_prob else w * cfg.routed_scaling_factor
    order = w.argsort(-1, descending=True)
    return ids.gather(1, order), w.gather(1, order)


def router_inputs(model, ids):
    """Each MoE layer's router input (the post-attention-norm hidden states) in a plain forward."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            hooks.append(gate.register_forward_hook(
                lambda m, a, out, i=i: seen.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]))))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return seen


def run(eng, reqs):
    done, lock, all_done = [], threading.Lock(), threading.Event()

    def fin(r):
        with lock:
            done.append(r)
            if len(done) == len(reqs):
                all_done.set()

    for i, r in enumerate(reqs):  # staggered: later ones join the running batch
        r.on_finish = fin
        eng.add_request(r)
        time.sleep(0.01 * (i % 3))
    assert all_done.wait(120)


def test_logprobs_and_routes_equal_transformers_and_the_reference_router(model_dir):
    ref = load(model_dir)
    cfg = ref.config
    eng = GenerationEngine(load(model_dir), max_batch_size=3, record_routes=True)
    reqs = [GenRequest(rid=str(i), input_ids=list(range(3 + i, 9 + 4 * i)), max_new_tokens=5 + 2 * i,
                       temperature=[0.0, 1.0, 0.7][i % 3], ignore_eos=True, return_routed_experts=True)
            for i in range(4)]
    try:
        run(eng, reqs)
    finally:
        eng.shutdown()
    dense = list(range(cfg.first_k_dense_replace))
    bias_changed = group_changed = 0
    for r in reqs:
        exp = ref_logprobs(ref, r.input_ids, r.output_ids, r.temperature)
        assert torch.allclose(torch.tensor(r.output_logprobs), exp, atol=1e-4), r.rid
        seq = r.input_ids + r.output_ids
        routes = torch.cat(r.routes)  # [prompt + output - 1, num_hidden_layers, k]
        assert routes.shape == (len(seq) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        assert (routes[:, dense] == 0).all()  # dense layers: zeros, as SGLang's capturer leaves them
        for layer, x in router_inputs(ref, seq[:-1]).items():
            gate = ref.model.layers[layer].mlp.gate
            ids, _ = group_limited_topk(x, gate.weight, gate.e_score_correction_bias, cfg)
            assert torch.equal(routes[:, layer].long(), ids), (r.rid, layer)
            plain = torch.sigmoid(x.double() @ gate.weight.double().T)
            k = cfg.num_experts_per_tok
            bias_changed += int((plain.topk(k).indices.sort().values != ids.sort().values).any(-1).sum())
            ungrouped = (plain + gate.e_score_correction_bias.double()).topk(k).indices.sort().values
            group_changed += int((ungrouped != ids.sort().values).any(-1).sum())
    assert bias_changed > 0  # the correction bias really changed some choices
    if cfg.n_group > 1:
        assert group_changed > 0  # and so did the group limit (DeepSeek card: 4 groups, 2 kept)


def test_route_layers_and_order_follow_sglang(model_dir):
    """One row per decoder layer (routers found whatever their class's capitalisation), experts by weight."""
    model = load(model_dir)
    rec = RouteRecorder(model)
    cfg = model.config
    assert rec.num_layers == cfg.num_hidden_layers and rec.top_k == cfg.num_experts_per_tok
    assert rec.layers == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    rec.start()
    with torch.no_grad():
        model(torch.tensor([[5, 9, 11, 300]]))
    routes = rec.take(1, 4)[0]
    x = router_inputs(model, [5, 9, 11, 300])
    for layer in rec.layers:
        gate = model.model.layers[layer].mlp.gate
        _, w = group_limited_topk(x[layer], gate.weight, gate.e_score_correction_bias, cfg)
        assert (w[:, :-1] >= w[:, 1:]).all()  # the reference's order: largest weight first
        assert torch.equal(routes[:, layer].long(), group_limited_topk(x[layer], gate.weight,
                                                                       gate.e_score_correction_bias, cfg)[0])


def test_checkpoint_names_load_exactly_what_from_pretrained_loads(model_dir, tmp_path):
    """A weight update by HF checkpoint name (experts one by one, MLA projections, router bias, shared experts, the
    MTP layer) fills the fused in-memory model exactly as loading the checkpoint does."""
    other = init_random_weights(model_dir, tmp_path / "other", seed=7)
    m = load(model_dir)
    names = dict(read_safetensors_dir(other))
    assert any(k.endswith("e_score_correction_bias") for k in names)
    assert any(".shared_experts." in k for k in names) and any(".experts.0.gate_proj." in k for k in names)
    assert "model.layers.4.eh_proj.weight" in names and "model.layers.4.mlp.experts.0.up_proj.weight" in names
    assert load_named_tensors(m, names.items(), strict=True) == len(names)
    for (k, a), (_, b) in zip(m.state_dict().items(), load(other).state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.slow  # a server process per family
def test_the_http_server_serves_both_families(model_dir, tmp_path):
    """Over HTTP, through the real client: logprobs equal transformers', routes equal the reference router's."""
    import asyncio

    from mega_async.inference.client import SGLangClient
    from mega_async.inference.servers import ServerLauncher, ServerSpec
    from mega_async.api.types import ModelRequest

    spec = ServerSpec("embedded", str(model_dir), weights_root=str(model_dir.parent),
                      extra_args=["--enable-return-routed-experts"])
    prompt = [5, 17, 300, 42, 7, 99]
    with ServerLauncher(spec, log_dir=str(tmp_path / "logs"), startup_timeout=120) as launcher:
        client = SGLangClient(launcher.addresses)

        async def main():
            try:
                return await client.agenerate(ModelRequest(prompt, max_new_tokens=12, temperature=0.8,
                                                           return_routed_experts=True))
            finally:
                await client.aclose()

        resp = asyncio.run(main())
    ref = load(model_dir)
    exp = ref_logprobs(ref, prompt, resp.output_tokens, 0.8)
    assert torch.allclose(torch.tensor(resp.output_logprobs), exp, atol=1e-4)
    seq = prompt + resp.output_tokens
    layers, k = ref.config.num_hidden_layers, ref.config.num_experts_per_tok
    assert resp.routed_experts.shape == (len(seq) - 1, layers * k)  # the client keeps SGLang's rows flat
    routes = resp.routed_experts.reshape(len(seq) - 1, layers, k)
    for layer, x in router_inputs(ref, seq[:-1]).items():
        gate = ref.model.layers[layer].mlp.gate
        ids, _ = group_limited_topk(x, gate.weight, gate.e_score_correction_bias, ref.config)
        assert torch.equal(routes[:, layer].long(), ids), layer
