"""Next-token sampling for the embedded server: SGLang's logit processors, then temperature/top-k/top-p/min-p.

Order as in SGLang: penalties and logit bias change the logits (frequency/presence subtract, repetition
scales, min_new_tokens masks the stop tokens), then the logprob is log_softmax(logits / T) before any
truncation, then a token is drawn from the truncated distribution. Penalties count output tokens only.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch


def process_logits(logits: torch.Tensor, reqs: Sequence[Any], eos_ids: set[int]) -> torch.Tensor:
    """Apply each request's logit_bias, min_new_tokens and frequency/presence/repetition penalties in place."""
    V = logits.shape[-1]
    for i, r in enumerate(reqs):
        if r.logit_bias:
            ids, vals = _cached(r, "bias", lambda: _bias_tensors(r.logit_bias, V, logits))
            if ids.numel():
                logits[i].index_add_(0, ids, vals)
        if r.min_new_tokens and len(r.output_ids) < r.min_new_tokens:
            stops = _cached(r, "min_new_stops", lambda: torch.tensor(
                sorted(t for t in (set(r.stop_token_ids) | (set() if r.ignore_eos else eos_ids)) if 0 <= t < V),
                dtype=torch.long, device=logits.device))
            if stops.numel():
                logits[i, stops] = float("-inf")
        needs = r.frequency_penalty or r.presence_penalty or r.repetition_penalty != 1.0
        if needs and r.output_ids:
            counts = torch.zeros(V, dtype=logits.dtype, device=logits.device)
            counts.index_add_(0, torch.tensor(r.output_ids, device=logits.device),
                              torch.ones(len(r.output_ids), dtype=logits.dtype, device=logits.device))
            seen = counts > 0
            if r.repetition_penalty != 1.0:
                row = logits[i]
                scaled = torch.where(row < 0, row * r.repetition_penalty, row / r.repetition_penalty)
                logits[i] = torch.where(seen, scaled, row)
            logits[i] -= r.frequency_penalty * counts + r.presence_penalty * seen.to(logits.dtype)
    return logits


def _cached(r: Any, key: str, make: Any) -> Any:
    """A request's per-request tensor, built on its first step (a client's logit_bias or stop ids may hold
    the whole vocabulary: rebuilding them from Python each step cost the batch that much every step)."""
    cache = getattr(r, "sampling_cache", None)
    if cache is None:
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _bias_tensors(bias: dict, V: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    items = [(t, v) for t, v in bias.items() if 0 <= t < V]
    ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=like.device)
    return ids, torch.tensor([v for _, v in items], dtype=like.dtype, device=like.device)


def sample_full(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                generator: Optional[torch.Generator] = None, min_p: Optional[list[float]] = None,
                generators: Optional[list[Optional[torch.Generator]]] = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B], their logprobs [B], log_softmax(logits / T) [B, V]) for each row of `logits` [B, V].

    Greedy below temperature 1e-6 (logprobs then use T = 1). Sampling uses the exponential race
    (argmax p / Exp(1)), which draws exactly from p; a row with its own generator (sampling_seed)
    draws its noise from it, so its output depends only on its seed.
    """
    dev = logits.device
    B, V = logits.shape
    min_p = min_p or [0.0] * B
    greedy = torch.tensor([t < 1e-6 for t in temperature], device=dev)
    temp = torch.tensor([1.0 if t < 1e-6 else t for t in temperature], device=dev)
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    tokens = logp.argmax(-1)
    if not bool(greedy.all()):
        probs = logp.exp()
        trunc = [i for i, t in enumerate(temperature)
                 if t >= 1e-6 and (top_k[i] > 0 or top_p[i] < 1.0 or min_p[i] > 0)]
        if trunc:
            rows = torch.tensor(trunc, device=dev)
            k = torch.tensor([top_k[i] if top_k[i] > 0 else V for i in trunc], device=dev).clamp(max=V)
            p = torch.tensor([top_p[i] for i in trunc], device=dev)
            mp = torch.tensor([min_p[i] for i in trunc], device=dev)
            p_sorted, order = probs[rows].sort(dim=-1, descending=True)
            before = p_sorted.cumsum(-1) - p_sorted  # mass of strictly more likely tokens
            drop = (torch.arange(V, device=dev)[None, :] >= k[:, None]) | (before > p[:, None])
            drop |= p_sorted < mp[:, None] * p_sorted[:, :1]
            p_sorted = p_sorted.masked_fill(drop, 0.0)
            probs[rows] = torch.zeros_like(p_sorted).scatter_(1, order, p_sorted)
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        for i, g in enumerate(generators or []):
            if g is not None:
                race[i] = torch.empty(V, device=dev, dtype=probs.dtype).exponential_(1.0, generator=g)
        tokens = torch.where(greedy, tokens, (probs / race).argmax(-1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1), logp


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob per row of `logits` [B, V] (see sample_full)."""
    tokens, lps, _ = sample_full(logits, temperature, top_k, top_p, generator)
    return tokens, lps


def top_logprobs(logp: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The k most likely (logprob, token id) of one row, most likely first."""
    vals, ids = logp.topk(min(k, logp.shape[-1]))
    return list(zip(vals.tolist(), ids.tolist()))
