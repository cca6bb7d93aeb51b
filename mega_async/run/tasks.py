"""What a run learns from: the dataset, the reward, the GRPO workflow, and the checks made before anything starts
(the model card, its weights, the context budget)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from mega_async.api.config import ConfigError, RunConfig
from mega_async.data import check_items, load_rows, synthetic_items
from mega_async.rollout.filters import DynamicFilter
from mega_async.rollout.workflow import GroupWorkflow, make_workflow

logger = logging.getLogger("mega_async.run.tasks")


def build_dataset(cfg: RunConfig, vocab_size: int) -> list[dict[str, Any]]:
    d = cfg.data
    if d.name == "synthetic":
        return synthetic_items(1024, vocab_size, seed=cfg.seed, target=d.synthetic_target)
    if d.name == "gsm8k":  # a local file or directory, else the dataset name (datasets); eval rows held out
        from mega_async.data.gsm8k import load_gsm8k

        return load_gsm8k(d.path, d.split, eval_path=d.eval_path, eval_split=d.eval_split, chat=d.chat_template,
                          eval_size=d.eval_size if cfg.trainer.eval_interval else 0,
                          max_row_bytes=d.max_row_bytes).train
    rows = load_rows(d.path, d.max_row_bytes)  # type: ignore[arg-type]
    if cfg.rollout.workflow in ("rlvr", "multi_turn"):  # a user's workflow reads its own row shape
        check_items(rows, str(d.path), vocab_size)
    return rows


def check_inputs(cfg: RunConfig) -> None:
    """Before anything starts (no run directory yet): the model card exists, prompt + generation budget fits its
    context, the dataset is there and parses, the reward function loads. Raises ConfigError (one line)."""
    from pathlib import Path

    if cfg.inference.backend == "sglang" and not cfg.inference.addresses:  # we launch them: a tested release
        from mega_async.inference.servers import untested_sglang

        if problem := untested_sglang(cfg.inference.allow_untested_sglang):
            raise ConfigError(problem)
    if (host := cfg.trainer.sync_master_address) is not None:  # the trainer's side of the weight-update group
        import socket

        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError) as e:
            raise ConfigError(f"trainer.sync_master_address={host!r} does not resolve on this host ({e}): the "
                              "servers could not reach the trainer there; fix it or leave it out") from None
    card = Path(cfg.model.path) / "config.json"
    if not card.is_file():
        raise ConfigError(f"model.path={cfg.model.path}: config.json not found; pass an HF-format model directory")
    check_card_size(cfg)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(cfg.model.path)
    from mega_async.bridge.families import UnsupportedModelError, check_model

    try:  # what the trainer cannot build faithfully (e.g. DeepSeek's MTP layers) is refused before anything starts
        check_model(hf)
    except UnsupportedModelError as e:
        raise ConfigError(f"model.path={cfg.model.path}: {e}") from None
    cfg.trainer.check_mtp(int(getattr(hf, "num_nextn_predict_layers", 0) or 0))
    ctx = getattr(hf, "max_position_embeddings", None)
    budget = cfg.rollout.max_new_tokens + cfg.data.max_prompt_tokens
    if ctx is not None and budget > ctx:
        raise ConfigError(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} + data.max_prompt_tokens="
                          f"{cfg.data.max_prompt_tokens} = {budget} exceeds the model's context "
                          f"max_position_embeddings={ctx} ({card}); lower one of them")
    try:
        items = build_dataset(cfg, getattr(hf, "vocab_size", 64))
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ConfigError(f"data.path={cfg.data.path}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    if not items:
        raise ConfigError(f"data.path={cfg.data.path}: the dataset is empty")
    reward_for(cfg)


def check_card_size(cfg: RunConfig) -> None:
    """The model card's sizes, from its raw config.json, against this machine before anything reads it with
    transformers (whose config classes build per-layer lists): the random init a card without weights gets here
    (float32, available memory), and a trainer rank's share (model.dtype, this machine's memory at most)."""
    import psutil

    from mega_async.bridge.model_cards import ModelTooLarge, check_fits_memory, has_weights

    from mega_async.api.allocation import ParallelStrategy

    trainer, where = cfg.allocation().trainer, f"model.path={cfg.model.path}"
    s = trainer.strategy if trainer is not None else ParallelStrategy()
    try:
        if not has_weights(cfg.model.path):
            check_fits_memory(cfg.model.path, where, dtype_bytes=4, what="in float32 for its random init")
        check_fits_memory(cfg.model.path, where, dtype_bytes={"float32": 4}.get(cfg.model.dtype, 2),
                          dense_shards=s.tp * s.pp, expert_shards=s.ep * s.etp * s.pp,
                          memory=psutil.virtual_memory().total, what=f"in {cfg.model.dtype} on each trainer rank")
    except ModelTooLarge as e:
        raise ConfigError(str(e)) from None


def reward_for(cfg: RunConfig) -> Callable[..., float]:
    """The reward function `data.reward` names (or the dataset's own: synthetic, gsm8k)."""
    name = cfg.data.reward or cfg.data.name
    if name == "gsm8k":
        from mega_async.reward.gsm8k import gsm8k_reward

        return gsm8k_reward
    if name == "code":
        from mega_async.reward.code import SandboxUnavailable, check_sandbox, code_reward

        try:
            check_sandbox()  # once per process: refuse at start-up, not a run that rejects every sample
        except SandboxUnavailable as e:
            raise ConfigError(f"data.reward=code: {e}") from None
        return code_reward
    if name == "synthetic":
        from mega_async.reward.synthetic import target_token_reward

        return target_token_reward
    import importlib

    module, _, fn = name.partition(":")
    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"data.reward={name!r}: cannot load it ({type(e).__name__}: {e})") from None


