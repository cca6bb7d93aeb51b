"""Weight updates of the embedded server: from disk, and by broadcast over an SGLang-built process group.

A bucket is validated before any collective: a malformed layout is refused without joining one; a
well-formed layout that does not fit the model is still received (into scratch, so the trainer's
broadcast completes) and then refused. Outside a pause every update is all-or-nothing by itself.
Between /pause_generation and /continue_generation the first write to each weight keeps a CPU copy
of its old value; if any update of that window fails, every weight and the weight version go back to
where they were at the pause, and later updates of the window are refused until /continue_generation.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import torch

from mega_async.server.dist_group import WeightGroup
from mega_async.api.sglang_releases import (BEGIN_TWICE, END_WITHOUT_BEGIN, SELECTORS, Release,
                                                  session_refusal)
from mega_async.server.engine import GenerationEngine
from mega_async.server.protocol import (BadRequest, DistributedUpdate, Refused, byte_ranges,
                                                  parse_group_name, parse_init_group, parse_update_distributed,
                                                  result_body, unflatten, validate_request)
from mega_async.server.weights import (WeightBackup, WeightLoadError, check_layout, load_named_tensors,
                                          read_safetensors_dir, updates_dequantized)

logger = logging.getLogger("mega_async.server.updates")

Reply = tuple[int, dict]


async def in_thread(fn: Callable[[], Any], undo: Optional[Callable[[Any], None]] = None) -> Any:
    """Run a blocking call (rendezvous, broadcast) in a daemon thread, so a stuck peer never blocks shutdown.

    A handler cancelled meanwhile (its client gave up) still waits for the call to end before it unwinds, so the
    lock held around a broadcast is released only once that collective is over (the next bucket never shares the
    group with it, nor is the group destroyed under it); `undo` disposes of the result nobody takes then (a
    group joined for a client that is gone). The wait is bounded by the group's timeout.
    """
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            res, exc = fn(), None
        except BaseException as e:  # noqa: BLE001 - delivered to the awaiting handler
            res, exc = None, e
        loop.call_soon_threadsafe(lambda: fut.done() or (fut.set_exception(exc) if exc else fut.set_result(res)))

    threading.Thread(target=run, name="weight-sync", daemon=True).start()
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        if undo is not None and fut.exception() is None:
            threading.Thread(target=undo, args=(fut.result(),), name="weight-sync-undo", daemon=True).start()
        raise


def receive(group: WeightGroup, upd: DistributedUpdate, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """SGLang's receiver: one broadcast(src=0) per tensor in list order, or one uint8 buffer per flattened bucket."""
    if upd.flattened:
        flat = torch.empty(upd.nbytes, dtype=torch.uint8, device=device)
        try:
            group.broadcast(flat, src=0)
        except Exception as e:
            raise RuntimeError(f"for the flattened bucket of {upd.nbytes} bytes: {type(e).__name__}: {e}") from e
        return unflatten(flat, upd.specs)
    out = []
    for i, s in enumerate(upd.specs):
        t = torch.empty(s.shape, dtype=s.dtype, device=device)
        try:
            group.broadcast(t, src=0)
        except Exception as e:
            raise RuntimeError(f"at tensor {i + 1} of {len(upd.specs)} ({s.name}): {type(e).__name__}: {e}") from e
        out.append((s.name, t))
    return out


def unaligned(upd: DistributedUpdate) -> Optional[str]:
    """SGLang 0.5.23's refusal of a flattened bucket whose tensor starts off its dtype's alignment."""
    for s, (start, _end) in zip(upd.specs, byte_ranges(upd.specs)):
        if start % s.dtype.itemsize:
            return (f"Failed to receive weights: Unaligned received tensor {s.name}: byte offset {start}, "
                    f"dtype {s.dtype}")
    return None


class PauseWindow:
    """What a pause window needs to undo itself: the version at the pause and copy-on-write backups."""

    def __init__(self, version: str) -> None:
        self.version_before = version
        self.backup = WeightBackup()
        self.failed: Optional[str] = None


