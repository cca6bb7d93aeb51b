"""Multi-token-prediction layers: the HF <-> Megatron names, the MTP targets on a packed stream, which servers the
weight sync sends them to (pure; the models run in tests/dist/test_mtp.py)."""
import torch

from mega_async.bridge import mtp
from mega_async.api.sglang_releases import Release, mtp_plan, serves_draft
from mega_async.trainer.mtp import mtp_targets


def test_names_both_ways():
    assert mtp.global_name("mtp.layers.0.transformer_layer.mlp.router.weight", 61) == "decoder.layers.61.mlp.router.weight"
    assert mtp.global_name("mtp.layers.0.eh_proj.weight", 61) == "mtp.layers.0.eh_proj.weight"
    assert mtp.global_name("decoder.layers.3.mlp.router.weight", 61) == "decoder.layers.3.mlp.router.weight"
    assert mtp.hf_names("mtp.layers.0.final_layernorm.weight", 92) == ["model.layers.92.shared_head.norm.weight"]
    assert mtp.hf_names("mtp.layers.1.enorm.weight", 4) == ["model.layers.5.enorm.weight"]
    assert mtp.hf_names("decoder.final_layernorm.weight", 4) is None
    # the shared embedding and head also go out as the MTP layers' copies, where the stage holds them
    assert mtp.export_names("model.embed_tokens.weight", 4, 1, True, True) == [
        "model.embed_tokens.weight", "model.layers.4.embed_tokens.weight"]
    assert mtp.export_names("model.embed_tokens.weight", 4, 1, False, True) == ["model.layers.4.embed_tokens.weight"]
    assert mtp.export_names("lm_head.weight", 4, 1, True, True) == ["lm_head.weight",
                                                                     "model.layers.4.shared_head.head.weight"]
    assert mtp.export_names("lm_head.weight", 4, 0, True, False) == ["lm_head.weight"]
    assert mtp.is_mtp_hf_name("model.layers.4.eh_proj.weight", 4) and not mtp.is_mtp_hf_name("model.layers.3.x", 4)
    assert mtp.shared_copy_of("model.layers.4.shared_head.head.weight", 4) == "lm_head.weight"


def test_targets_stay_inside_each_sequence():
    labels = torch.tensor([11, 12, 13, 0, 21, 22, 0, 0])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 0, 0])
    cu = torch.tensor([0, 4, 8])
    lab, m = mtp_targets(labels, mask, cu)
    assert lab.tolist() == [12, 13, 0, 0, 22, 0, 0, 0]
    assert m.tolist() == [1, 1, 0, 0, 1, 0, 0, 0]  # the token after the next one, if trained and in the sequence
    lab2, m2 = mtp_targets(labels, mask, cu, depth=2)
    assert lab2.tolist() == [13, 0, 0, 0, 0, 0, 0, 0] and m2.tolist() == [1, 0, 0, 0, 0, 0, 0, 0]


def test_which_servers_get_the_mtp_layers():
    new, old = "0.5.23", "0.5.20"
    draft = Release.of(new, draft=True)
    plain = Release.of(new)
    embedded = Release.of(new, embedded=True)
    assert serves_draft({"speculative_algorithm": "EAGLE"}) and serves_draft({"speculative_algorithm": "NEXTN"})
    assert not serves_draft({"speculative_algorithm": None}) and not serves_draft({})
    assert mtp_plan([("a", draft), ("b", draft)]) == (True, None)
    assert mtp_plan([("a", plain), ("b", None)]) == (False, None)  # target only
    assert mtp_plan([("a", embedded)]) == (True, None)  # the embedded server keeps every checkpoint weight
    send, why = mtp_plan([("a", draft), ("b", plain)])
    assert not send and "a serve an MTP draft and b do not" in why and "\n" not in why
    send, why = mtp_plan([("a", Release.of(old, draft=True))])
    assert not send and "a (SGLang 0.5.20)" in why and "trainer.weight_sync=disk" in why
    assert mtp_plan([("a", Release.of(old))]) == (False, None)


