"""Run by tests/dist/test_sft.py: the engine's SFT loss (EngineConfig.loss="sft") on a batch of addition
examples against transformers' cross-entropy of the same model, and one engine step against a torch Adam step."""
import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mega_async.data.addition import addition_items, char_ids, sft_example
from mega_async.run.sft import sft_batch
from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
from mega_async.trainer.parallel import destroy_parallel_state, init_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    batch = sft_batch([sft_example(it, char_ids(tok), tok.eos_token_id)
                       for it in addition_items(16, 3, tok, seed=0)])
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    labels = batch["input_ids"].clone()
    labels[batch["loss_mask"] == 0] = -100
    logits = hf(input_ids=batch["input_ids"]).logits[:, :-1].float()
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                            ignore_index=-100, label_smoothing=a.label_smoothing)
    opt = torch.optim.Adam(hf.parameters(), lr=1e-3, eps=1e-8)
    ref.backward()
    opt.step()
    init_distributed()
    eng = MegatronTrainEngine(a.model, "megatron:d1", EngineConfig.of(lr=1e-3, grad_clip=0.0, loss="sft",
                                                                    label_smoothing=a.label_smoothing))
    stats = eng.train_batch(batch)
    mine, theirs = dict(eng.export_hf_weights()), hf.state_dict()
    out = {"loss": stats["loss"], "expected": ref.item(), "tokens": stats["tokens"],
           "mask_tokens": int(batch["loss_mask"].sum()),
           "max_weight_diff": max((mine[k] - theirs[k]).abs().max().item() for k in mine)}
    with open(a.out, "w") as f:
        json.dump(out, f)
    destroy_parallel_state()


if __name__ == "__main__":
    main()
