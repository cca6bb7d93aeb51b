"""Request/response types shared by the rollout layer and inference clients, plus batch helpers."""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


class FatalEngineError(RuntimeError):
    """An inference error that retrying cannot fix (bad credentials, a request the model can never serve, no
    server left): the rollout executor stops at the first one instead of resubmitting."""


class WeightVersion:
    """The weight version of a run. One owner bumps it (the weight sync, or a standalone driver); the
    staleness manager, the client and the trainer read the same object, so they can never disagree."""

    def __init__(self, value: int = 0):
        self._value = int(value)
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        return self._value

    def set(self, v: int) -> None:
        with self._lock:
            if v < self._value:
                raise ValueError(f"version may only grow: {self._value} -> {v}")
            self._value = int(v)

    def __repr__(self) -> str:
        return f"WeightVersion({self._value})"


@dataclass
class ModelRequest:
    """One generation request in token space (the SGLang `/generate` fields an RL loop needs)."""

    input_ids: list[int]
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_routed_experts: bool = False  # MoE: every forward's top-k experts (SGLang return_routed_experts)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelResponse:
    """Generated tokens with the behaviour logprob and the model version of every output token."""

    input_tokens: list[int]
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: str = "length"  # stop | length | abort
    latency: float = 0.0
    num_interruptions: int = 0
    # [len(input_tokens) + len(output_tokens) - 1, layers * top_k] int32: row t = the experts of the forward at
    # position t (the one that sampled token t+1), from the weights that generated it (kept across interruptions)
    routed_experts: Any = None

    @property
    def head_version(self) -> int:
        return self.output_versions[0] if self.output_versions else -1


@dataclass
class WeightUpdateMeta:
    """How new weights reach the servers: from a directory on disk or by torch.distributed broadcast."""

    type: str = "disk"  # disk | distributed
    path: str | None = None
    group_name: str = "mega_async_weights"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    bucket_bytes: int = 512 << 20


PAD_VALUES = {"input_ids": 0, "loss_mask": 0, "logprobs": 0.0, "versions": -1, "attention_mask": 0,
              "routed_experts": -1}


def concat_padded(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate [n_i, L_i] trajectory dicts along dim 0, right-padding dim 1 to the longest.

    Per-sequence keys (1-D, e.g. `rewards`) are concatenated as they are.
    """
    if not items:
        raise ValueError("concat_padded needs at least one trajectory dict")
    keys = items[0].keys()
    for it in items[1:]:
        if it.keys() != keys:
            raise ValueError(f"trajectory keys differ: {sorted(keys)} vs {sorted(it.keys())}")
    max_len = max(t.shape[1] for it in items for t in it.values() if t.dim() >= 2)
    out = {}
    for k in keys:
        ts = [it[k] for it in items]
        if ts[0].dim() >= 2:
            pad = PAD_VALUES.get(k, 0)
            # dim 1 is the sequence; trailing dims (routed_experts' experts) are not padded
            ts = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, max_len - t.shape[1]), value=pad) for t in ts]
        out[k] = torch.cat(ts, dim=0)
    return out