def test_mtp_settings_for_a_model_without_mtp_layers_are_refused_not_ignored(tmp_path):
    import pytest

    from mega_async.api.config import ConfigError, TrainerConfig

    from mega_async.api.config_load import load_config
    from mega_async.run.tasks import check_inputs

    TrainerConfig().check_mtp(0)  # the defaults say nothing
    TrainerConfig(mtp="freeze").check_mtp(1)
    with pytest.raises(ConfigError, match=r"^ConfigError: trainer.mtp=freeze: this model has no multi-token-prediction layers"):
        TrainerConfig(mtp="freeze").check_mtp(0)
    cfg = load_config("configs/tiny_cpu.yaml", ["trainer.mtp_loss_scaling_factor=0.5"])  # Qwen3-MoE: none
    with pytest.raises(ConfigError, match="trainer.mtp_loss_scaling_factor=0.5: this model has no"):
        check_inputs(cfg)


def test_what_the_trainer_builds_of_the_mtp_layers_a_card_asks_for():
    """trainer.mtp against what the checkpoint carries (`bridge.mtp.plan`): transformers saves none of them."""
    import pytest

    plan = mtp.plan
    assert plan(1, {0}, "train", "d") == (1, False, None) and plan(1, {0}, "freeze", "d") == (1, False, None)
    assert plan(1, {0}, "off", "d") == (0, False, None) and plan(0, set(), "off", "d") == (0, False, None)
    assert plan(1, set(), "init", "d") == (1, True, None) and plan(1, {0}, "init", "d") == (1, True, None)
    for mode in ("train", "freeze"):  # as transformers saves a model: built without them, said once
        layers, fresh, warning = plan(1, set(), mode, "/m")
        assert (layers, fresh) == (0, False) and warning.startswith("/m: config.json asks for 1 multi-token-")
        assert "num_nextn_predict_layers: 0" in warning and "trainer.mtp=init" in warning and "\n" not in warning
    with pytest.raises(ValueError, match=r"^/m: config.json asks for 2 .* carries layer\(s\) 1 of them.*trainer.mtp=off"):
        plan(2, {1}, "train", "/m")  # some of the layers only: neither trained nor silently dropped
    with pytest.raises(ValueError, match="trainer.mtp='draft': use one of train, freeze, init, off"):
        plan(1, {0}, "draft", "/m")
    assert mtp.held_layers(["model.layers.3.x", "model.layers.4.enorm.weight", "model.layers.5.y", "lm_head.weight"],
                           4) == {0, 1}


def test_mtp_off_is_accepted_for_a_model_without_mtp_layers_and_the_new_modes_are_valid():
    import pytest

    from mega_async.api.config import ConfigError, TrainerConfig

    TrainerConfig(mtp="off").check_mtp(0)  # says what happens anyway
    with pytest.raises(ConfigError, match="trainer.mtp=init: this model has no multi-token-prediction layers"):
        TrainerConfig(mtp="init").check_mtp(0)
    for mode in ("train", "freeze", "init", "off"):
        TrainerConfig(mtp=mode).validate()
    with pytest.raises(ConfigError, match="trainer.mtp"):
        TrainerConfig(mtp="on").validate()
    from mega_async.api.config_load import load_config

    assert load_config(None, ["trainer.mtp=off"]).trainer.mtp == "off"  # YAML 1.1 reads a bare off as false


def test_a_missing_tensor_group_is_named_with_its_fix():
    from types import SimpleNamespace

    from mega_async.bridge import missing_group

    hf = SimpleNamespace(tie_word_embeddings=False, attention_bias=True, n_routed_experts=8, topk_method="noaux_tc")
    assert "tie_word_embeddings: false; set it to true" in missing_group("lm_head.weight", hf, 4)
    assert "routers' expert bias" in missing_group("model.layers.1.mlp.gate.e_score_correction_bias", hf, 4)
    assert "n_shared_experts" in missing_group("model.layers.1.mlp.shared_experts.up_proj.weight", hf, 4)
    assert "8 experts per MoE layer" in missing_group("model.layers.1.mlp.experts.3.up_proj.weight", hf, 4)
    assert "attention_bias: true" in missing_group("model.layers.0.self_attn.q_proj.bias", hf, 4)
    assert "trainer.mtp=init" in missing_group("model.layers.4.eh_proj.weight", hf, 4)


