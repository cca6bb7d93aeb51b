"""Weight sync: the trainer's new weights onto the inference servers; the one owner of the weight version.

    push(): [disk: export HF dir] -> pause bracket { [distributed: resharder buckets -> POST + broadcast]
            [disk: servers load the dir] -> version += 1 } -> [verify: probe logprobs equal the trainer's]

Three pauses, one bracket (`pause_bracket`), entered in this order and left in reverse in `finally`,
so no failure leaves anything paused: (1) the executor stops admitting new episodes (running ones go
on); (2) the client holds every interrupted request instead of resubmitting it; (3) the servers pause
in abort mode, which answers in-flight requests with their partial output. After the update the
client resubmits prompt + tokens so far, and the new tokens carry the new version.

Every trainer rank calls `push()` (SPMD). The DP head (global rank 0) owns the bracket and the
rollout side; each pipeline stage head owns one weight-update group with the servers (built as
SGLang builds it) and streams its own stage. Failures are agreed across ranks, servers are rolled
back and continued, the version is left unchanged and `SyncError` is raised on every rank.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import inspect
import logging
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from mega_async.events import NullEventLog
from mega_async.types import WeightVersion

logger = logging.getLogger("mega_async.trainer.sync")


INTERRUPT_MODES = ("abort", "retract", "in_place", "none")  # rollout.interrupt
DATA_PLANES = ("broadcast", "none")  # DistributedWeightSync(data_plane=...): none = the fleet benchmark's seam
NO_DATA_PLANE = object()  # the weight-update "group" of data_plane="none": nothing is joined


class SyncError(RuntimeError):
    """A weight sync failed; the servers keep their old weights and version."""


class _Loop:
    """A private event loop thread for the client's HTTP calls: the trainer gets futures, never asyncio.run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sync-http", daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Any, timeout: Optional[float] = None) -> Any:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self._thread.is_alive():  # what lives on this loop (the client's HTTP session) is closed first
            with contextlib.suppress(Exception):
                self.run(self.loop.shutdown_asyncgens(), 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def one_line(error: Optional[str]) -> Optional[str]:
    return " ".join(error.split()) if error else error


def _agree(error: Optional[str], group: Any = None) -> list[str]:
    """Every rank's error (None = fine, each flattened to one line), gathered on every rank."""
    error = one_line(error)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [error] if error else []
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, error, group=group)
    return [f"rank {r}: {e}" for r, e in enumerate(every) if e]


