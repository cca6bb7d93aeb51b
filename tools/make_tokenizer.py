"""Build the tiny byte-level BPE tokenizer shipped in models/tiny-* (trained on GSM8K questions).

    python tools/make_tokenizer.py ../shared/data/gsm8k/train.jsonl models/tiny-qwen3-moe models/tiny-qwen3

Deterministic for a given input file; the shipped files were made with it, nothing is downloaded.
"""
from __future__ import annotations

import json
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB = 1024
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main(src: str, *out_dirs: str) -> None:
    texts = [json.loads(line)["question"] + "\n" + json.loads(line)["answer"] for line in open(src, encoding="utf-8")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE
    for d in out_dirs:
        fast.save_pretrained(d)
        print(f"wrote tokenizer ({len(fast)} tokens) to {d}")


if __name__ == "__main__":
    if len(sys.argv) < 3 or not sys.argv[1].endswith(".jsonl"):
        sys.exit("usage: python tools/make_tokenizer.py GSM8K_TRAIN.jsonl OUT_DIR [OUT_DIR ...]")
    main(*sys.argv[1:])