class WeightUpdates:
    """The weight endpoints' logic; each handler takes the JSON body and returns (status, reply body)."""

    def __init__(self, engine: GenerationEngine, exclusive: Callable[[dict, Callable[[], Any]], Awaitable[Any]],
                 weights_root: Path, default_timeout_s: float = 300.0, release: Optional[Release] = None) -> None:
        self.engine = engine
        self.release = release or Release.of("0.5.23")  # the SGLang release whose protocol this server speaks
        self.session: Optional[str] = None  # the open weight-update session's selector (SGLang 0.5.21+)
        self._exclusive = exclusive  # runs fn on the engine thread (writer lock unless paused)
        self.weights_root = weights_root
        self.default_timeout_s = default_timeout_s
        self.cuda = engine.device.type == "cuda"
        self.max_bucket_bytes = 8 * sum(t.numel() for t in engine.model.state_dict().values()) + (1 << 20)
        self.groups: dict[str, WeightGroup] = {}
        self._joining: set[str] = set()
        self._window: Optional[PauseWindow] = None
        self._lock = asyncio.Lock()  # one bucket at a time: receive and apply in arrival order
        self.loaded_path: Optional[str] = None  # the directory of the last disk update (/model_info's model_path)

    # ---- pause window --------------------------------------------------------------------------
    def open_window(self) -> None:
        if self._window is None:
            self._window = PauseWindow(self.engine.weight_version)

    def close_window(self) -> None:
        self._window = None  # backups dropped

    async def _failed(self, window: Optional[PauseWindow], what: str, why: str,
                      outside: str = "The weights are unchanged.") -> Reply:
        """400 for a failed update; inside a pause window, roll the whole window back first."""
        if window is None:
            return 400, result_body(False, f"{what}: {why}. {outside}")
        window.failed = window.failed or why
        n = await asyncio.wrap_future(self.engine.run_command(lambda: self._restore(window)))
        logger.warning("%s (%s): rolled back %d tensors to weight version %s", what, why, n, window.version_before)
        return 400, result_body(False, f"{what}: {why}. Rolled back every weight updated since /pause_generation "
                                       f"({n} tensors) and the weight version to {window.version_before!r}.")

    async def rollback(self, body: dict) -> Reply:
        """POST /rollback_weights (a mega_async extension, not SGLang): undo every update since the pause.

        The trainer's sync calls it when a push failed anywhere (another server, the trainer itself), so every
        server is back at its pause-time weights. The window then starts afresh: later updates are accepted.
        """
        async with self._lock:
            window = self._window
            if window is None:
                return 400, result_body(False, "Nothing to roll back: generation is not paused "
                                               "(/rollback_weights undoes the weight updates since /pause_generation).")
            n = await asyncio.wrap_future(self.engine.run_command(lambda: self._restore(window)))
            self._window = PauseWindow(window.version_before)
        logger.info("rolled back %d tensors to weight version %s on request", n, window.version_before)
        return 200, result_body(True, f"Rolled back {n} tensors to weight version {window.version_before}.")

    def _restore(self, window: PauseWindow) -> int:
        """Engine thread: weights and version back to the pause, prefix cache dropped."""
        n = window.backup.restore()
        self.engine.weight_version = window.version_before
        self.engine.prefix_cache.clear()
        return n

    def _poisoned(self, window: Optional[PauseWindow]) -> Optional[str]:
        if window is None or window.failed is None:
            return None
        return (f"an earlier weight update since /pause_generation failed ({window.failed}) and was rolled back; "
                "call /continue_generation and send the weights again")

    def _version_note(self, body: dict) -> str:
        v = body.get("weight_version")
        return "" if v is None else f" Weight version updated to {v}."

    async def _load(self, body: dict, named: list, strict: bool, window: Optional[PauseWindow]) -> int:
        """Load on the engine thread; the new version is set in the same step, so no token is mislabelled."""
        backup = window.backup if window is not None else None
        v = body.get("weight_version")

        def run() -> int:
            if "weights" in self.engine.released:
                raise WeightLoadError("the weights are released (/release_memory_occupation): call "
                                      "/resume_memory_occupation with tags [\"weights\"] first")
            n = load_named_tensors(self.engine.model, named, strict, backup)
            self.engine.prefix_cache.clear()  # KV computed by the old weights
            if v is not None:
                self.engine.weight_version = str(v)
            return n

        return await self._exclusive(body, run)

    async def set_version(self, body: dict) -> Reply:
        """POST /update_weight_version {"new_version", "abort_all_requests" (default true)}, as SGLang."""
        v = body.get("new_version")
        if not isinstance(v, (str, int)) or isinstance(v, bool) or v == "":
            raise BadRequest(f"new_version must be a non-empty string, got {v!r}")
        if body.get("abort_all_requests", True):
            await asyncio.wrap_future(self.engine.abort(abort_all=True))

        def run() -> None:
            self.engine.weight_version = str(v)

        await asyncio.wrap_future(self.engine.run_command(run))
        return 200, {"success": True, "message": f"Weight version updated to {v}", "new_version": str(v)}

    async def from_tensor(self, body: dict) -> Reply:
        """POST /update_weights_from_tensor: SGLang's colocated path sends pickled CUDA IPC handles."""
        problem = self._session_problem("update_weights_from_tensor")
        if problem is not None:
            return 400, result_body(False, problem)
        return 400, result_body(False, "update_weights_from_tensor is not supported by the embedded server: it "
                                       "carries pickled CUDA IPC handles; use /update_weights_from_distributed or "
                                       "/update_weights_from_disk")

    # ---- weight-update sessions (SGLang 0.5.21+) -------------------------------------------------
    def _session_problem(self, op: str) -> Optional[str]:
        """SGLang 0.5.21+ refuses distributed and tensor updates outside a session, before any collective."""
        if self.release.sessions and self.session is None:
            return session_refusal(op)
        return None

    async def begin_session(self, body: dict) -> Reply:
        """POST /begin_weight_update {"selector": "target"|"draft"|"all"} (default all), as SGLang 0.5.23."""
        selector = body.get("selector", "all")
        if selector not in SELECTORS:
            raise BadRequest(f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}")
        async with self._lock:
            if self.session is not None:
                return 400, result_body(False, BEGIN_TWICE)
            await self._exclusive({}, lambda: None)  # as SGLang: outside a pause, after the running requests
            self.session = selector
        logger.info("weight-update session opened (selector %s)", selector)
        return 200, result_body(True, "Success")

    async def end_session(self, body: dict) -> Reply:
        """POST /end_weight_update {}: closes the session begin opened (nothing to finalize on this server)."""
        async with self._lock:
            if self.session is None:
                return 400, result_body(False, END_WITHOUT_BEGIN)
            await self._exclusive({}, lambda: None)
            self.session = None
        logger.info("weight-update session closed")
        return 200, result_body(True, "Success")

    # ---- /update_weights_from_disk -------------------------------------------------------------
    def _allowed_dir(self, path: Any) -> Path:
        if not isinstance(path, str) or not path:
            raise WeightLoadError("model_path must be a non-empty string")
        p = Path(path).resolve()
        if not p.is_relative_to(self.weights_root):
            raise WeightLoadError(f"model_path {path} is outside the allowed weights root {self.weights_root} "
                                  "(start the server with --weights-root)")
        if not p.is_dir():
            raise WeightLoadError(f"model_path {path} is not a directory")
        return p

    async def from_disk(self, body: dict) -> Reply:
        window = self._window
        loop = asyncio.get_running_loop()
        try:
            if self._poisoned(window):
                raise WeightLoadError(self._poisoned(window))
            d = self._allowed_dir(body.get("model_path"))
            fmt = body.get("load_format")
            if fmt not in (None, "auto", "safetensors"):
                raise WeightLoadError(f"load_format {fmt!r} is not supported (safetensors only)")
            tensors = await loop.run_in_executor(None, lambda: list(updates_dequantized(
                self.engine.model, read_safetensors_dir(d, self.weights_root))))
            async with self._lock:
                n = await self._load(body, tensors, True, window)
        except Exception as e:  # noqa: BLE001 - every load failure answers the same body
            status, reply = await self._failed(window, "Failed to update weights", str(e),
                                               "Rolled back to the previous weights.")
            return status, {**reply, "num_paused_requests": 0}
        note = self._version_note(body)
        self.loaded_path = str(d)
        logger.info("loaded %d tensors from %s (version %s)", n, d, self.engine.weight_version)
        return 200, result_body(True, "Succeeded to update model weights." + note, num_paused_requests=0)

    # ---- group ---------------------------------------------------------------------------------
    async def init_group(self, body: dict) -> Reply:
        try:
            req = parse_init_group(body, cuda=self.cuda, default_timeout_s=self.default_timeout_s)
            if req.group_name in self.groups or req.group_name in self._joining:
                raise Refused(f"group {req.group_name!r} already exists; destroy it first")
        except Refused as e:
            return 400, result_body(False, f"Failed to initialize custom process group: {e}.")
        self._joining.add(req.group_name)
        logger.info("joining weight group %r: rank %d of %d at %s:%d (%s, timeout %.0fs)", req.group_name, req.rank,
                    req.world_size, req.master_address, req.master_port, req.backend, req.timeout_s)
        try:
            self.groups[req.group_name] = await in_thread(lambda: WeightGroup(
                req.backend, req.master_address, req.master_port, req.world_size, req.rank, req.group_name,
                req.timeout_s), undo=WeightGroup.destroy)
        except Exception as e:  # noqa: BLE001 - rendezvous/backend errors: nothing was registered
            logger.warning("joining weight group %r failed: %s", req.group_name, e)
            return 400, result_body(False, f"Failed to initialize custom process group: {type(e).__name__}: {e}.")
        finally:
            self._joining.discard(req.group_name)
        return 200, result_body(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, body: dict) -> Reply:
        name = parse_group_name(body)
        async with self._lock:  # never tear a group down under a broadcast in flight
            g = self.groups.pop(name, None)
            if g is None:
                return 400, result_body(False, "The group to be destroyed does not exist.")
            await in_thread(g.destroy)
        return 200, result_body(True, "Succeeded to destroy custom process group.")

    # ---- /update_weights_from_distributed ------------------------------------------------------
    def _precheck(self, body: dict) -> tuple[DistributedUpdate, WeightGroup]:
        """Everything that must hold before joining a collective (else Refused: the trainer sent garbage)."""
        upd = parse_update_distributed(body, self.max_bucket_bytes)
        group = self.groups.get(upd.group_name)
        if group is None:
            raise Refused(f"no weight update group {upd.group_name!r}: call /init_weights_update_group first")
        if group.broken is not None:
            raise Refused(f"group {upd.group_name!r} is broken ({group.broken}); destroy it and init a new one")
        return upd, group

    async def from_distributed(self, body: dict) -> Reply:
        window = self._window
        what = "Failed to update parameter online"
        refused: Optional[Refused] = None
        try:
            body = validate_request("/update_weights_from_distributed", body)  # SGLang's model, coerced
            upd, group = self._precheck(body)
        except Refused as e:
            refused = e
        except BadRequest as e:  # answered with the validation body; a pause window still rolls back
            if window is not None:
                await self._failed(window, what, str(e))
            raise
        problem = self._session_problem("update_weights_from_distributed")
        if problem is None and refused is None and upd.flattened and self.release.refuses_unaligned_buckets:
            problem = unaligned(upd)
        if problem is not None:  # refused before any collective; no weight changed, so no rollback either
            return 400, result_body(False, problem)
        if refused is not None:
            return await self._failed(window, what, str(refused))
        problem = self._poisoned(window)  # the layout is known: receive, then refuse
        if problem is None:
            try:  # an FP8 server: each weight_scale_inv is checked with its weight, after the receive
                check_layout(self.engine.model, [(s.name, s.shape, s.dtype) for s in upd.specs
                                                 if not (getattr(self.engine.model, "fp8_block", None)
                                                         and s.name.endswith("_scale_inv"))])
            except WeightLoadError as e:
                problem = str(e)
        async with self._lock:
            try:
                named = await in_thread(lambda: receive(group, upd, self.engine.device))
            except Exception as e:  # noqa: BLE001 - peer died, timeout, size mismatch: the group is now broken
                return await self._failed(window, what, f"receiving the broadcast failed {e}; group "
                                                        f"{upd.group_name!r} is broken, destroy it")
            if problem is not None:
                return await self._failed(window, what, problem)
            try:
                named = list(updates_dequantized(self.engine.model, named))
                n = await self._load(body, named, False, window)
            except (WeightLoadError, RuntimeError, ValueError) as e:
                return await self._failed(window, what, str(e))
        logger.info("loaded %d tensors (%d bytes%s) from group %r", n, upd.nbytes,
                    ", flattened" if upd.flattened else "", upd.group_name)
        return 200, result_body(True, "Succeeded to update parameter online." + self._version_note(body))
