"""An HTTP proxy in front of one inference server that tampers with the weight sync passing through it.

A real component for the sync-verification tests (tests/integration/test_sync_tamper.py): every request is forwarded
to the server as it came (aiohttp, on its own thread), except what the current fault changes. Faults (`set`):

    hold          bucket k's /update_weights_from_distributed is never forwarded nor answered (the call stays
                  pending; the server never joins the broadcast)
    ack           bucket k is answered 200 at once, as SGLang answers a loaded bucket, and never forwarded (an
                  engine that acknowledges without receiving)
    drop_tensor   bucket k reaches the server with one tensor renamed to a later tensor of the same shape and dtype
                  in that bucket: the server receives every byte, loads the later one twice and never the first
                  (disk: the new checkpoint with that tensor's old value)
    drop_expert   the same for every tensor of one routed expert (renamed to the next expert's, whose tensors come
                  later in the bucket; where they do not, as in an FP8 bucket, the two experts swapped, each weight
                  with its weight_scale_inv)
    drop_bucket   disk: every tensor of one layer keeps its old value (distributed: a bucket cannot be dropped by
                  HTTP without the server leaving the broadcast: that is `ack`)
    rollback      the server is sent /rollback_weights before /continue_generation is forwarded (weights and
                  version back to where the pause found them)
    rollback_keep the same, then /update_weight_version sets the sync's version again (old weights claiming the new
                  version)

Each fault fires once (the next sync passes through), and `log` says what was done to what, so a test can check the
sync's error names it.
"""
from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Optional

import aiohttp
from aiohttp import web

FAULTS = ("hold", "ack", "drop_tensor", "drop_expert", "drop_bucket", "rollback", "rollback_keep")
_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight(?:_scale_inv)?$")  # an FP8 scale goes with its weight
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "host", "content-encoding"}


