"""Episode journals: every generation call of an episode, recorded as it streams, so a checkpoint can keep a
rollout in flight and a resume can continue it instead of regenerating it.

`JournaledEngine(engine, journal)` is what a workflow sees as its engine. Each `agenerate` call gets a
record (its request's prompt and the response so far, extended in place by the client). On resume the
workflow runs again from the top with the saved journal: a call whose record finished returns it without
touching a server; a call whose record is partial continues from its last token. Calls are matched to
records by prompt tokens and sampling settings, in call order (a GRPO group's identical prompts match
their records one by one).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

from mega_async.api.types import ModelRequest, ModelResponse


@dataclass
class CallRecord:
    input_ids: list[int]
    max_new_tokens: int
    response: ModelResponse
    done: bool = False

    def snapshot(self) -> dict[str, Any]:
        r = self.response
        n = min(len(r.output_tokens), len(r.output_logprobs), len(r.output_versions))  # a consistent prefix
        return {"input_ids": list(self.input_ids), "max_new_tokens": self.max_new_tokens, "done": self.done,
                "output_tokens": r.output_tokens[:n], "output_logprobs": r.output_logprobs[:n],
                "output_versions": r.output_versions[:n], "stop_reason": r.stop_reason,
                "num_interruptions": r.num_interruptions,
                # rows of the forwards so far (routing replay), as many as the kept prefix has
                "routed_experts": None if r.routed_experts is None
                else r.routed_experts[:len(self.input_ids) + n - 1].tolist()}

    @classmethod
    def restore(cls, d: dict[str, Any]) -> "CallRecord":
        resp = ModelResponse(input_tokens=list(d["input_ids"]), output_tokens=list(d["output_tokens"]),
                             output_logprobs=list(d["output_logprobs"]), output_versions=list(d["output_versions"]),
                             stop_reason=d["stop_reason"], num_interruptions=d["num_interruptions"])
        if d.get("routed_experts") is not None:
            import torch

            resp.routed_experts = torch.tensor(d["routed_experts"], dtype=torch.int32)
        return cls(list(d["input_ids"]), int(d["max_new_tokens"]), resp, bool(d["done"]))


@dataclass
class EpisodeJournal:
    records: list[CallRecord] = field(default_factory=list)
    _claimed: set[int] = field(default_factory=set)

    def snapshot(self) -> list[dict[str, Any]]:
        return [r.snapshot() for r in self.records]

    @classmethod
    def restore(cls, records: list[dict[str, Any]]) -> "EpisodeJournal":
        return cls([CallRecord.restore(d) for d in records])

    def claim(self, req: ModelRequest) -> Optional[CallRecord]:
        """The first unclaimed saved record of this request (same prompt and budget), if any."""
        for i, r in enumerate(self.records):
            if i not in self._claimed and r.input_ids == list(req.input_ids) and r.max_new_tokens == req.max_new_tokens:
                self._claimed.add(i)
                return r
        return None

    @property
    def generated_tokens(self) -> int:
        return sum(len(r.response.output_tokens) for r in self.records)


@functools.lru_cache(maxsize=256)
def _takes_resume(agenerate: Any) -> bool:
    return "resume" in inspect.signature(agenerate).parameters


class JournaledEngine:
    """The engine a workflow sees: `agenerate` goes through the journal; everything else is the engine's."""

    def __init__(self, engine: Any, journal: EpisodeJournal):
        self._engine = engine
        self.journal = journal
        fn = getattr(type(engine), "agenerate", None)  # per class, once: a signature costs ~20 us per episode
        self._streams = (_takes_resume(fn) if fn is not None and "agenerate" not in getattr(engine, "__dict__", {})
                         else "resume" in inspect.signature(engine.agenerate).parameters)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        rec = self.journal.claim(req)
        if rec is not None and rec.done:
            return _copy(rec.response)
        if rec is None:
            rec = CallRecord(list(req.input_ids), req.max_new_tokens, ModelResponse(input_tokens=list(req.input_ids)))
            self.journal.records.append(rec)
            self.journal._claimed.add(len(self.journal.records) - 1)
        if self._streams:
            resp = await self._engine.agenerate(req, resume=rec.response)
        else:  # an engine without streaming into a record: only finished calls are kept
            resp = await self._engine.agenerate(req)
        rec.response, rec.done = resp, True
        return _copy(resp)


def _copy(r: ModelResponse) -> ModelResponse:
    return ModelResponse(input_tokens=list(r.input_tokens), output_tokens=list(r.output_tokens),
                         output_logprobs=list(r.output_logprobs), output_versions=list(r.output_versions),
                         stop_reason=r.stop_reason, latency=r.latency, num_interruptions=r.num_interruptions,
                         routed_experts=r.routed_experts)