def test_the_embedded_server_serves_a_transformers_saved_model_as_its_target_alone(tmp_path):
    """As SGLang does: no MTP layers kept (none to keep), /server_info says so (the sync sends it none), an
    update's MTP-layer tensors are not its own and are skipped, the trainer's digest leaves them out for it; a
    checkpoint holding some of the MTP weights only is still refused."""
    import pytest
    from safetensors.torch import load_file, save_file

    from mega_async.bridge.model_cards import TINY_DEEPSEEK, init_random_weights
    from mega_async.server.weights import WeightLoadError, load_named_tensors, load_pretrained, mtp_layers_held
    from mega_async.trainer.sync.digest import DigestBuilder, Flavor
    from tests.checkpoints import transformers_saved

    saved = transformers_saved(TINY_DEEPSEEK, tmp_path / "saved")
    model = load_pretrained(saved, torch.float32)
    assert mtp_layers_held(model) == 0 and len(model.model.layers) == model.config.num_hidden_layers == 4
    full = init_random_weights(TINY_DEEPSEEK, tmp_path / "full", seed=0)
    assert mtp_layers_held(load_pretrained(full, torch.float32)) == 1
    sd = load_file(str(full / "model.safetensors"))
    eh = sd["model.layers.4.eh_proj.weight"]
    head = sd["lm_head.weight"]
    assert load_named_tensors(model, [("model.layers.4.eh_proj.weight", eh), ("lm_head.weight", head)]) == 1
    assert torch.equal(model.lm_head.weight, head)
    assert Release.of("0.5.23", embedded=True, mtp_kept=False).keeps_mtp is False
    assert mtp_plan([("a", Release.of("0.5.23", embedded=True, mtp_kept=False))]) == (False, None)
    # the digest of a server without the MTP layers: their tensors are not "missing on the server"
    reply = {"lm_head.weight": "0"}
    b = DigestBuilder(reply, Flavor(torch.float32, "sha256"), 8, mtp_from=4)
    b.add("model.layers.4.eh_proj.weight", eh)
    b.add("model.layers.3.self_attn.o_proj.weight", torch.zeros(2))
    assert b.finish().unused == ["model.layers.3.self_attn.o_proj.weight"]
    partial = tmp_path / "partial"
    transformers_saved(TINY_DEEPSEEK, partial)
    kept = load_file(str(partial / "model.safetensors"))
    save_file({**kept, "model.layers.4.eh_proj.weight": eh}, str(partial / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="num_nextn_predict_layers asks for MTP layers but the checkpoint lacks"):
        load_pretrained(partial, torch.float32)


def test_a_full_reload_without_the_mtp_layers_keeps_the_servers_draft(tmp_path):
    """A disk sync of a run that builds no MTP layers (trainer.mtp=off) writes the target alone: a server holding
    the layers reloads everything else and keeps them (a reload missing any target weight is still refused)."""
    import pytest
    from safetensors.torch import load_file

    from mega_async.bridge.model_cards import TINY_DEEPSEEK, init_random_weights
    from mega_async.server.weights import WeightLoadError, load_named_tensors, load_pretrained

    full = init_random_weights(TINY_DEEPSEEK, tmp_path / "full", seed=0)
    model = load_pretrained(full, torch.float32)
    target = {k: v for k, v in load_file(str(full / "model.safetensors")).items() if ".layers.4." not in k}
    eh = model.state_dict()["model.layers.4.eh_proj.weight"].clone()
    assert load_named_tensors(model, target.items(), strict=True) == len(target)
    assert torch.equal(model.state_dict()["model.layers.4.eh_proj.weight"], eh)
    target.pop("model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(WeightLoadError, match="checkpoint lacks 1 weights"):
        load_named_tensors(model, target.items(), strict=True)
