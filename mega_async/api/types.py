"""Request/response types shared by the rollout layer and inference clients, the inference engine protocol the
client and the simulator implement, the run's weight version and its read-only view, plus batch helpers."""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Optional, Protocol, Union, runtime_checkable



class FatalEngineError(RuntimeError):
    """An inference error that retrying cannot fix (bad credentials, a request the model can never serve, no
    server left): the rollout executor stops at the first one instead of resubmitting."""


class WeightVersion:
    """The weight version of a run. One owner writes it (the weight sync: it creates the version, restores it from a
    checkpoint and bumps it after each push; or a driver without a sync); everyone else holds its `view()`, so the
    staleness manager, the client and the trainer read the same number and cannot set it."""

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

    def view(self) -> "VersionView":
        return VersionView(self)

    def __repr__(self) -> str:
        return f"WeightVersion({self._value})"


class VersionView:
    """A read-only window on a WeightVersion (no `set`): what every reader of the run's version holds."""

    __slots__ = ("_of",)

    def __init__(self, of: WeightVersion):
        self._of = of

    @property
    def value(self) -> int:
        return self._of.value

    def __repr__(self) -> str:
        return f"VersionView({self._of.value})"


Version = Union[WeightVersion, VersionView]


def writable(version: Optional[Version], who: str) -> WeightVersion:
    """`version` when its holder may write it (a WeightVersion, or a new one when None); a VersionView raises: the
    weight sync owns that version."""
    if version is None:
        return WeightVersion()
    if isinstance(version, VersionView):
        raise RuntimeError(f"{who}: the weight version is owned by the run's weight sync (this holds a read-only "
                           "view); only a driver without a sync sets it")
    return version


@runtime_checkable
class InferenceEngine(Protocol):
    """What the rollout layer and the weight sync call on the inference side: SGLangClient (HTTP to SGLang or the
    embedded server) and SimulatedEngine implement it. Control calls may return an awaitable (the client) or
    nothing (the simulator)."""

    version: Any  # int: the run's weight version, read through a VersionView
    addresses: list  # the servers' addresses (none in process)

    async def agenerate(self, req: "ModelRequest") -> "ModelResponse": ...
    def pause(self) -> None: ...  # hold interrupted requests instead of resubmitting them
    def resume(self) -> None: ...
    def settle(self, timeout: float) -> int: ...  # wait for aborted outputs; returns requests still out
    def pause_generation(self, mode: str = "abort", timeout: Optional[float] = None) -> Optional[Awaitable]: ...
    def continue_generation(self, timeout: Optional[float] = None) -> Optional[Awaitable]: ...
    def wait_idle(self, timeout: float) -> Awaitable: ...
    def abort_in_flight(self, timeout: float) -> Awaitable: ...  # before an abort pause; returns requests still out
    def update_weights_from_disk(self, path: str, version: Any, **kw: Any) -> Optional[Awaitable]: ...
    def sync_targets(self) -> list: ...  # the servers a weight sync sends to (objects with .address, .rejoin)
    def probe_down(self) -> Awaitable: ...
    def find_behind(self, timeout: float = 10.0) -> Awaitable: ...
    def synced(self, version: Any) -> None: ...  # the servers committed this version
    def rollback_weights(self, timeout: Optional[float] = None, addresses: Optional[list] = None) -> Awaitable: ...
    silent: list  # servers that gave no answer (timeout, refused connection) since they last answered
    def learn_releases(self, timeout: Optional[float] = None) -> Awaitable: ...  # which SGLang each server runs


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
