"""Multi-token-prediction layers (DeepSeek-V3, GLM-4.5), gloo, fp32.

Parity: Megatron's MTP block, as the trainer runs it, against a reference written here from DeepSeek-V3's formula
with the checkpoint's tensors: h = the main model's last hidden state (after its final norm), e = the embedding of
the next token, x = eh_proj(cat(enorm(e), hnorm(h))) (embedding first: the checkpoints' eh_proj and SGLang's NextN
draft, deepseek_nextn.py, take that order; the paper writes the other), one decoder block (transformers' own, as
layer num_hidden_layers), shared_head.norm, the output head. One rank for both families; TP2 (+ sequence
parallel), EP2 and PP2 for DeepSeek-V3. Engine: trainer.mtp=train trains the layer with its own loss (logged apart
from the policy loss); freeze carries it unchanged. Slow: two launches."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mega_async.bridge.model_cards import TINY_DEEPSEEK, TINY_GLM, init_random_weights
from tests.dist.jobs import run_grouped

sys.path.insert(0, str(Path(__file__).parent))
from parity_worker import batch  # noqa: E402

pytestmark = pytest.mark.slow

CARDS = {"deepseek": TINY_DEEPSEEK, "glm": TINY_GLM}
FORWARD = [("deepseek", "megatron:d1", 1), ("glm", "megatron:d1", 1), ("deepseek", "megatron:t2", 2),
           ("deepseek", "megatron:d2e2", 2), ("deepseek", "megatron:p2", 2), ("glm", "megatron:t2", 2)]
ENGINE = [("train", "megatron:d1", 1), ("freeze", "megatron:d1", 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    weights = {k: init_random_weights(card, root / k, seed=0) for k, card in CARDS.items()}
    cases = {f"fwd-{k}-{layout}": (n, ["mtp_worker.py", "forward", "--model", str(weights[k]), "--layout", layout,
                                       "--out", str(root / f"fwd-{k}-{layout}")]) for k, layout, n in FORWARD}
    cases.update({f"eng-{mode}": (n, ["mtp_worker.py", "engine", "--model", str(weights["deepseek"]), "--layout",
                                      layout, "--mtp", mode, "--out", str(root / f"eng-{mode}")])
                  for mode, layout, n in ENGINE})
    return root, weights, run_grouped(cases, root / "launches")


def reference(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(main logits, MTP logits) [b, s, v] of the written-out formula (positions s-1 of the MTP logits: no next
    token; Megatron embeds token 0 there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mega_async.server.weights import load_named_tensors

    tokens, _ = batch()
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg._attn_implementation = "eager"
    m = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=torch.float32).eval()
    sd = load_file(str(model_dir / "model.safetensors"))
    n = cfg.num_hidden_layers
    pre = f"model.layers.{n}."
    own = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}
    layer = type(m.model.layers[-1])(cfg, n).float().eval()
    load_named_tensors(layer, [(k, v) for k, v in own.items()
                               if not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))])
    norm = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w  # noqa: E731
    with torch.no_grad():
        h = m.model(tokens).last_hidden_state  # after the final norm
        nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)
        e = torch.nn.functional.embedding(nxt, own["embed_tokens.weight"])
        x = torch.cat([norm(e, own["enorm.weight"]), norm(h, own["hnorm.weight"])], -1) @ own["eh_proj.weight"].T
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        cos_sin = m.model.rotary_emb(x, pos)
        s = tokens.shape[1]
        mask = torch.full((s, s), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        mtp = norm(out, own["shared_head.norm.weight"]) @ own["shared_head.head.weight"].T
        return m(tokens).logits, mtp


@pytest.mark.parametrize("kind, layout, nproc", FORWARD, ids=[f"{k}-{l.split(':')[1]}" for k, l, _ in FORWARD])
def test_mtp_forward_matches_the_formula(runs, kind, layout, nproc):
    root, weights, results = runs
    name = f"fwd-{kind}-{layout}"
    assert results[name] is None, results[name]
    got = load_file(str(root / name / "mtp.safetensors"))
    logits, mtp = reference(weights[kind])
    main_gap = (got["logits"] - logits).abs().max().item()
    gap = (got["mtp"][:, :-1] - mtp[:, :-1]).abs().max().item()  # the last position has no next token
    print(f"mtp parity {kind} {layout}: |MTP logits - formula| max {gap:.2e} (main logits {main_gap:.2e}, "
          f"MTP logits spread {mtp.std().item():.2e})")
    assert main_gap < 1e-4 and gap < 1e-4, (main_gap, gap)
    assert (got["mtp"][:, :-1] - logits[:, :-1]).abs().max() > 1e-2  # the MTP head is not the main one


def test_mtp_trains_with_its_own_loss_and_freeze_carries_it(runs):
    root, weights, results = runs
    src = load_file(str(weights["deepseek"] / "model.safetensors"))
    own = [k for k in src if k.startswith("model.layers.4.") and "embed_tokens" not in k and "shared_head.head" not in k
           and not k.endswith("e_score_correction_bias")]
    out = {}
    for mode in ("train", "freeze"):
        assert results[f"eng-{mode}"] is None, results[f"eng-{mode}"]
        w = load_file(str(root / f"eng-{mode}" / "weights.safetensors"))
        stats = json.loads((root / f"eng-{mode}" / "stats.json").read_text())["stats"]
        assert w.keys() == src.keys()
        # the MTP layer's embedding and head are the model's (shared, as SGLang's draft shares them)
        assert torch.equal(w["model.layers.4.embed_tokens.weight"], w["model.embed_tokens.weight"])
        assert torch.equal(w["model.layers.4.shared_head.head.weight"], w["lm_head.weight"])
        out[mode] = (w, stats)
    w, stats = out["train"]
    # every MTP weight outside the routed experts trained (an expert no token picked has no gradient)
    assert all(not torch.equal(w[k], src[k]) for k in own if ".mlp.experts." not in k)
    assert all(0 < s["mtp_loss"] < 10 and s["mtp_tokens"] > 0 for s in stats)
    assert stats[1]["mtp_loss"] < stats[0]["mtp_loss"]  # its own loss goes down
    w, stats = out["freeze"]
    assert all(torch.equal(w[k], src[k]) for k in own)  # carried unchanged
    assert all("mtp_loss" not in s for s in stats)
    # the policy's loss and statistics are the objective's alone: the same first step with and without MTP training
    assert out["train"][1][0]["loss"] == pytest.approx(out["freeze"][1][0]["loss"], abs=1e-6)
