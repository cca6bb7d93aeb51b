"""SGLangClient: the rollout layer's view of one or more SGLang-protocol servers (real or embedded), in four parts:
`transport` (HTTP, one call with its bounds), `pool` (which servers serve, the choice, `_call`'s failure rule),
`generate` (the interruption loop and the retry rule) and `weights` (the sync's control calls).


agenerate: send /generate -> append tokens, logprobs, versions -> on abort with budget left,
wait while paused, resubmit prompt + tokens so far (AReaL's interruption loop).
Servers are picked by fewest in-flight requests, sticky per request id. Connection errors are retried
with backoff: the server is marked unhealthy, its requests rerouted, and it is re-admitted once /health
answers again and it serves the weights this client last synced (a restarted process has its launch weights,
one that was down missed a sync: it stays out, `recover` brings it up to date, and the weight syncs include
it). A server that answers 5xx more than `max_retries` times in a row (in time: requests sent together count once)
is taken out; while its /model_info answers it is a wedged engine, back once a one-token /generate answers; a busy one (429, or 503: SGLang's full queue, a server's bound on bodies in memory) is
not a failing one: the request waits its Retry-After (else a growing backoff), goes to the least loaded server
again, and fails in one line only after `request_timeout` seconds of busy answers (a router: gone around after
`router_busy` seconds, naming it); one whose /model_info fails too
is down as a whole and taken out until it answers (never dropped for good). 401/403, a request over the context
length, and no usable server within `unhealthy_timeout` raise `FatalEngineError`: retrying cannot fix them.
"""
from __future__ import annotations
from __future__ import annotations

from typing import Any, Optional, Sequence

from mega_async.api.types import Version
from mega_async.inference.client.generate import (ROUTER_BUSY_S, Generation, Step, merge_routed_experts, outcome,
                                                  retry_step, token_versions)
from mega_async.inference.client.transport import (FatalServerError, NoHealthyServerError, ServerError,
                                                   ServerHung, ServerTimeout, classify_status, connection_budget)
from mega_async.inference.client.weights import REABORT_S, WeightControl, join_grace
from mega_async.utils.events import NullEventLog

__all__ = ["SGLangClient", "ServerError", "FatalServerError", "NoHealthyServerError", "ServerTimeout",
           "ServerHung", "classify_status", "connection_budget", "join_grace", "merge_routed_experts",
           "token_versions", "retry_step", "outcome", "Step", "REABORT_S"]


class SGLangClient(Generation, WeightControl):
    """One client over `addresses` (host:port or URLs); `router`: a router in front of them for generation."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        api_key: Optional[str] = None,
        request_timeout: float = 300.0,
        max_retries: int = 3,
        retry_backoff: float = 0.2,
        health_check_interval: float = 1.0,
        unhealthy_timeout: float = 30.0,
        max_resubmits: int = 1000,
        version: Optional[Version] = None,
        events: Any = None,
        max_connections: Optional[int] = None,
        router: Optional[str] = None,
        router_busy: float = ROUTER_BUSY_S,
    ):
        if not addresses:
            raise ValueError("SGLangClient needs at least one server address (host:port)")
        # /generate requests on the wire per event loop (the rest wait in the client): the open-file budget
        budget = connection_budget(len(addresses))
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._init_transport(api_key, request_timeout, min(budget, max_connections) if max_connections else budget)
        self._init_pool(addresses, router, events if events is not None else NullEventLog(), max_retries=max_retries,
                        retry_backoff=retry_backoff, health_check_interval=health_check_interval,
                        unhealthy_timeout=unhealthy_timeout)
        self._init_generation(version, max_resubmits, router_busy)
        self._init_weights()