def from_rank0(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank (over `group`, e.g. the gloo control group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class RolloutSide:
    """What the DP head pauses and resumes: the executor (may be None) and the SGLang client."""

    def __init__(self, client: Any, executor: Any = None):
        self.client = client
        self.executor = executor


class WeightSync:
    """Common part of both modes: the version, the pause bracket, verification. Subclasses `_update`."""

    expects_new_weights = True  # every push sends weights that differ from the last (a training step ran)

    def __init__(self, models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
                 *, timeout: float = 300.0, verify: Optional[Callable[[dict], torch.Tensor]] = None,
                 verify_tol: float = 1e-4, temperature: float = 1.0, group: Any = None, events: Any = None,
                 verify_method: str = "auto", interrupt: str = "abort"):
        self.events = events if events is not None else NullEventLog()  # phases on the run's timeline
        self.models = list(models)
        self.group = group  # for the small agreements between ranks (a gloo group with a long timeout)
        self.version = version
        self.rollout = rollout if _rank() == 0 else None
        self.timeout = timeout
        self._verify_fn = verify
        self.verify_tol = verify_tol
        if verify_method not in ("auto", "probe", "checksum"):
            raise ValueError(f"verify_method={verify_method!r}: use auto, probe or checksum")
        self.verify_method = verify_method
        if interrupt not in INTERRUPT_MODES:
            raise ValueError(f"interrupt={interrupt!r}: use one of {INTERRUPT_MODES}")
        self.interrupt = interrupt
        self.flush_cache = interrupt != "in_place"  # SGLang 0.5.21+ fails an update whose flush finds requests
        self._checksums: dict[str, str] = {}  # each server's /weights_checker checksum at the last verify
        self._targets: list[str] = []  # rank 0: the servers of the current (or last) push
        self.temperature = temperature
        self._loop = _Loop()
        self.last: dict[str, float] = {}

    # ---- the bracket -------------------------------------------------------------------------
    @contextlib.contextmanager
    def pause_bracket(self) -> Iterator[None]:
        """executor stops admitting -> client holds resubmits -> servers pause ... and back, in finally.

        How the servers pause is `rollout.interrupt`: abort (in-flight requests return their partial output and
        are resubmitted after the update), retract (the servers requeue them and prefill them again under the
        new weights), in_place (they keep their KV cache), none (no interruption: the bracket first waits for
        every in-flight request to finish, new ones held, then pauses)."""
        r = self.rollout
        if r is None:
            yield
            return
        self.events.emit("sync_start", phase="pause")
        if r.executor is not None:
            r.executor.pause()
        try:
            _maybe(r.client, "pause")
            try:
                try:
                    if self.interrupt == "none":  # the non-interruptible baseline: generation finishes first
                        self._wait(r.client.wait_idle(self.timeout))
                    mode = "abort" if self.interrupt == "none" else self.interrupt
                    # the HTTP call carries the same timeout, so it cannot land after continue
                    self._wait(r.client.pause_generation(mode=mode, timeout=self.timeout))
                    self.events.emit("sync_end", phase="pause")
                    yield
                finally:  # also when pausing failed half-way: no server stays paused
                    self.events.emit("sync_start", phase="continue")
                    cont = r.client.continue_generation()
                    if inspect.isawaitable(cont):
                        self._loop.run(cont, 2 * self.timeout + 10)
                    self.events.emit("sync_end", phase="continue")
            finally:
                _maybe(r.client, "resume")
        finally:
            if r.executor is not None:
                r.executor.resume()
                r.executor.wake()

    def push(self) -> dict[str, float]:
        """New weights to every server, version += 1 (all trainer ranks call it). Raises SyncError.

        The servers are the client's `sync_targets`: a server that is down is left out (it is brought up to date
        when it answers again). A sync that fails because one of its servers went down meanwhile is done once
        more without it; any other failure is raised."""
        start = self.version.value
        try:
            return self._push_once()
        except SyncError as e:
            if self.version.value != start:  # committed (a verify failed after it): nothing to do again
                raise
            lost = from_rank0(self._lost_servers() if self.rollout is not None else None, self.group)
            if not lost:
                raise
            if self.rollout is not None:
                logger.warning("weight sync failed while server(s) %s went down (%s); syncing again without them",
                               ", ".join(lost), str(e)[:300])
            return self._push_once()

    def _targets_now(self, probe: bool = False) -> list[str]:
        client = self.rollout.client
        if not hasattr(client, "sync_targets"):
            return []
        if probe:  # a server that came back since it was last tried joins this sync
            try:
                self._loop.run(client.probe_down(), self.timeout + 10)
            except Exception as e:  # noqa: BLE001 - it stays out of this sync
                logger.warning("probing the servers that were down failed: %s: %s", type(e).__name__, e)
        return [s.address for s in client.sync_targets()]

    def _lost_servers(self) -> list[str]:
        """Rank 0: servers of the failed push that are down now or lost their state (a restarted process)."""
        client = self.rollout.client
        if not hasattr(client, "find_behind"):
            return []
        try:
            behind = set(self._loop.run(client.find_behind(), self.timeout + 10))
        except Exception as e:  # noqa: BLE001 - the sync's own error is the one raised
            logger.warning("asking the servers for their weight versions failed: %s: %s", type(e).__name__, e)
            behind = set()
        now = {s.address for s in client.sync_targets()}
        return [a for a in self._targets if a not in now or a in behind]

    def _membership(self) -> None:
        """Before a push (every rank): the distributed sync rebuilds its group when the servers changed."""

    def _push_once(self) -> dict[str, float]:
        t0 = time.perf_counter()
        target = self.version.value + 1
        if self.rollout is not None:
            self._targets = self._targets_now(probe=True)
        self._membership()
        with self.events.span("sync", phase="prepare", version=target):
            errors = _agree(self._guarded(self._prepare, target), self.group)  # before the pause (disk: export)
        rolled = None
        with contextlib.ExitStack() as stack:
            if not errors:  # the same on every rank: they agreed
                enter_error = None
                if self.rollout is not None:
                    try:
                        stack.enter_context(self.pause_bracket())
                    except Exception as e:  # noqa: BLE001 - e.g. a dead server: the bracket has undone itself
                        enter_error = f"pausing the servers: {type(e).__name__}: {e}"
                errors = _agree(enter_error, self.group)
            if not errors:
                try:
                    errors = _agree(self._guarded(self._begin, target), self.group)  # sessions (SGLang 0.5.21+)
                    if not errors:
                        with self.events.span("sync", phase="update", version=target):
                            errors = _agree(self._guarded(self._update, target), self.group)
                    if not errors:
                        errors = _agree(self._guarded(self._commit, target), self.group)
                    if not errors:
                        errors = _agree(self._guarded(self._end, target), self.group)
                except BaseException:  # Ctrl-C / SIGTERM mid-sync: drop what the servers got, then continue
                    self._abort()
                    self._rollback()
                    self._end_quietly()
                    raise
                if errors:
                    self._abort()  # a receive still waiting on a broken group fails now instead of at its timeout
                    rolled = self._rollback()  # still inside the bracket: servers drop this sync, then continue
                    self._end_quietly()  # no server is left with a weight-update session open
                elif self.rollout is not None:
                    self.version.set(target)
                    _maybe(self.rollout.client, "synced", target)  # servers are admitted at this version now
        if errors:
            self._after_failure()
            _agree(None, self.group)  # no rank leaves before rank 0 has rolled back and continued the servers
            raise SyncError(f"weight sync to version {target} failed ({'; '.join(errors)}); "
                            + (rolled or f"the servers keep version {self.version.value}"))
        self.version.set(from_rank0(self.version.value, self.group))  # every rank's copy follows rank 0's
        self.last = {**self.last, "sync/push_s": time.perf_counter() - t0}
        if self._verify_fn is not None:
            self.last["sync/verify_max_abs_diff"] = self.verify()
        return dict(self.last)

    @staticmethod
    def _guarded(fn: Callable[[int], Optional[str]], target: int) -> Optional[str]:
        try:
            return fn(target)
        except Exception as e:  # noqa: BLE001 - becomes this rank's error in the agreement
            return f"{type(e).__name__}: {e}"

    def _commit(self, target: int) -> Optional[str]:
        """After every rank succeeded (distributed: the version is set on the servers only now)."""
        return None

    # ---- verification ------------------------------------------------------------------------
    def verify(self, prompt_len: int = 6, new_tokens: int = 8) -> float:
        """Check that every server serves this sync's weights; raises SyncError.

        probe: every server's logprobs for a fixed prompt equal the trainer's own (`verify_tol`); returns the
        largest difference. checksum: every server's `/weights_checker` checksum changed since the last verify
        and servers of one layout agree (real SGLang in bf16, where logprobs differ from the trainer's); returns
        0. auto: probe when every server is an embedded one and the sync sends the trainer's dtype, else checksum."""
        method = self.verify_method
        if method == "auto":
            method = from_rank0(self._auto_method() if self.rollout is not None else None, self.group)
        if method == "checksum":
            verdict = from_rank0(self._verify_checksums() if self.rollout is not None else None, self.group)
            if verdict is not None:
                raise SyncError(f"verify_sync: {verdict}")
            return 0.0
        return self._verify_probe(prompt_len, new_tokens)

    def _verified(self) -> Optional[list[str]]:
        """Rank 0: the servers a verify checks: those of this push that are still up (None: every server)."""
        if not hasattr(self.rollout.client, "sync_targets") or not self._targets:
            return None
        now = set(self._targets_now())
        return [a for a in self._targets if a in now]

    def _auto_method(self) -> str:
        if getattr(self, "fp8_block", None) is not None:
            return "checksum"  # FP8 servers' logprobs differ from the trainer's by the quantization itself
        client = self.rollout.client
        if not hasattr(client, "learn_releases"):
            return "probe"
        try:
            releases = self._loop.run(client.learn_releases(self.timeout), self.timeout + 10)
        except Exception:  # noqa: BLE001 - the probe reports an unreachable server itself
            return "probe"
        return "probe" if all(r.embedded for r in releases) else "checksum"

    def _verify_checksums(self) -> Optional[str]:
        """Rank 0: None when every server's weights changed with this sync and alike servers agree."""
        client = self.rollout.client
        addresses = self._verified()
        if addresses == []:
            return "no server of this sync is up to be verified"
        try:
            replies = self._loop.run(client.weights_checksums(self.timeout, addresses), self.timeout + 10)
            infos = self._loop.run(client.model_info(addresses), self.timeout + 10)
        except Exception as e:  # noqa: BLE001
            return f"/weights_checker failed: {type(e).__name__}: {e}"
        layouts: dict[str, list[tuple[str, str]]] = {}
        for address, reply, info in zip(addresses or client.addresses, replies, infos):
            if str(info.get("weight_version")) != str(self.version.value):
                return (f"server {address} reports weight_version {info.get('weight_version')!r}, "
                        f"expected {self.version.value}")
            checksum = reply.get("per_engine_checksum") if isinstance(reply, dict) else None
            if not isinstance(checksum, str):
                return f"server {address}'s /weights_checker gave no per_engine_checksum: {reply!r}"[:300]
            if self.expects_new_weights and self._checksums.get(address) == checksum:
                return (f"server {address}'s weights did not change with the sync to version {self.version.value} "
                        f"(checksum {checksum[:16]})")
            layouts.setdefault(_layout_key(reply), []).append((address, checksum))
        for same in layouts.values():
            if len({c for _, c in same}) > 1:
                return ("servers of one layout serve different weights at version "
                        f"{self.version.value}: " + ", ".join(f"{a} {c[:16]}" for a, c in same))
        self._checksums = {a: c for same in layouts.values() for a, c in same}
        return None

    def _verify_probe(self, prompt_len: int, new_tokens: int) -> float:
        probes: Any = None
        if self.rollout is not None:
            client = self.rollout.client
            prompt = [1 + (7 * i) % 97 for i in range(prompt_len)]
            payload = {"input_ids": prompt, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": new_tokens, "temperature": self.temperature,
                                           "ignore_eos": True}}

            chosen = set(self._verified() or client.addresses)
            index = [i for i, a in enumerate(client.addresses) if a in chosen]

            async def all_servers() -> list:
                return list(await asyncio.gather(*(client.generate_on(i, payload) for i in index)))

            try:
                outs = self._loop.run(all_servers(), self.timeout)
                probes = [(prompt, o["output_ids"], [x[0] for x in o["meta_info"]["output_token_logprobs"]],
                           o["meta_info"].get("weight_version")) for o in outs]
            except Exception as e:  # noqa: BLE001
                probes = f"probe failed: {type(e).__name__}: {e}"
        probes = from_rank0(probes, self.group)
        if isinstance(probes, str):
            raise SyncError(f"verify_sync: {probes}")
        from megatron.core import parallel_state as mpu

        # pipeline schedules need at least 2 x PP micro-batches: repeat the probes to fill them
        rows = max(len(probes), 4 * mpu.get_pipeline_model_parallel_world_size())
        batch = _probe_batch([probes[i % len(probes)] for i in range(rows)])
        mine = self._verify_fn(batch)  # collective on every rank
        verdict: Any = None
        if _rank() == 0:  # rank 0 decides for all (DP replicas may differ in the last bits on GPU)
            worst, verdict = 0.0, None
            for i, (prompt, out, lps, version) in enumerate(probes):
                if str(version) != str(self.version.value):
                    verdict = f"server {i} reports weight_version {version!r}, expected {self.version.value}"
                    break
                want = mine[i, len(prompt):len(prompt) + len(out)]
                got = torch.tensor([float("-inf") if x is None else float(x) for x in lps])
                worst = max(worst, float((got - want).abs().max()) if len(out) else 0.0)
            if verdict is None and worst > self.verify_tol:
                verdict = (f"server logprobs differ from the trainer's by {worst:.3g} (> {self.verify_tol:g}) "
                           f"at version {self.version.value}")
            verdict = verdict or worst
        verdict = from_rank0(verdict, self.group)
        if isinstance(verdict, str):
            raise SyncError(f"verify_sync: {verdict}")
        return float(verdict)

    def _wait(self, result: Any) -> Any:
        """Wait for a client call: coroutines run on the HTTP thread (the simulator answers at once)."""
        return self._loop.run(result, self.timeout) if inspect.isawaitable(result) else result

    # ---- hooks -------------------------------------------------------------------------------
    def _prepare(self, target: int) -> None:
        """Work done before the pause (disk: write the checkpoint)."""

    def _update(self, target: int) -> Optional[str]:
        """Send the weights inside the bracket; returns this rank's error, or None."""
        raise NotImplementedError

    def _rollback(self) -> Optional[str]:
        """Ask the servers to drop this sync; returns what went wrong (None: every server rolled back)."""
        fn = getattr(self.rollout.client, "rollback_weights", None) if self.rollout is not None else None
        if fn is None:
            return None
        try:  # a server may first finish a receive that is failing: allow it its own timeout too
            replies = self._loop.run(fn(), 2 * self.timeout + 10)
        except Exception as e:  # noqa: BLE001 - the run stops anyway; continue_generation comes next
            logger.warning("rolling back the servers failed: %s: %s", type(e).__name__, e)
            return f"rolling back the servers failed ({type(e).__name__}: {e}): they may serve partial weights"
        bad = [s for s, r in zip(getattr(self.rollout.client, "addresses", []), replies)
               if not (isinstance(r, dict) and r.get("success"))]
        for server in bad:
            logger.warning("server %s could not roll back this sync: it may serve partially updated weights "
                           "until the next successful sync or a reload", server)
        return (f"servers {', '.join(bad)} could not roll back (no /rollback_weights: real SGLang) and may serve "
                "partially updated weights" if bad else None)

    def _begin(self, target: int) -> Optional[str]:
        """Inside the bracket, before any weight moves (distributed: open the servers' weight-update sessions)."""
        return None

    def _end(self, target: int) -> Optional[str]:
        """After the commit (distributed: close the sessions; SGLang finalizes the load there)."""
        return None

    def _end_quietly(self) -> None:
        """On every failure path, after the rollback: close whatever session is still open; never raises."""

    def _abort(self) -> None:
        """Right after a failure, before the rollback (distributed: drop this rank's side of the group)."""

    def _after_failure(self) -> None:
        """Clean-up after a failed sync (distributed: the groups may be broken)."""

    def close(self) -> None:
        self._loop.close()


def _maybe(obj: Any, method: str, *args: Any) -> None:
    fn = getattr(obj, method, None)
    if fn is not None:
        fn(*args)


def aligned_order(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The order in which to flatten a bucket so that every tensor starts at a multiple of its element size
    (largest elements first; stable): SGLang 0.5.23 refuses an unaligned flattened bucket before receiving it,
    older releases fail viewing it after."""
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())


def _layout_key(reply: dict) -> str:
    """What must match for two servers' checksums to be comparable: each rank's placement (tp/pp/dp sizes and
    ranks; SGLang 0.5.21+ lists one entry per role, 0.5.18-0.5.20 gives one)."""
    ranks = reply.get("ranks") or []
    out = []
    for r in ranks:
        pis = r.get("parallelism_info") if isinstance(r, dict) else None
        for pi in pis if isinstance(pis, list) else [pis]:
            if isinstance(pi, dict):
                out.append(tuple(pi.get(k) for k in ("role", "tp_rank", "tp_size", "pp_rank", "pp_size", "dp_size")))
    return repr(sorted(out, key=repr))


def _probe_batch(probes: list) -> dict[str, torch.Tensor]:
    n = len(probes)
    L = max(len(p) + len(o) for p, o, _, _ in probes)
    b = {"input_ids": torch.zeros(n, L, dtype=torch.long), "attention_mask": torch.zeros(n, L, dtype=torch.long),
         "loss_mask": torch.zeros(n, L, dtype=torch.long), "logprobs": torch.zeros(n, L),
         "versions": torch.full((n, L), -1, dtype=torch.long), "advantages": torch.zeros(n)}
    for i, (p, o, _, _) in enumerate(probes):
        ids = list(p) + list(o)
        b["input_ids"][i, :len(ids)] = torch.tensor(ids)
        b["attention_mask"][i, :len(ids)] = 1
        b["loss_mask"][i, len(p):len(ids)] = 1
    return b


class ReloadWeightSync(WeightSync):
    """No trainer: at each version the servers reload one fixed HF directory (the rollout-only driver);
    the latency simulator just takes the new version."""

    expects_new_weights = False

    def __init__(self, version: WeightVersion, rollout: RolloutSide, path: str, **kw: Any):
        super().__init__([], version, rollout, **kw)
        self.path = str(Path(path).resolve())

    def _update(self, target: int) -> Optional[str]:
        client = self.rollout.client if self.rollout is not None else None
        try:
            if hasattr(client, "update_weights_from_disk"):
                self._wait(client.update_weights_from_disk(self.path, target, flush_cache=self.flush_cache))
            elif client is not None:
                client.set_version(target)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return None


class DiskWeightSync(WeightSync):
    """Weights through a shared directory: every version is an HF checkpoint `<root>/v<N>` (each pipeline
    stage head writes its own shards), the servers load it, and only the newest `keep` stay."""

    def __init__(self, models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
                 root: str | Path, src_dir: Optional[str] = None, keep: int = 2, weight_format: str = "model_dtype",
                 **kw: Any):
        super().__init__(models, version, rollout, **kw)
        self.fp8_block = _fp8_block(models, weight_format)
        self.root = Path(root).resolve()
        self.src_dir = src_dir
        self.keep = max(1, keep)
        self.root.mkdir(parents=True, exist_ok=True)
        self._pushing = False
        if self.rollout is not None and hasattr(self.rollout.client, "recover"):
            self.rollout.client.recover = self._recover  # a server back behind loads the current version

    async def _recover(self, address: str) -> None:
        """One server that came back (restarted, or down during a sync) loads the current version's directory.
        While a push runs it waits for it: it is among that push's servers, which load the new version."""
        if self._pushing:
            return
        v = self.version.value
        path = self.path(v)
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: the current version's weights are not on disk (pruned by a newer sync?)")
        await self.rollout.client.update_weights_from_disk(str(path), v, addresses=[address], flush_cache=True)
        logger.info("server %s loaded version %d from %s", address, v, path)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def _prepare(self, target: int) -> None:
        from mega_async.trainer.weights import save_hf_checkpoint

        t0 = time.perf_counter()
        save_hf_checkpoint(self.models, self.path(target), src_dir=self.src_dir, fp8_block=self.fp8_block)
        self.last = {"export_s": time.perf_counter() - t0}

    def _update(self, target: int) -> Optional[str]:
        if self.rollout is None:
            return None
        t0 = time.perf_counter()
        try:
            self._loop.run(self.rollout.client.update_weights_from_disk(str(self.path(target)), target,
                                                                        flush_cache=self.flush_cache), self.timeout)
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        self.last["load_s"] = time.perf_counter() - t0
        return None

    def push(self) -> dict[str, float]:
        self._pushing = True
        try:
            out = super().push()
        finally:
            self._pushing = False
        if _rank() == 0:
            self._prune()
        return out

    def _rollback(self) -> Optional[str]:
        """Every server reloads the current version's directory (the model itself at version 0): this works on
        real SGLang too, where a server that loaded the new version has no other way back."""
        if self.rollout is None:
            return None
        v = self.version.value
        path = self.path(v) if self.path(v).is_dir() else (Path(self.src_dir) if self.src_dir else None)
        if path is None:
            return super()._rollback()
        client = self.rollout.client
        targets = self._targets or client.addresses
        try:
            replies = self._loop.run(client.update_weights_from_disk(str(path.resolve()), v, check=False,
                                                                     flush_cache=self.flush_cache, addresses=targets),
                                     2 * self.timeout + 10)
        except Exception as e:  # noqa: BLE001
            replies = [f"{type(e).__name__}: {e}"] * len(targets)
        bad = [a for a, r in zip(targets, replies) if not (isinstance(r, dict) and r.get("success"))]
        if bad:
            logger.warning("servers %s could not reload version %d from %s", bad, v, path)
            return f"servers {', '.join(bad)} could not reload version {v} from {path} (a server whose own load failed " \
                   "kept its weights)"
        return None

    def _prune(self) -> None:
        v = self.version.value
        for d in self.root.glob("v*"):
            if d.is_dir() and d.name[1:].isdigit() and int(d.name[1:]) <= v - self.keep:
                shutil.rmtree(d, ignore_errors=True)
        for d in self.root.glob("v*.partial"):
            shutil.rmtree(d, ignore_errors=True)


def _fp8_block(models: Sequence[torch.nn.Module], weight_format: str) -> Optional[tuple[int, int]]:
    """trainer.sync_weight_format: None (the trainer's dtype) or the FP8 block of the servers' checkpoint."""
    from mega_async.bridge import bridge_for, fp8

    if weight_format == "model_dtype":
        return None
    return fp8.sync_block(weight_format, bridge_for(models).hf_config if models else None)


def _fp8_bucket(bucket: Any, block: tuple[int, int], resharder: Any) -> Any:
    """The bucket as an FP8 block checkpoint holds it (each weight with its weight_scale_inv, in one bucket)."""
    from mega_async.bridge import fp8
    from mega_async.trainer.weights import Bucket

    out = Bucket()
    skip = fp8.skipped_modules(resharder.bridge.hf_config)
    for name, t in fp8.quantize_named(zip(bucket.names, bucket.tensors), block, skip):
        out.add(name, t)
    return out


def _reachable_address(server_addresses: Sequence[str]) -> str:
    """The local address the servers can reach this host at (the route to the first server)."""
    host = urlparse(server_addresses[0] if "://" in server_addresses[0] else f"http://{server_addresses[0]}").hostname
    if host in (None, "localhost") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # connect() on UDP sends nothing
        s.connect((host, 9))
        return s.getsockname()[0]


class DistributedWeightSync(WeightSync):
    """Weights by torch.distributed broadcast: each pipeline stage head owns a weight-update group with
    every server rank (trainer = rank 0, server i at 1 + its GPUs before it), built as SGLang builds it;
    per bucket it POSTs /update_weights_from_distributed from the HTTP thread, broadcasts, and checks
    every reply."""

    def __init__(self, models: Sequence[torch.nn.Module], version: WeightVersion, rollout: Optional[RolloutSide],
                 addresses: Sequence[str], *, api_key: Optional[str] = None, bucket_bytes: int = 512 << 20,
                 load_format: str = "flattened_bucket", backend: Optional[str] = None, gpus_per_server: int = 1,
                 master_address: Optional[str] = None, weight_format: str = "model_dtype",
                 data_plane: str = "broadcast", **kw: Any):
        from mega_async.trainer.weights import Resharder

        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane={data_plane!r}: use broadcast (none: the simulated fleet's control-plane "
                             "benchmark, never a run)")
        self.data_plane = data_plane  # a constructor seam for tools/bench_scale.py and tests; no config key sets it
        super().__init__(models, version, rollout, **kw)
        self.fp8_block = _fp8_block(models, weight_format)
        if load_format not in ("flattened_bucket", "tensor"):
            raise ValueError(f"load_format={load_format!r}: use flattened_bucket or tensor")
        self.resharder = Resharder(models, bucket_bytes=bucket_bytes)
        self.load_format = load_format
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.gpus_per_server = gpus_per_server
        self.group_name = f"mega_async_pp{self.resharder.pp_rank}"
        self.client: Any = None
        self.pg: Any = None
        self._init_error: Optional[str] = None
        self._abandoned: list = []  # broadcasts given up on (a server refused): kept alive, never waited for
        if self.resharder.is_stage_head:
            try:
                from mega_async.inference.client import SGLangClient

                if not addresses:
                    raise ValueError("no server addresses: the distributed sync needs inference servers")
                self.client = self.rollout.client if self.rollout is not None else SGLangClient(
                    list(addresses), api_key=api_key, request_timeout=self.timeout)
                if self.rollout is not None:  # each server's protocol, once (sessions since SGLang 0.5.21)
                    releases = self._loop.run(self.client.learn_releases(self.timeout), self.timeout + 10)
                    logger.info("servers' SGLang releases: %s", ", ".join(
                        f"{a} {r.version or '?'}{' (sessions)' if r.sessions else ''}"
                        for a, r in zip(self.client.addresses, releases)))
                self._master_address = master_address or _reachable_address(addresses)
                self._init_group(self._master_address)
            except Exception as e:  # noqa: BLE001 - agreed below, so no rank is left waiting
                self._init_error = f"{type(e).__name__}: {e}"
        # pipeline stages stream one after another: concurrent groups through the same servers could
        # interleave their broadcasts differently on different servers and deadlock (NCCL rings)
        heads = [(self.resharder.pp_rank, _rank())] if self.resharder.is_stage_head else []
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, heads, group=self.group)
            heads = [h for x in every for h in x]
        self._stage_heads = dict(heads)
        errors = _agree(self._init_error, self.group)
        if errors:
            self.close()
            raise SyncError("could not build the weight-update groups: " + "; ".join(errors))

    def _membership(self) -> None:
        """Every rank, before a push: rank 0 decides whether the weight-update groups must be built again (a
        member is down, a server came back with a new process or behind, or a failed sync dropped the group),
        and every stage head rebuilds its group over the servers to sync now."""
        want = None
        if self.rollout is not None:
            targets = self.client.sync_targets()
            addrs = [s.address for s in targets]
            if self.pg is None or addrs != self.client.group_members or any(s.rejoin for s in targets):
                want = addrs
        want = from_rank0(want, self.group)
        if want is None:
            return
        if not want:
            raise SyncError("no inference server is up to take the weights; check the servers' logs")
        if self.rollout is not None:
            logger.warning("weight-update groups built again over %d server(s) (members: %s)", len(want),
                           ", ".join(want))
        self._init_error = None
        if self.resharder.is_stage_head:
            try:
                self._destroy_group()
                self._init_group(self._master_address, want)
            except Exception as e:  # noqa: BLE001 - agreed below
                self._init_error = f"{type(e).__name__}: {e}"
        errors = _agree(self._init_error, self.group)
        if errors:
            raise SyncError("could not build the weight-update groups again: " + "; ".join(errors))

    def _init_group(self, address: str, addresses: Optional[list[str]] = None) -> None:
        from mega_async.comm import free_port, init_custom_process_group

        port = free_port()
        self.group_name = f"mega_async_pp{self.resharder.pp_rank}_{port}"  # unique per run and stage
        if addresses is None:
            addresses = [s.address for s in self.client.sync_targets()]
        if self.data_plane == "none":
            return self._init_control_plane_only(address, port, addresses)
        fut = self._loop.submit(self.client.init_weights_update_group(
            address, port, self.group_name, backend=self.backend, gpus_per_server=self.gpus_per_server,
            timeout=self.timeout, addresses=addresses))
        world = 1 + self.gpus_per_server * len(addresses)
        try:
            self.pg = init_custom_process_group(self.backend, f"tcp://{address}:{port}", world, 0, self.group_name,
                                                timeout=datetime.timedelta(seconds=self.timeout))
            fut.result(self.timeout)
            logger.info("weight-update group %s: trainer + %d server ranks at %s:%d (%s)", self.group_name,
                        world - 1, address, port, self.backend)
        except Exception as e:  # noqa: BLE001
            self._init_error = f"{self.group_name}: {type(e).__name__}: {e}"
            fut.cancel()
            self._abort()  # no half-built group: the next push builds one again

    def _init_control_plane_only(self, address: str, port: int, addresses: Optional[list[str]] = None) -> None:
        """data_plane="none": the servers are told of a group nobody joins and no tensor moves. Only simulated fleet
        servers that say so in /server_info take part (a real server would wait for a broadcast)."""
        if not getattr(self, "_fleet_checked", False):  # once: the servers are the same processes' kind after
            infos = self._loop.run(self.client.server_info(self.timeout), self.timeout + 10)
            real = [a for a, i in zip(self.client.addresses, infos)
                    if (i.get("fleet") or {}).get("data_plane") != "none"]
            if real:
                raise ValueError(f"data_plane='none' needs simulated fleet servers without a data plane; {real[0]} "
                                 "has one: use the default data_plane='broadcast'")
            self._fleet_checked = True
        self._loop.run(self.client.init_weights_update_group(address, port, self.group_name, backend=self.backend,
                                                             gpus_per_server=self.gpus_per_server,
                                                             timeout=self.timeout, addresses=addresses),
                       self.timeout + 10)
        self.pg = NO_DATA_PLANE

    def _update(self, target: int) -> Optional[str]:
        """Stream this stage's buckets; bucket k is broadcast and loaded while bucket k+1 is gathered (at most
        two buckets in flight, the next POST only after the previous reply, so servers see them in order)."""
        error: Optional[str] = None
        stats = {"bytes": 0, "buckets": 0, "broadcast_s": 0.0, "server_s": 0.0, "bucket_s": 0.0}
        t_all = time.perf_counter()
        rs = self.resharder
        turn = rs.is_stage_head and rs.pp_size > 1
        if turn and rs.pp_rank > 0:  # wait for the previous stage; it says whether it failed
            token = torch.zeros(1, dtype=torch.int64)
            dist.recv(token, src=self._stage_heads[rs.pp_rank - 1], group=self.group)
            if token.item():
                error = f"stage {rs.pp_rank - 1} failed first; stage {rs.pp_rank} sent nothing"
        if error is None and rs.is_stage_head and self.pg is None:  # dropped by an earlier failed sync
            error = (f"stage {rs.pp_rank} has no weight-update group (building it failed); check the servers' "
                     "logs")
        try:
            error = self._stream(target, stats, error)
        finally:
            if turn and rs.pp_rank < rs.pp_size - 1:
                token = torch.tensor([1 if error else 0], dtype=torch.int64)
                dist.send(token, dst=self._stage_heads[rs.pp_rank + 1], group=self.group)
        stats["gather_s"] = rs.stats.get("gather_s", 0.0)
        stats["total_s"] = time.perf_counter() - t_all
        self.last = {f"sync/{k}": float(v) for k, v in stats.items()}
        return error

    def _stream(self, target: int, stats: dict, error: Optional[str]) -> Optional[str]:
        pending = None
        for bucket in self.resharder.buckets():  # every rank of the stage drains it (collectives)
            if error is not None or self.pg is None:
                continue  # keep draining so the stage's other ranks are not left in a gather
            try:
                if pending is not None:
                    self._finish(pending, stats)
                    pending = None
                pending = self._start(bucket if self.fp8_block is None else _fp8_bucket(bucket, self.fp8_block,
                                                                                         self.resharder), target, stats)
            except Exception as e:  # noqa: BLE001
                error, pending = f"{type(e).__name__}: {e}", None
        if pending is not None and error is None:
            try:
                self._finish(pending, stats)
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
        return error

    def _commit(self, target: int) -> Optional[str]:
        """Every stage streamed: an empty update sets the new version on the servers (SGLang sets
        weight_version only on success), so a failed sync never leaves a server claiming the new one. It also
        flushes the cache, once per sync (the buckets do not: the servers are paused in between)."""
        if self.rollout is not None and self.pg is not None:
            self._loop.run(self.client.update_weights_from_distributed([], [], [], self.group_name, version=target,
                                                                       flush_cache=self.flush_cache,
                                                                       timeout=self.timeout), self.timeout + 10)
        return None

    def _begin(self, target: int) -> Optional[str]:
        """Rank 0 opens a weight-update session on every server whose release needs one (SGLang 0.5.21+:
        distributed updates outside one are refused), before any stage streams its first bucket."""
        if self.rollout is not None and self.pg is not None:
            self._loop.run(self.client.begin_weight_update(timeout=self.timeout), self.timeout + 10)
        return None

    def _end(self, target: int) -> Optional[str]:
        if self.rollout is not None and self.client is not None:
            self._loop.run(self.client.end_weight_update(timeout=self.timeout), self.timeout + 10)
        return None

    def _end_quietly(self) -> None:
        if self.rollout is None or self.client is None:
            return
        try:
            self._loop.run(self.client.end_weight_update(check=False, timeout=self.timeout), self.timeout + 10)
        except Exception as e:  # noqa: BLE001 - the sync has failed already; this must not hide why
            logger.warning("closing the servers' weight-update sessions failed: %s: %s", type(e).__name__, e)
        if self.client.sessions_open:
            logger.warning("servers %s may still have a weight-update session open (unreachable); the next "
                           "sync closes and reopens it", ", ".join(self.client.sessions_open))

    def _start(self, bucket: Any, target: int, stats: dict) -> tuple:
        """POST the bucket (HTTP thread), then start its broadcast(s) without waiting."""
        t0 = time.perf_counter()
        dev = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        order = list(range(len(bucket.names)))
        if self.load_format == "flattened_bucket":
            order = aligned_order(bucket.tensors)
        if self.pg is NO_DATA_PLANE:
            payload = []  # data_plane="none": only the control messages
        elif self.load_format == "flattened_bucket":
            payload = [torch.cat([bucket.tensors[i].reshape(-1).view(torch.uint8) for i in order]).to(dev)]
        else:
            payload = [t.to(dev) for t in bucket.tensors]
        fmt = "flattened_bucket" if self.load_format == "flattened_bucket" else None
        fut = self._loop.submit(self.client.update_weights_from_distributed(  # the version comes in _commit
            [bucket.names[i] for i in order], [bucket.dtypes[i] for i in order], [bucket.shapes[i] for i in order],
            self.group_name, load_format=fmt, timeout=self.timeout, flush_cache=False))  # the commit flushes once
        works = [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in payload]
        stats["bucket_s"] += time.perf_counter() - t0
        stats["bytes"] += bucket.nbytes
        stats["buckets"] += 1
        return works, fut, payload

    def _finish(self, pending: tuple, stats: dict) -> None:
        """Wait for a bucket's broadcasts while watching the servers' replies, then for every reply.

        A server that refuses the bucket (400) answers without joining the broadcast, which then cannot
        complete: its refusal ends the wait at once (the broadcast is abandoned, the group dropped by the
        failure path), instead of after `trainer.sync_timeout`."""
        works, fut, payload = pending  # the payload must live until the broadcast is done
        t0 = time.perf_counter()
        deadline, nap = t0 + self.timeout, 2e-4
        while not all(w.is_completed() for w in works):
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                self._abandoned.append((works, payload, self.pg))  # gloo may still be sending from these
                raise SyncError(f"{fut.exception()} (the bucket's broadcast was abandoned)")
            if time.perf_counter() > deadline:
                fut.cancel()
                self._abandoned.append((works, payload, self.pg))
                raise SyncError(f"a bucket's broadcast did not complete within trainer.sync_timeout={self.timeout:g}s")
            concurrent.futures.wait([fut], timeout=nap)  # wakes at once when a reply arrives
            nap = min(2 * nap, 5e-3)
        try:
            for w in works:
                w.wait()
        except Exception as e:
            try:  # a server's own answer (refused, 400) says more than the broken broadcast
                fut.result(1.0)
            except concurrent.futures.TimeoutError:
                fut.cancel()
            except Exception as http:  # noqa: BLE001
                raise SyncError(f"{http} (broadcast: {type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
            raise
        t1 = time.perf_counter()
        fut.result(self.timeout)
        stats["broadcast_s"] += t1 - t0
        stats["server_s"] += time.perf_counter() - t1

    def _abort(self) -> None:
        if self.pg is not None:  # closing our end makes the servers' pending receives fail at once
            from mega_async.comm import destroy_custom_process_group

            with contextlib.suppress(Exception):
                if self.pg is not NO_DATA_PLANE:
                    destroy_custom_process_group(self.pg)
            self.pg = None
            self._group_on_servers = True

    def _after_failure(self) -> None:
        self._destroy_group()

    def _destroy_group(self) -> None:
        had = self.pg is not None or getattr(self, "_group_on_servers", False)
        self._abort()
        if had and self.client is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self.client.destroy_weights_update_group(self.group_name), 2 * self.timeout + 10)
            self._group_on_servers = False

    def close(self) -> None:
        self._destroy_group()
        super().close()
