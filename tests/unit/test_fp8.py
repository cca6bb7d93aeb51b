"""FP8 block checkpoints (DeepSeek-V3's format): quantize / dequantize against the reference formula written out
(ragged edge blocks, the config's block size), which tensors are quantized and under which names, the pairing an
update needs, the config a plain or FP8 export writes, and the trainer's reader and the embedded server's loader
on a tiny FP8 card made by quantizing the tiny DeepSeek-V3 card."""
import json

import pytest
import torch
from safetensors.torch import load_file

from mega_async.bridge import HFTensors, fp8
from mega_async.server.weights import (WeightLoadError, checkpoint_names, load_named_tensors, load_pretrained,
                                                 read_safetensors_dir, updates_dequantized)
from mega_async.bridge.model_cards import TINY_DEEPSEEK, init_random_weights


def reference_dequant(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """w[i, j] = float32(q[i, j]) * s[i // block_rows, j // block_cols], element by element."""
    rows, cols = q.shape
    i = torch.arange(rows)[:, None] // block[0]
    j = torch.arange(cols)[None, :] // block[1]
    return q.to(torch.float32) * s[i, j]


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((40, 64), (16, 16)), ((7, 5), (128, 128)),
                                         ((96, 33), (24, 8))])
def test_dequantize_is_the_reference_formula_and_quantize_round_trips(shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * 0.05
    w[: min(block[0], shape[0]), : min(block[1], shape[1])] = 0.0  # an all-zero block
    q, s = fp8.quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))  # ragged edges: one more block
    d = fp8.dequantize(q, s, block)
    assert torch.equal(d, reference_dequant(q, s, block))
    assert torch.equal(fp8.dequantize(q, s, block, torch.bfloat16), reference_dequant(q, s, block).to(torch.bfloat16))
    # per block: amax maps to 448 (e4m3's max), and e4m3 keeps 3 mantissa bits (relative error <= 2^-4)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = w[bi * block[0]:(bi + 1) * block[0], bj * block[1]:(bj + 1) * block[1]]
            assert s[bi, bj] == pytest.approx(max(blk.abs().max().item(), 1e-12) / 448.0)
    assert ((d - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()
    assert (d[: min(block[0], shape[0]), : min(block[1], shape[1])] == 0).all()


def test_what_is_quantized_and_the_names():
    block = (16, 16)
    named = [("model.embed_tokens.weight", torch.randn(10, 8)), ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
             torch.randn(40, 64)), ("model.layers.1.mlp.experts.3.down_proj.weight", torch.randn(64, 16)),
             ("model.layers.1.mlp.gate.weight", torch.randn(16, 64)),
             ("model.layers.1.mlp.gate.e_score_correction_bias", torch.randn(16)),
             ("model.layers.1.mlp.shared_experts.up_proj.weight", torch.randn(16, 64)),
             ("model.layers.0.input_layernorm.weight", torch.ones(64)), ("lm_head.weight", torch.randn(10, 8))]
    out = list(fp8.quantize_named(named, block))
    assert [n for n, _ in out] == [
        "model.embed_tokens.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv", "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv", "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv", "model.layers.0.input_layernorm.weight",
        "lm_head.weight"]
    scaled = {n[: -len("_scale_inv")] for n, _ in out if n.endswith("_scale_inv")}
    assert [t.dtype for n, t in out if n in scaled] == [torch.float8_e4m3fn] * 3
    assert all(t.dtype == torch.float32 for n, t in out if n not in scaled)
    assert [tuple(t.shape) for n, t in out if n.endswith("_scale_inv")] == [(3, 4), (4, 1), (1, 4)]
    skipped = list(fp8.quantize_named(named[:3], block, skip=("model.layers.1.mlp.experts",)))
    assert [t.dtype for _, t in skipped] == [torch.float32, torch.float8_e4m3fn, torch.float32, torch.float32]
    # any order back (a checkpoint's files, a flattened bucket sorted by alignment); the pairs in one update
    back = dict(fp8.dequantize_named(reversed(out), block))
    assert set(back) == {n for n, _ in named} and all(t.dtype == torch.float32 for t in back.values())
    with pytest.raises(fp8.Fp8FormatError, match="kv_a_proj_with_mqa.weight came without its weight_scale_inv"):
        list(fp8.dequantize_named(out[:2], block))
    with pytest.raises(fp8.Fp8FormatError, match="down_proj.weight_scale_inv came without the FP8 weight it scales"):
        list(fp8.dequantize_named(out[4:5], block))
    with pytest.raises(fp8.Fp8FormatError, match=r"weight_scale_inv has shape \(3, 4\), a 40x64 weight in 8x8"):
        list(fp8.dequantize_named(out[1:3], (8, 8)))


def test_configs_and_the_sync_format():
    ds = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128]}, "model_type": "deepseek_v3"}
    assert fp8.block_size(ds) == (128, 128) and fp8.block_size({"model_type": "x"}) is None
    assert "quantization_config" not in fp8.config_for(ds, None)  # a bf16 export of an FP8 source
    assert fp8.config_for(ds, (16, 16))["quantization_config"]["weight_block_size"] == [16, 16]
    assert fp8.config_for({"model_type": "x"}, None) == {"model_type": "x"}
    assert fp8.sync_block("model_dtype", None) is None and fp8.sync_block("fp8_block", ds) == (128, 128)
    with pytest.raises(ValueError, match="needs model.path to be an FP8 block checkpoint"):
        fp8.sync_block("fp8_block", {"model_type": "x"})
    with pytest.raises(ValueError, match="use model_dtype or fp8_block"):
        fp8.sync_block("bf16", ds)
    with pytest.raises(fp8.Fp8FormatError, match="weight_block_size"):
        fp8.block_size({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})