def rollout_parts(cfg: RunConfig, service: Any) -> tuple[list, GroupWorkflow, DynamicFilter | None]:
    """Dataset, GRPO group workflow and dynamic filter for a run (shared by both drivers)."""
    r = cfg.rollout
    workflow = GroupWorkflow(make_workflow(cfg, service.tokenizer, reward_for(cfg)), r.group_size)  # rollout.workflow
    flt = DynamicFilter(max_consecutive_drops=r.dynamic_filter_max_drops) if r.dynamic_filter else None
    return within_prompt_budget(build_dataset(cfg, service.vocab_size), workflow.workflow, cfg), workflow, flt


def within_prompt_budget(items: list, workflow: Any, cfg: RunConfig) -> list:
    """Drop items whose prompt exceeds `data.max_prompt_tokens` (counted and logged), so every episode fits the
    model's context with `rollout.max_new_tokens` (checked at load)."""
    limit = cfg.data.max_prompt_tokens
    encode = getattr(workflow, "encode", None)
    if encode is None:
        return items
    span = longest_token(getattr(workflow, "tokenizer", None))
    # a prompt whose text could not fit in `limit` tokens even at the longest token is dropped untokenized: a
    # tokenizer given a row of hundreds of MB takes gigabytes (and aborts), whatever data.max_row_bytes allows
    kept = [it for it in items if (span is None or prompt_chars(it) <= limit * span) and len(encode(it)[0]) <= limit]
    if len(kept) < len(items):
        logger.warning("skipped %d of %d prompts longer than data.max_prompt_tokens=%d", len(items) - len(kept),
                       len(items), limit)
    if not kept:
        raise ConfigError(f"every prompt is longer than data.max_prompt_tokens={limit}; raise it")
    return kept


def longest_token(tokenizer: Any) -> Optional[int]:
    """The most characters one token of `tokenizer` stands for (its vocabulary's longest entry); None unknown."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - no tokenizer, or one without a vocabulary to read: no shortcut
        return None
    return max((len(str(k)) for k in vocab), default=None) or None


def prompt_chars(item: dict) -> int:
    """Characters of an item's prompt text (a prompt, or its messages' contents); 0 for token ids."""
    if "input_ids" in item:
        return 0
    if isinstance(item.get("prompt"), str):
        return len(item["prompt"])
    msgs = item.get("messages")
    return sum(len(m.get("content") or "") if isinstance(m, dict) and isinstance(m.get("content"), str) else 0
               for m in msgs) if isinstance(msgs, list) else 0


def weights_ready(cfg: RunConfig) -> None:
    """The model card has weights: a tiny card that ships only its config gets its seeded random init here, before
    the run directory is written (a bad model.path fails first)."""
    from mega_async.bridge.model_cards import ensure_weights

    ensure_weights(cfg.model.path, seed=cfg.seed)

