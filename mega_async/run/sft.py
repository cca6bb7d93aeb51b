"""`mega-async sft`: supervised fine-tuning of a model card on a generated task (task.name: addition, or the
long-tailed countdown) through the Megatron train engine (`EngineConfig.loss="sft"`: cross-entropy of the answer
tokens), one rank.

    mega-async sft -c configs/addition_sft_cpu.yaml [key=value ...]

The run directory (`logging.root_dir/experiment_name/trial_name`) receives what the RL run reads:
`final_hf/` (HF weights + config + tokenizer: the RL config's model.path), `rl_prompts.jsonl` (train-split
prompts for RL, another seed than the SFT problems), `eval.jsonl` (held-out problems) and `sft_eval.json`
(exact match of the final weights on eval.jsonl: greedy and sampled at temperature 1), plus `metrics.jsonl`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import yaml

from mega_async.api.config import ConfigError
from mega_async.api.sft_config import SFTConfig, SFTTask

logger = logging.getLogger("mega_async.run.sft")


def task_items(task: SFTTask, n: int, tokenizer: Any, seed: int, split: str) -> list[dict[str, Any]]:
    """`n` items {input_ids, prompt, answer} of the configured task's `split`."""
    if task.name == "countdown":
        from mega_async.data.countdown import countdown_items

        return countdown_items(n, task.digits, tokenizer, seed, split, task.min_count, task.max_count)
    from mega_async.data.addition import addition_items

    return addition_items(n, task.digits, tokenizer, seed=seed, split=split)


def task_char_ids(task: SFTTask, tokenizer: Any) -> dict[str, int]:
    from mega_async.data import addition, countdown

    return (countdown if task.name == "countdown" else addition).char_ids(tokenizer)


def sft_batch(examples: Sequence[tuple[list[int], list[int]]]) -> dict[str, torch.Tensor]:
    """Right-padded [n, L] tensors in the engine's trajectory layout (the RL-only fields are zeros)."""
    n, L = len(examples), max(len(ids) for ids, _ in examples)
    ids = torch.zeros(n, L, dtype=torch.long)
    att, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (toks, m) in enumerate(examples):
        ids[i, :len(toks)] = torch.tensor(toks)
        att[i, :len(toks)] = 1
        mask[i, :len(m)] = torch.tensor(m)
    return {"input_ids": ids, "attention_mask": att, "loss_mask": mask, "logprobs": torch.zeros(n, L),
            "versions": torch.zeros_like(ids), "advantages": torch.zeros(n)}


@torch.no_grad()
def exact_match(model: Any, items: Sequence[dict[str, Any]], tokenizer: Any, temperature: float = 0.0,
                samples: int = 1, seed: int = 0, max_new_tokens: Optional[int] = None) -> float:
    """Fraction of (item, sample) pairs whose decoded completion equals the item's answer, with `model` an HF
    causal LM; greedy at temperature 0. Prompts of one length decode together as a batch (no padding)."""
    from mega_async.reward.addition import addition_reward

    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    new = max_new_tokens or max(len(it["answer"]) for it in items) + 1
    model.eval()
    by_len: dict[int, list[dict[str, Any]]] = {}
    for it in items:
        by_len.setdefault(len(it["input_ids"]), []).append(it)
    ok = 0
    for group in by_len.values():
        x = torch.tensor([it["input_ids"] for it in group for _ in range(samples)])
        out, past = [], None
        for _ in range(new):
            r = model(input_ids=x, past_key_values=past, use_cache=True)
            past, logits = r.past_key_values, r.logits[:, -1].float()
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            else:
                nxt = logits.argmax(-1)
            out.append(nxt)
            x = nxt[:, None]
        answers = [it["answer"] for it in group for _ in range(samples)]
        for row, ans in zip(torch.stack(out, 1).tolist(), answers):
            row = row[:row.index(eos)] if eos in row else row
            ok += addition_reward("", tokenizer.decode(row, skip_special_tokens=True), ans) == 1.0
    return ok / (len(items) * samples)


