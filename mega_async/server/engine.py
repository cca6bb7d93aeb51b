"""Continuous-batching generation engine of the embedded server (transformers model, CPU or GPU).

One thread owns the model. Each iteration: run queued commands (weight loads, aborts, pauses) ->
retire aborted rows -> admit waiting requests (matched in the radix cache: a hit of all but the last token
joins as a decode row, the rest are prefilled together from their cached prefix, left-padded) -> one decode
step for every running row -> retire finished rows (their KV goes into the radix cache).
Every token is labelled with the weight version of the forward that produced it, on this thread, so
a label can never disagree with the weights. Pauses live here too (abort, retract, in_place): a
request added while paused waits in the queue and is admitted only after resume.
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

from mega_async.server.detokenize import StopMatcher
from mega_async.server.prefix_cache import (KVSource, Lock, Match, RadixCache, plan_round, row_source,
                                                      stack_prefixes)
from mega_async.server.routing import RouteRecorder
from mega_async.server.sampling import process_logits, sample_full, top_logprobs

logger = logging.getLogger("mega_async.server.engine")


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
    min_p: float = 0.0
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: Optional[int] = None
    logprob_start_len: int = -1  # >= 0: prompt logprobs from that position
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[list[int]] = None  # SGLang's: the logprobs of these tokens at every position
    return_routed_experts: bool = False
    # state, owned by the engine thread
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)
    input_logprobs: list[Optional[float]] = field(default_factory=list)
    input_top_logprobs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_token_ids_logprobs: list[Optional[list[tuple[float, int]]]] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)  # [tokens, layers, k] pieces
    cached_tokens: int = 0
    num_retractions: int = 0  # SGLang's retraction_count: times a retract pause requeued it
    prefilled: bool = False
    finish_reason: Optional[dict] = None
    abort_requested: bool = False
    created: float = field(default_factory=time.monotonic)
    on_finish: Optional[Callable[["GenRequest"], None]] = None
    on_step: Optional[Callable[["GenRequest"], None]] = None
    generator: Optional[torch.Generator] = None
    radix_lock: Optional[Lock] = None  # the radix-cache path this request's KV came from / went into
    stop_matcher: Any = None  # its stop strings' incremental matcher (engine thread)
    sampling_cache: dict = field(default_factory=dict)  # its logit_bias / stop-id tensors (sampling.py)

    @property
    def seq(self) -> list[int]:
        """Everything already known: prompt + output (a retracted request is prefilled from this)."""
        return self.input_ids + self.output_ids


class EngineRefused(RuntimeError):
    """An engine command that cannot run in the current state (the message names why and what to do)."""


class GenerationEngine:
    def __init__(self, model: Any, tokenizer: Any = None, max_batch_size: int = 64, seed: int = 0,
                 prefix_cache_tokens: int = 0, record_routes: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.eos_ids = self._eos_ids()
        self.weight_version = "0"
        self.vocab_size = int(model.config.vocab_size)
        self._gen = torch.Generator(device=self.device)
        self._gen.manual_seed(seed)
        self.prefix_cache = RadixCache(prefix_cache_tokens)
        self.routes = RouteRecorder(model) if record_routes else None
        self._lock = threading.Lock()
        self._waiting: collections.deque[GenRequest] = collections.deque()
        self._running: list[GenRequest] = []
        self._cmds: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = collections.deque()
        self._wake = threading.Event()
        self.paused: Optional[str] = None  # abort | retract | in_place
        self.released: set[str] = set()  # memory tags released (weights, kv_cache)
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
        if req.sampling_seed is not None and req.generator is None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(int(req.sampling_seed))
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
            with self._lock:
                waiting = list(self._waiting)
            hit = [r for r in waiting + self._running if abort_all or (rid and r.rid.startswith(rid))]
            for r in hit:
                r.abort_requested = True
            self._retire_aborted()
            return len(hit)

        return self.run_command(do)

    def cancel(self, req: GenRequest) -> None:
        """Abort this request object (its client went away): its row is freed before the next decode step."""
        req.abort_requested = True
        self._wake.set()

    def score(self, reqs: list[GenRequest]) -> concurrent.futures.Future:
        """SGLang's prefill-only requests (max_new_tokens 0): one forward over the prompts, on the engine thread
        between two decode steps, for their input logprobs (and routes); nothing is sampled, the output stays
        empty and each finishes with finish_reason length 0. Resolves when they are finished."""
        def run() -> None:
            try:
                if self.released:
                    raise EngineRefused(f"memory is released ({', '.join(sorted(self.released))})")
                self._score(reqs)
            except Exception as e:  # noqa: BLE001 - answered like a failed engine step: aborted, serving on
                logger.exception("scoring %d prefill-only requests failed", len(reqs))
                self.prefix_cache.reset()  # a step that failed midway may have left it half-updated
                for r in reqs:
                    if r.finish_reason is None:
                        self._finish(r, {"type": "abort", "message": f"engine error: {e}"})

        return self.run_command(run)

    def _score(self, reqs: list[GenRequest]) -> None:
        """Prefill-only requests go through the prefill path (matched in the radix cache, their KV inserted,
        as SGLang's), which finishes them without sampling; at most max_batch_size rows a forward."""
        for k in range(0, len(reqs), self.max_batch_size):
            self._start([(r, self._match(r) if self.prefix_cache.enabled else None)
                         for r in reqs[k:k + self.max_batch_size]])

    def pause(self, mode: str) -> concurrent.futures.Future:
        """Pause on the engine thread: abort answers every request; retract drops their KV and requeues them
        (recomputed under the weights current at resume); in_place keeps everything. Resolves when done."""

        def do() -> int:
            self.paused = mode
            if mode == "abort":
                with self._lock:
                    waiting = list(self._waiting)
                for r in waiting + self._running:
                    r.abort_requested = True
                n = len(waiting) + len(self._running)
                self._retire_aborted()
                return n
            if mode == "retract" and self._running:
                back = self._running
                for r in back:
                    self._release(r, None)  # as SGLang's retract: the KV is dropped, not cached
                    r.num_retractions += 1
                self._running, self._cache = [], None
                self._mask = self._pos = self._last = None
                with self._lock:
                    self._waiting.extendleft(reversed(back))
                return len(back)
            return 0

        return self.run_command(do)

    def resume(self) -> concurrent.futures.Future:
        def do() -> None:
            self.paused = None

        return self.run_command(do)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def is_idle(self) -> bool:
        return not self._running and self.num_waiting == 0

    def flush_cache(self) -> bool:
        """SGLang's rule: only when fully idle, ignoring the queue while paused. Engine thread only."""
        if self._running or (self.paused is None and self.num_waiting):
            return False
        self.prefix_cache.clear()
        return True

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._run_commands()
                self._retire_aborted()
                if self.paused is None and not self.released:
                    self._admit()
                if not self._running or self.paused is not None:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                self._decode_step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                logger.exception("engine step failed; aborting %d running requests", len(self._running))
                for r in self._running:
                    self._finish(r, {"type": "abort", "message": f"engine error: {e}"})
                self._running, self._cache = [], None
                self.prefix_cache.reset()  # a step that failed midway may have left it half-updated
        with self._lock:
            left = self._running + list(self._waiting)
        for r in left:
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
            if queued:
                self._waiting = collections.deque(r for r in self._waiting if not r.abort_requested)
        for r in queued:
            self._finish(r, {"type": "abort", "message": "Abort in waiting queue" if not r.output_ids else "Aborted"})
        keep = [i for i, r in enumerate(self._running) if not r.abort_requested]
        if len(keep) != len(self._running):
            for i, r in enumerate(self._running):
                if r.abort_requested:
                    self._release(r, row_source(self._cache, self._mask, i))
                    self._finish(r, {"type": "abort", "message": "Aborted"})
            self._select_rows(keep)

    def _admit(self) -> None:
        free = self.max_batch_size - len(self._running)
        with self._lock:
            new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        if not new:
            return
        if not self.prefix_cache.enabled:
            self._start([(r, None) for r in new])
            return
        matches = [self._match(r) for r in new]
        now, later, warm = plan_round([tuple(r.seq) for r in new], [m.length for m in matches],
                                      [not self._joins(r, m) for r, m in zip(new, matches)])
        self._start([(new[i], matches[i]) for i in now], warm)
        if later:  # they match what this round's prefill just inserted
            self._start([(new[i], self._match(new[i])) for i in later])

    def _match(self, r: GenRequest) -> Match:
        """SGLang's _compute_max_prefix_len: never the last token, not past logprob_start_len when prompt
        logprobs are asked (they are computed from there), nothing for routed experts (not cached)."""
        limit = len(r.seq) - 1
        if r.logprob_start_len >= 0 and not r.prefilled:
            limit = min(limit, r.logprob_start_len)
        if r.return_routed_experts:
            limit = 0
        return self.prefix_cache.match_prefix(r.seq[:max(limit, 0)])

    @staticmethod
    def _joins(r: GenRequest, m: Optional[Match]) -> bool:
        """All but the last token cached and nothing else to compute: the row joins the batch mid-decode."""
        prompt_lp = r.logprob_start_len >= 0 and not r.prefilled
        return m is not None and 0 < m.length == len(r.seq) - 1 and not prompt_lp and r.max_new_tokens > 0

    def _start(self, items: list[tuple[GenRequest, Optional[Match]]], warm: list[tuple[int, ...]] = ()) -> None:
        """Admit requests with their tree matches: lock the matched paths, count cached_tokens (once, at the
        first admission: a retracted request keeps its number, as SGLang), join full hits, prefill the rest
        together with the warm-up sequences (whose KV only goes into the tree)."""
        tree = self.prefix_cache
        for r, m in items:
            if m is not None:
                r.radix_lock = tree.lock(m.node)
            if not r.prefilled:
                r.cached_tokens = m.length if m is not None else 0
                tree.record(len(r.seq), r.cached_tokens)
        rows = [(r, m) for r, m in items if not self._joins(r, m)]
        if rows or warm:
            self._prefill(rows, [(s, tree.match_prefix(s[:-1])) for s in warm])
        joined = [(r, m) for r, m in items if self._joins(r, m)]
        if joined:
            self._join_cached(joined)

    def _join_cached(self, joined: list[tuple[GenRequest, Match]]) -> None:
        """Add rows whose KV for seq[:-1] is cached, in one merge: their next forward is the last prompt token."""
        dev = self.device
        lengths = [m.length for _, m in joined]
        L = max(lengths)
        mask = torch.tensor([[0] * (L - n) + [1] * n for n in lengths], device=dev)
        for r, _ in joined:
            r.prefilled = True
        self._merge([r for r, _ in joined], self._prefix_kv([m for _, m in joined], L), mask,
                    torch.tensor(lengths, device=dev), torch.tensor([r.seq[-1] for r, _ in joined], device=dev))

    def _prefix_kv(self, matches: list[Optional[Match]], M: int) -> Any:
        """A DynamicCache [B, H, M, D] of each row's cached prefix from the tree, left-padded to M."""
        from transformers import DynamicCache

        c = DynamicCache(config=self.model.config)
        if M:
            kvs = [self.prefix_cache.gather(m.node) if m is not None else None for m in matches]
            for li, (k, v) in enumerate(stack_prefixes(kvs, M)):
                c.update(k, v, li)
        return c

    @torch.no_grad()
    def _prefill(self, items: list[tuple[GenRequest, Optional[Match]]],
                 warm: list[tuple[tuple[int, ...], Match]] = ()) -> None:
        """One forward over what is not cached: each row is [its cached prefix KV, left-padded to the longest]
        + [its other tokens, left-padded]; warm-up rows only fill the tree. The KV then goes into the tree
        (SGLang's checkpoint after prefill) and the request rows join the batch with their first token."""
        reqs = [r for r, _ in items]
        seqs = [r.seq for r in reqs] + [list(s) for s, _ in warm]
        matches = [m for _, m in items] + [m for _, m in warm]
        pre = [m.length if m is not None else 0 for m in matches]
        new = [len(s) - p for s, p in zip(seqs, pre)]
        M, E, dev = max(pre), max(new), self.device
        ids = torch.tensor([[0] * (E - e) + s[p:] for s, p, e in zip(seqs, pre, new)], device=dev)
        mask = torch.tensor([[0] * (M - p) + [1] * p + [0] * (E - e) + [1] * e for p, e in zip(pre, new)], device=dev)
        pos = torch.tensor([[0] * (E - e) + list(range(p, p + e)) for p, e in zip(pre, new)], device=dev)
        cache = self._prefix_kv(matches, M)
        want_lp = [r.logprob_start_len >= 0 and not r.prefilled for r in reqs]
        routing = self.routes is not None and any(r.return_routed_experts for r in reqs)
        if routing:
            self.routes.start()
        out = self.model(ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=0 if any(want_lp) else 1)
        routes = self.routes.take(len(seqs), E) if routing else None
        for i, r in enumerate(reqs):
            if routes is not None and r.return_routed_experts:
                r.routes = [routes[i, E - new[i]:]]  # a retracted request's routes are recomputed too
            if want_lp[i]:
                self._prompt_logprobs(r, out.logits[i, E - new[i]:].float(), pre[i])
            r.prefilled = True
        self._checkpoint(reqs, seqs, out.cache, mask)
        for r in reqs:
            if r.max_new_tokens == 0:  # SGLang's prefill-only request (scoring): nothing is sampled
                self._release(r, None)
                self._finish(r, {"type": "length", "length": 0})
        gen = [i for i, r in enumerate(reqs) if r.max_new_tokens > 0]
        if not gen:
            return
        toks, lps = self._sample(out.logits[gen, -1].float(), [reqs[i] for i in gen])
        keep = []
        for j, i in enumerate(gen):
            self._append(reqs[i], int(toks[j]), float(lps[j]))
            if not self._check_finished(reqs[i], None):  # finished: its KV (the prompt) is in the tree already
                keep.append(j)
        if not keep:
            return
        rows = [gen[j] for j in keep]
        idx = torch.tensor(rows, device=dev)
        mask = mask[idx]
        trim = int((mask.sum(0) == 0).long().cumprod(0).sum())  # all-padding columns on the left
        for layer in out.cache.layers:
            layer.keys, layer.values = layer.keys[idx, :, trim:], layer.values[idx, :, trim:]
        self._merge([reqs[i] for i in rows], out.cache, mask[:, trim:],
                    torch.tensor([len(seqs[i]) for i in rows], device=dev), toks[torch.tensor(keep, device=dev)])

    def _checkpoint(self, reqs: list[GenRequest], seqs: list[list[int]], cache: Any, mask: torch.Tensor) -> None:
        """Insert every prefilled row's KV into the tree; a request's lock moves to the path it inserted."""
        tree = self.prefix_cache
        if not tree.enabled:
            return
        for i, s in enumerate(seqs):
            res = tree.insert(s, row_source(cache, mask, i))
            if i < len(reqs):
                old, reqs[i].radix_lock = reqs[i].radix_lock, tree.lock(res.node)
                tree.unlock(old)

    def _release(self, r: GenRequest, kv_of: Optional[KVSource]) -> None:
        """A row leaves the batch: with `kv_of`, its KV (prompt + output minus the last token) goes into the
        tree unless the tree was reset since that KV was computed (weights changed); then its lock drops."""
        lock, r.radix_lock = r.radix_lock, None
        tree = self.prefix_cache
        if kv_of is not None and tree.is_current(lock) and len(r.seq) > 1:
            tree.insert(r.seq[:-1], kv_of)
        tree.unlock(lock)

    def _prompt_logprobs(self, r: GenRequest, logits: torch.Tensor, offset: int = 0) -> None:
        """input_token_logprobs from logprob_start_len, as SGLang: None there, then log p(prompt[j] | prompt[:j]).

        `logits` are those of positions offset.. (offset <= logprob_start_len: the cached prefix has none)."""
        T = r.temperature if r.temperature >= 1e-6 else 1.0
        n = len(r.input_ids)
        start = min(r.logprob_start_len, n)
        logp = torch.log_softmax(logits[start - offset:n - 1 - offset] / T, -1)  # row j predicts prompt[start + j + 1]
        ids = torch.tensor(r.input_ids[start + 1:], device=logp.device)
        chosen = logp.gather(1, ids[:, None]).squeeze(1).tolist() if len(ids) else []
        r.input_logprobs = [None] + chosen
        if r.top_logprobs_num:
            r.input_top_logprobs = [None] + [top_logprobs(logp[j], r.top_logprobs_num) for j in range(len(chosen))]
        if r.token_ids_logprob is not None:
            r.input_token_ids_logprobs = [None] + [_ids_logprobs(logp[j], r.token_ids_logprob)
                                                   for j in range(len(chosen))]

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
        routing = self.routes is not None and any(r.return_routed_experts for r in self._running)
        if routing:
            self.routes.start()
        out = self.model(self._last[:, None], attention_mask=mask, position_ids=self._pos[:, None],
                         cache=self._cache, use_cache=True)
        if routing:
            routes = self.routes.take(B, 1)
            for i, r in enumerate(self._running):
                if r.return_routed_experts and routes is not None:
                    r.routes.append(routes[i])
        self._cache, self._mask = out.cache, mask
        self._pos = self._pos + 1
        toks, lps = self._sample(out.logits[:, -1].float(), self._running)
        self._last = toks
        self.steps += 1
        keep = []
        for i, r in enumerate(self._running):
            self._append(r, int(toks[i]), float(lps[i]))
            if not self._check_finished(r, row_source(self._cache, self._mask, i)):
                keep.append(i)
        if len(keep) != B:
            self._select_rows(keep)

    def _append(self, r: GenRequest, tok: int, lp: float) -> None:
        r.output_ids.append(tok)
        r.output_logprobs.append(lp)
        r.output_versions.append(self.weight_version)
        self.generated_tokens += 1
        if r.on_step is not None:
            r.on_step(r)

    def _check_finished(self, r: GenRequest, kv_of: Optional[KVSource] = None) -> bool:
        """Finish r if it is done; its row's KV (`kv_of`) enters the radix cache before its answer goes out."""
        tok = r.output_ids[-1]
        reason = None
        if not r.ignore_eos and (tok in r.stop_token_ids or tok in self.eos_ids):  # SGLang: ignore_eos ignores both
            reason = {"type": "stop", "matched": tok}
        elif r.stop and self.tokenizer is not None:  # bounded work per token (detokenize.StopMatcher)
            if r.stop_matcher is None:
                r.stop_matcher = StopMatcher(self.tokenizer, r.stop)
            hit = r.stop_matcher.step(r.output_ids)
            if hit is not None:
                reason = {"type": "stop", "matched": hit}
        if reason is None and len(r.output_ids) >= r.max_new_tokens:
            reason = {"type": "length", "length": len(r.output_ids)}
        if reason is not None:
            self._release(r, kv_of)
            self._finish(r, reason)
            return True
        return False

    def _sample(self, logits: torch.Tensor, reqs: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = process_logits(logits, reqs, self.eos_ids)
        toks, lps, logp = sample_full(logits, [r.temperature for r in reqs], [r.top_k for r in reqs],
                                      [r.top_p for r in reqs], self._gen, [r.min_p for r in reqs],
                                      [r.generator for r in reqs])
        for i, r in enumerate(reqs):
            if r.top_logprobs_num:
                r.output_top_logprobs.append(top_logprobs(logp[i], r.top_logprobs_num))
            if r.token_ids_logprob is not None:
                r.output_token_ids_logprobs.append(_ids_logprobs(logp[i], r.token_ids_logprob))
        return toks, lps


def _ids_logprobs(logp: torch.Tensor, ids: list[int]) -> list[tuple[float, int]]:
    """SGLang's token_ids_logprob at one position: (logprob, id) for each asked id, in the order asked."""
    vals = logp[torch.tensor(ids, dtype=torch.long, device=logp.device)].tolist() if ids else []
    return list(zip(vals, ids))