@pytest.fixture(scope="module")
def cards(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    bf16 = init_random_weights(TINY_DEEPSEEK, root / "bf16", seed=0)
    return bf16, fp8.write_checkpoint(bf16, root / "fp8", (16, 16))


def test_the_tiny_fp8_card_and_the_trainers_reader(cards):
    """The trainer reads HF tensors through this reader (mega_async.bridge.HFBridge.load): FP8 weights come back
    as the reference formula's float32, the rest as stored; the card is DeepSeek-V3's published layout."""
    bf16, card = cards
    stored = load_file(str(card / "model.safetensors"))
    config = json.loads((card / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [16, 16]}
    reader = HFTensors(card)
    n = 0
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        got = reader.get(name)
        if t.dtype == torch.float8_e4m3fn:
            assert torch.equal(got, reference_dequant(t, stored[name + "_scale_inv"], (16, 16))), name
            n += 1
        else:
            assert torch.equal(got, t), name
    assert n > 30 and any("kv_b_proj" in k and k.endswith("_scale_inv") for k in stored)


def test_the_embedded_server_loads_fp8_dequantized(cards, tmp_path):
    """At start (transformers' own FP8 loader needs a GPU), from disk and from an update's tensors."""
    from transformers import AutoModelForCausalLM

    bf16, card = cards
    model = load_pretrained(card, torch.float32)
    assert model.fp8_block == (16, 16) and not hasattr(model.config, "quantization_config")
    stored = load_file(str(card / "model.safetensors"))
    live = dict(checkpoint_names(model))
    for name, t in stored.items():
        if t.dtype == torch.float8_e4m3fn:
            assert torch.equal(live[name], reference_dequant(t, stored[name + "_scale_inv"], (16, 16))), name
    plain = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    assert not hasattr(plain, "fp8_block")
    # an update of the FP8 server: pairs dequantized; a non-FP8 server refuses FP8 tensors
    other = fp8.write_checkpoint(init_random_weights(TINY_DEEPSEEK, tmp_path / "o", seed=3), tmp_path / "o8", (16, 16))
    assert load_named_tensors(model, updates_dequantized(model, read_safetensors_dir(other)), strict=True) > 0
    assert torch.equal(dict(checkpoint_names(model))["model.layers.1.mlp.experts.2.up_proj.weight"],
                       HFTensors(other).get("model.layers.1.mlp.experts.2.up_proj.weight"))
    with pytest.raises(WeightLoadError, match="float8_e4m3fn but this server was not started on an FP8 block"):
        list(updates_dequantized(plain, read_safetensors_dir(other)))


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.sync_weight_format=bf16"], "trainer.sync_weight_format"),
    (["trainer.sync_weight_format=fp8_block", "trainer.verify_sync=true", "trainer.verify_sync_method=probe"],
     "FP8 weights change by design"),
])
def test_the_config_key(overrides, needle):
    from mega_async.api.config import ConfigError
    from mega_async.api.config_load import load_config

    assert load_config(None, ["trainer.sync_weight_format=fp8_block"]).trainer.sync_weight_format == "fp8_block"
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)