def evaluate_dir(model_dir: str | Path, items: Sequence[dict[str, Any]], samples: int = 4,
                 seed: int = 0) -> dict[str, float]:
    """Greedy and sampled (temperature 1, `samples` each) exact match of an HF directory on `items`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return {"greedy": exact_match(model, items, tok), "sampled_t1": exact_match(model, items, tok, 1.0, samples, seed),
            "problems": len(items), "samples": samples}


def _engine_eval(engine: Any, cfg: SFTConfig, items: list, tok: Any) -> dict[str, float]:
    """The engine's current weights in an HF model, scored on the held-out items."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.path), dtype=torch.float32)
    state = dict(engine.export_hf_weights())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:  # a tied lm_head is not exported
        raise RuntimeError(f"exported weights do not match the card: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.tie_weights()
    return {"greedy": exact_match(model, items, tok),
            "sampled_t1": exact_match(model, items, tok, 1.0, cfg.task.eval_samples, cfg.seed)}


def run_sft(cfg: SFTConfig) -> dict[str, Any]:
    """Train, export `final_hf/`, write the task's splits and the final evaluation; returns the evaluation."""
    from transformers import AutoTokenizer

    from mega_async.api.allocation import parse_allocation
    from mega_async.data.addition import sft_example, write_jsonl
    from mega_async.run.metrics import Metrics
    from mega_async.bridge.model_cards import has_weights, init_random_weights
    from mega_async.trainer.engine import EngineConfig, MegatronTrainEngine
    from mega_async.trainer.parallel import destroy_parallel_state, init_distributed
    from mega_async.trainer.weights import save_hf_checkpoint

    if not (Path(cfg.model.path) / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path}: config.json not found; pass an HF-format model card")
    run_dir, t, k = cfg.run_dir, cfg.trainer, cfg.task
    if (run_dir / "final_hf").exists():
        raise ConfigError(f"{run_dir} already holds a finished SFT run (final_hf/); pick another trial_name or "
                          "remove it")
    torch.set_num_threads(t.threads or len(os.sched_getaffinity(0)))
    start = cfg.model.path
    if cfg.model.init == "random":
        start = str(init_random_weights(cfg.model.path, run_dir / "init", seed=cfg.seed, force=True))
        logger.info("sft starts from a random init of %s (seed %d): %s", cfg.model.path, cfg.seed, start)
    elif not has_weights(cfg.model.path):
        raise ConfigError(f"model.init=pretrained but {cfg.model.path} has no weights; use model.init=random")
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    ids, eos = task_char_ids(k, tok), tok.eos_token_id
    train = task_items(k, t.total_steps * t.batch_size, tok, cfg.seed, "train")
    held = task_items(k, k.eval_size, tok, 0, "eval")
    seen = {it["prompt"] for it in held}  # the stop decision is taken on other held-out problems than the report
    dev = [it for it in task_items(k, k.eval_size, tok, 1, "eval") if it["prompt"] not in seen]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sft_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    write_jsonl(held, run_dir / "eval.jsonl")
    write_jsonl(task_items(k, k.rl_prompts, tok, cfg.seed + 1000, "train"), run_dir / "rl_prompts.jsonl")
    torch.manual_seed(cfg.seed)
    init_distributed()
    engine = MegatronTrainEngine(start, parse_allocation("megatron:d1"), EngineConfig.of(
        lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, warmup_steps=t.warmup_steps,
        total_steps=t.total_steps, lr_decay=t.lr_decay, grad_clip=t.grad_clip, max_tokens_per_mb=t.max_tokens_per_mb,
        loss="sft", label_smoothing=t.label_smoothing))
    metrics = Metrics(run_dir, tensorboard=False)
    t0 = time.monotonic()
    try:
        for step in range(t.total_steps):
            batch = sft_batch([sft_example(it, ids, eos) for it in train[step * t.batch_size:(step + 1) * t.batch_size]])
            st = engine.train_batch(batch)
            ev = {}
            if t.eval_interval and (step + 1) % t.eval_interval == 0 and step + 1 < t.total_steps:
                ev = {f"eval/{k2}": v for k2, v in _engine_eval(engine, cfg, dev, tok).items()}
            metrics.log(step, {"loss": st["loss"], "tokens": st["tokens"], "grad_norm": st["grad_norm"],
                               "lr": st["lr"], **ev})
            if step % 50 == 0 or ev:
                logger.info("sft step %d/%d: loss %.4f, lr %.2e%s (%.0fs)", step, t.total_steps, st["loss"],
                            st["lr"], f", eval greedy {ev['eval/greedy']:.3f}" if ev else "", time.monotonic() - t0)
            if ev and t.stop_at_accuracy is not None and ev["eval/greedy"] >= t.stop_at_accuracy:
                logger.info("sft: held-out greedy exact match %.3f >= trainer.stop_at_accuracy=%.3f after %d steps: "
                            "stopping", ev["eval/greedy"], t.stop_at_accuracy, step + 1)
                break
        save_hf_checkpoint(engine.models, run_dir / "final_hf", src_dir=cfg.model.path, legacy=True)
    finally:
        metrics.close()
        destroy_parallel_state()
    result = {**evaluate_dir(run_dir / "final_hf", held, k.eval_samples, cfg.seed), "steps": step + 1,
              "train_s": round(time.monotonic() - t0, 1)}
    (run_dir / "sft_eval.json").write_text(json.dumps(result, indent=1) + "\n")
    logger.info("sft done: exact match greedy %.3f, sampled (t=1) %.3f on %d held-out problems; %s",
                result["greedy"], result["sampled_t1"], len(held), run_dir / "final_hf")
    return result