class TamperProxy:
    """`TamperProxy(server_address, port).start()`; `address` is what the trainer's client is given."""

    def __init__(self, target: str, port: int, host: str = "127.0.0.1"):
        self.target = target if "://" in target else f"http://{target}"
        self.host, self.port = host, port
        self.fault: Optional[str] = None
        self.bucket = 0  # the bucket index (counted per sync, from the first weight-carrying update) a fault hits
        self.old_dir: Optional[str] = None  # disk faults: where the old values come from
        self.log: list[str] = []
        self._k = -1
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tamper-proxy", daemon=True)
        self._runner: Optional[web.AppRunner] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._held: list[asyncio.Future] = []

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "TamperProxy":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        if not self.port:  # port 0: the one the system gave
            self.port = site._server.sockets[0].getsockname()[1]

    def set(self, fault: Optional[str], bucket: int = 0, old_dir: Optional[str] = None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"fault {fault!r}: use one of {FAULTS}")
        self.fault, self.bucket, self.old_dir = fault, bucket, old_dir

    def stop(self) -> None:
        async def close() -> None:
            for f in self._held:
                f.done() or f.set_result(None)
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # ---- forwarding ----------------------------------------------------------------------------
    async def _forward(self, method: str, path: str, body: bytes, headers: Any) -> web.Response:
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP}
        async with self._session.request(method, self.target + path, data=body or None, headers=fwd) as r:
            data = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP}
            return web.Response(status=r.status, body=data, headers=out)

    async def _post(self, path: str, body: dict) -> tuple[int, Any]:
        async with self._session.post(self.target + path, json=body) as r:
            return r.status, await r.json(content_type=None)

    async def _handle(self, request: web.Request) -> web.Response:
        path = request.path_qs
        body = await request.read()
        if request.path == "/pause_generation":
            self._k = -1
        if request.path == "/update_weights_from_distributed" and body:
            payload = json.loads(body)
            if payload.get("names"):
                self._k += 1
                if self._k >= self.bucket and self.fault in ("drop_tensor", "drop_expert"):
                    try:  # the first bucket from `bucket` on that has what the fault needs
                        payload["names"] = self._rename(payload, self.fault)
                        body, self.fault = json.dumps(payload).encode(), None
                    except LookupError:
                        pass
                if self._k == self.bucket and self.fault in ("hold", "ack"):
                    fault, self.fault = self.fault, None
                    if fault == "hold":
                        self.log.append(f"hold: bucket {self._k} ({len(payload['names'])} tensors) never forwarded")
                        held = self._loop.create_future()
                        self._held.append(held)
                        await held
                        return web.json_response({"success": False, "message": "proxy stopped"}, status=503)
                    if fault == "ack":
                        self.log.append(f"ack: bucket {self._k} answered 200, never forwarded")
                        return web.json_response({"success": True, "message": "Succeeded to update parameter "
                                                  "online.", "num_paused_requests": 0})
        if request.path == "/update_weights_from_disk" and body and self.fault in ("drop_tensor", "drop_expert",
                                                                                    "drop_bucket"):
            fault, self.fault = self.fault, None
            payload = json.loads(body)
            payload["model_path"] = self._tampered_dir(payload["model_path"], fault)
            body = json.dumps(payload).encode()
        if request.path == "/continue_generation" and self.fault in ("rollback", "rollback_keep"):
            fault, self.fault = self.fault, None
            async with self._session.get(self.target + "/model_info") as r:
                version = (await r.json(content_type=None)).get("weight_version")
            st, out = await self._post("/rollback_weights", {})
            self.log.append(f"{fault}: /rollback_weights answered {st} (was at version {version})")
            if fault == "rollback_keep":
                st, out = await self._post("/update_weight_version", {"new_version": str(version)})
                self.log.append(f"{fault}: weight_version set back to {version} ({st})")
        return await self._forward(request.method, path, body, request.headers)

    # ---- the faults --------------------------------------------------------------------------
    def _rename(self, payload: dict, fault: str) -> list[str]:
        names, shapes, dtypes = list(payload["names"]), payload["shapes"], payload["dtypes"]
        if fault == "drop_tensor":
            for i, n in enumerate(names):
                later = [j for j in range(i + 1, len(names)) if shapes[j] == shapes[i] and dtypes[j] == dtypes[i]
                         and names[j] != n and not _EXPERT.match(n)]
                if later:
                    self.log.append(f"drop_tensor: {n} (sent as {names[later[0]]})")
                    names[i] = names[later[0]]
                    return names
            raise LookupError("drop_tensor: no tensor of this bucket has a later one of its shape")
        experts = {}
        for i, n in enumerate(names):
            if (m := _EXPERT.match(n)) is not None:
                experts.setdefault((m["p"], int(m["e"])), []).append(i)
        for (prefix, e), idx in sorted(experts.items()):
            nxt = experts.get((prefix, e + 1))
            if nxt and len(nxt) == len(idx) and min(nxt) > max(idx):
                self.log.append(f"drop_expert: {prefix}.{e} (sent as {prefix}.{e + 1})")
                for i in idx:
                    names[i] = names[i].replace(f"{prefix}.{e}.", f"{prefix}.{e + 1}.")
                return names
        for (prefix, e), idx in sorted(experts.items()):  # interleaved (an FP8 bucket's weights, then its scales)
            nxt = experts.get((prefix, e + 1))
            if nxt and len(nxt) == len(idx):  # the two experts swapped, each weight with its own scale
                self.log.append(f"drop_expert: {prefix}.{e} and {prefix}.{e + 1} swapped")
                for i in idx:
                    names[i] = names[i].replace(f"{prefix}.{e}.", f"{prefix}.{e + 1}.")
                for i in nxt:
                    names[i] = names[i].replace(f"{prefix}.{e + 1}.", f"{prefix}.{e}.")
                return names
        raise LookupError("drop_expert: no expert of this bucket has a next one in it")

    def _tampered_dir(self, path: str, fault: str) -> str:
        """A copy of the checkpoint at `path` with the chosen tensors' values from `old_dir`."""
        from safetensors.torch import load_file, save_file

        src, old = Path(path), Path(self.old_dir or "")
        old_tensors = {k: v for f in sorted(old.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
        dst = src.with_name(src.name + ".tampered")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        files = sorted(dst.glob("*.safetensors"))
        every = {k: f for f in files for k in load_file(str(f))}
        names = sorted(every)
        if fault == "drop_tensor":
            chosen = [next(n for n in names if n.endswith("self_attn.o_proj.weight"))]
        elif fault == "drop_expert":
            first = next(m for n in names if (m := _EXPERT.match(n)))
            chosen = [n for n in names if n.startswith(f"{first['p']}.{first['e']}.")]
        else:
            layer = max(int(m.group(1)) for n in names if (m := _LAYER.match(n)))
            chosen = [n for n in names if n.startswith(f"model.layers.{layer}.")]
        self.log.append(f"{fault}: {len(chosen)} tensors kept old: {', '.join(chosen[:4])}"
                        f"{' ...' if len(chosen) > 4 else ''}")
        for f in {every[n] for n in chosen}:
            tensors = load_file(str(f))
            for n in chosen:
                if every[n] == f:
                    tensors[n] = old_tensors[n].clone()
            save_file(tensors, str(f), metadata={"format": "pt"})
        return str(dst)
