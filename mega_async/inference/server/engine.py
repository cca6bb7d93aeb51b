"""Continuous-batching generation engine for the embedded server (transformers model, CPU or GPU).

One thread owns the model. Each iteration: run queued commands (weight loads, aborts) ->
admit waiting requests (prefill one by one, merge into the batch KV cache, left-padded) ->
one decode step for every running request -> retire finished rows. Requests arriving while
others decode join the running batch; everything is interruptible between two decode steps.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger("mega_async.inference.engine")


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: set[int] = field(default_factory=set)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # state, owned by the engine thread
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    abort_requested: bool = False
    created: float = field(default_factory=time.monotonic)
    on_finish: Optional[Callable[["GenRequest"], None]] = None


class GenerationEngine:
    def __init__(self, model: Any, tokenizer: Any = None, max_batch_size: int = 64, seed: int = 0):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.eos_ids = self._eos_ids()
        self.weight_version = "0"
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        self._lock = threading.Lock()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._running: list[GenRequest] = []
        self._cmds: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._wake = threading.Event()
        self._hold = False  # in-place pause: keep requests, stop decoding
        self._stopping = False
        self._cache: Any = None
        self._mask: Optional[torch.Tensor] = None  # [B, L] 1 = real cached token
        self._pos: Optional[torch.Tensor] = None  # [B] position of each row's next token
        self._last: Optional[torch.Tensor] = None  # [B] last sampled token (not yet in the cache)
        self.steps = 0
        self.generated_tokens = 0
        self._thread = threading.Thread(target=self._loop, name="gen-engine", daemon=True)
        self._thread.start()

    def _eos_ids(self) -> set[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None) or getattr(self.model.config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    # ---- public API (any thread) -----------------------------------------------------------
    def add_request(self, req: GenRequest) -> None:
        with self._lock:
            self._waiting.append(req)
        self._wake.set()

    def run_command(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two decode steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._cmds.append((fn, fut))
        self._wake.set()
        return fut

    def abort(self, rid: str = "", abort_all: bool = False) -> concurrent.futures.Future:
        """Abort requests whose rid starts with `rid` (or all); resolves once they are answered."""

        def do() -> int:
            n = 0
            with self._lock:
                waiting = list(self._waiting)
            for r in waiting + self._running:
                if abort_all or (rid and r.rid.startswith(rid)):
                    r.abort_requested = True
                    n += 1
            self._retire_aborted()
            return n

        return self.run_command(do)

    def hold(self, on: bool) -> None:
        """In-place pause: running requests keep their state and resume decoding on release."""
        self._hold = on
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def is_idle(self) -> bool:
        return not self._running and self.num_waiting == 0

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._run_commands()
                if self._hold:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._retire_aborted()
                self._admit()
                if not self._running:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._decode_step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                logger.exception("engine step failed; aborting %d running requests", len(self._running))
                for r in self._running:
                    self._finish(r, {"type": "abort", "message": f"engine error: {e}"})
                self._running, self._cache = [], None
        for r in self._running + list(self._waiting):
            self._finish(r, {"type": "abort", "message": "server shutting down"})

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._cmds:
                    return
                fn, fut = self._cmds.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                fut.set_exception(e)

    def _finish(self, r: GenRequest, reason: dict) -> None:
        r.finish_reason = reason
        if r.on_finish is not None:
            try:
                r.on_finish(r)
            except Exception:  # noqa: BLE001
                logger.exception("on_finish callback failed for %s", r.rid)

    def _retire_aborted(self) -> None:
        with self._lock:
            queued = [r for r in self._waiting if r.abort_requested]
            self._waiting = collections.deque(r for r in self._waiting if not r.abort_requested)
        for r in queued:
            self._finish(r, {"type": "abort", "message": "Abort in waiting queue"})
        keep = [i for i, r in enumerate(self._running) if not r.abort_requested]
        if len(keep) != len(self._running):
            for r in self._running:
                if r.abort_requested:
                    self._finish(r, {"type": "abort", "message": "Aborted"})
            self._select_rows(keep)

    def _admit(self) -> None:
        free = self.max_batch_size - len(self._running)
        with self._lock:
            new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        if new:
            self._prefill(new)

    @torch.no_grad()
    def _prefill(self, reqs: list[GenRequest]) -> None:
        """One forward over the new prompts (left-padded), then merge their KV cache into the batch."""
        from transformers import DynamicCache

        lengths = [len(r.input_ids) for r in reqs]
        L = max(lengths)
        ids = torch.tensor([[0] * (L - n) + r.input_ids for r, n in zip(reqs, lengths)], device=self.device)
        mask = torch.tensor([[0] * (L - n) + [1] * n for n in lengths], device=self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        out = self.model(ids, attention_mask=mask, position_ids=pos, cache=DynamicCache(config=self.model.config),
                         use_cache=True)
        toks, lps = self._sample(out.logits[:, -1].float(), reqs)
        keep = []
        for i, r in enumerate(reqs):
            self._append(r, int(toks[i]), float(lps[i]))
            if not self._check_finished(r):
                keep.append(i)
        if not keep:
            return
        idx = torch.tensor(keep, device=self.device)
        for layer in out.cache.layers:
            layer.keys, layer.values = layer.keys[idx], layer.values[idx]
        self._merge([reqs[i] for i in keep], out.cache, mask[idx], torch.tensor(lengths, device=self.device)[idx],
                    toks[idx])

    def _merge(self, reqs: list[GenRequest], cache: Any, mask: torch.Tensor, pos: torch.Tensor,
               last: torch.Tensor) -> None:
        """Append rows to the batch KV cache, left-padding the shorter side so every row ends at the last column."""
        if self._cache is None:
            self._cache, self._mask, self._pos, self._last = cache, mask, pos, last
            self._running = list(reqs)
            return
        L = max(self._mask.shape[1], mask.shape[1])
        pad_b, pad_n = L - self._mask.shape[1], L - mask.shape[1]
        for lb, ln in zip(self._cache.layers, cache.layers):
            lb.keys = torch.cat([F.pad(lb.keys, (0, 0, pad_b, 0)), F.pad(ln.keys, (0, 0, pad_n, 0))])
            lb.values = torch.cat([F.pad(lb.values, (0, 0, pad_b, 0)), F.pad(ln.values, (0, 0, pad_n, 0))])
        self._mask = torch.cat([F.pad(self._mask, (pad_b, 0)), F.pad(mask, (pad_n, 0))])
        self._pos = torch.cat([self._pos, pos])
        self._last = torch.cat([self._last, last])
        self._running += reqs

    def _select_rows(self, keep: list[int]) -> None:
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._pos = self._last = None
            return
        idx = torch.tensor(keep, device=self.device)
        self._mask = self._mask[idx]
        trim = int((self._mask.sum(0) == 0).long().cumprod(0).sum())  # all-padding columns on the left
        self._mask = self._mask[:, trim:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, trim:]
            layer.values = layer.values[idx, :, trim:]
        self._pos, self._last = self._pos[idx], self._last[idx]

    @torch.no_grad()
    def _decode_step(self) -> None:
        B = len(self._running)
        mask = torch.cat([self._mask, torch.ones(B, 1, dtype=torch.long, device=self.device)], dim=1)
        out = self.model(self._last[:, None], attention_mask=mask, position_ids=self._pos[:, None],
                         cache=self._cache, use_cache=True)
        self._cache, self._mask = out.cache, mask
        self._pos = self._pos + 1
        toks, lps = self._sample(out.logits[:, -1].float(), self._running)
        self._last = toks
        self.steps += 1
        keep = []
        for i, r in enumerate(self._running):
            self._append(r, int(toks[i]), float(lps[i]))
            if not self._check_finished(r):
                keep.append(i)
        if len(keep) != B:
            self._select_rows(keep)

    def _append(self, r: GenRequest, tok: int, lp: float) -> None:
        r.output_ids.append(tok)
        r.output_logprobs.append(lp)
        self.generated_tokens += 1

    def _check_finished(self, r: GenRequest) -> bool:
        tok = r.output_ids[-1]
        reason = None
        if tok in r.stop_token_ids or (not r.ignore_eos and tok in self.eos_ids):
            reason = {"type": "stop", "matched": tok}
        elif r.stop and self.tokenizer is not None:
            # every token decodes to at least one byte, so the last (longest stop in bytes + 1) tokens hold
            # any match that ends in the newest token (an earlier match would have stopped earlier)
            window = max(len(s.encode("utf-8")) for s in r.stop) + 1
            text = self.tokenizer.decode(r.output_ids[-window:])
            hit = next((s for s in r.stop if s in text), None)
            if hit is not None:
                reason = {"type": "stop", "matched": hit}
        if reason is None and len(r.output_ids) >= r.max_new_tokens:
            reason = {"type": "length", "length": len(r.output_ids)}
        if reason is not None:
            self._finish(r, reason)
            return True
        return False

    def _sample(self, logits: torch.Tensor, reqs: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(logits, [r.temperature for r in reqs], [r.top_k for r in reqs], [r.top_p for r in reqs],
                      self._gen)


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its logprob per row of `logits` [B, V].

    Greedy below temperature 1e-6; else sampling, with top-k/top-p truncation where asked.
    Logprobs are log_softmax(logits / T) before truncation (greedy rows use T = 1), as SGLang
    reports them. Sampling uses the exponential race (argmax p / Exp(1)), which draws exactly
    from p without a sort or multinomial; only truncated rows pay for a sort.
    """
    dev = logits.device
    greedy = torch.tensor([t < 1e-6 for t in temperature], device=dev)
    temp = torch.tensor([1.0 if t < 1e-6 else t for t in temperature], device=dev)
    logp = torch.log_softmax(logits / temp[:, None], dim=-1)
    tokens = logp.argmax(-1)
    if not bool(greedy.all()):
        probs = logp.exp()
        trunc = [i for i, t in enumerate(temperature) if t >= 1e-6 and (top_k[i] > 0 or top_p[i] < 1.0)]
        if trunc:
            V = logits.shape[-1]
            rows = torch.tensor(trunc, device=dev)
            k = torch.tensor([top_k[i] if top_k[i] > 0 else V for i in trunc], device=dev).clamp(max=V)
            p = torch.tensor([top_p[i] for i in trunc], device=dev)
            p_sorted, order = probs[rows].sort(dim=-1, descending=True)
            before = p_sorted.cumsum(-1) - p_sorted  # mass of strictly more likely tokens
            drop = (torch.arange(V, device=dev)[None, :] >= k[:, None]) | (before > p[:, None])
            p_sorted = p_sorted.masked_fill(drop, 0.0)
            probs[rows] = torch.zeros_like(p_sorted).scatter_(1, order, p_sorted)
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        tokens = torch.where(greedy, tokens, (probs / race).argmax(-1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)
