"""The inference service of a run: the servers that the allocation's inference part names (launched here,
or existing ones at `inference.addresses`) and the one SGLang client that drives them.

`sglang:d2t4e4` means two servers, each with tp 4 and ep 4 (real SGLang); the embedded server runs one
rank per server (t and e must be 1). `inference.backend=simulated` is the latency simulator.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Optional

from mega_async.api.config import ConfigError, RunConfig, api_key
from mega_async.api.types import Version

logger = logging.getLogger("mega_async.inference.service")


def server_layout(cfg: RunConfig) -> tuple[int, int, int]:
    """(servers, tp per server, ep per server) from the allocation's inference part."""
    part = cfg.allocation().inference
    if part is None:
        raise ConfigError(f"parallel.allocation={cfg.parallel.allocation!r} has no inference part: "
                          "prefix it with the servers, e.g. sglang:d1+megatron:d1")
    s = part.strategy
    if s.pp > 1 or s.cp > 1:
        raise ConfigError(f"parallel.allocation: inference part {part.backend}:{s} uses p/c; servers take d (count), "
                          "t (tp per server) and e (ep per server)")
    return s.dp, s.tp, s.ep


def _server_host() -> str:
    """Loopback for a one-host job; with trainer ranks on several hosts (pipeline stage heads elsewhere
    must reach the servers) this host's address."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    nodes = int(os.environ.get("SLURM_NNODES", "1"))
    if nodes > 1 or (local and world > local):
        return node_address()
    return "127.0.0.1"


def node_address() -> str:
    """The address the other hosts of a multi-host run reach this one at: the local end of the route to
    MASTER_ADDR (not the host name's address, which is 127.0.1.1 on Debian's /etc/hosts or may not
    resolve at all), else the host name's address when it is not loopback; one line when neither is."""
    import socket

    from mega_async.utils.comm import is_loopback, route_source

    master = os.environ.get("MASTER_ADDR")
    tried = []
    if master and not is_loopback(master):
        try:
            addr = route_source(master)
            if not is_loopback(addr):
                return addr
            tried.append(f"the route to MASTER_ADDR={master} leaves from {addr}")
        except OSError as e:
            tried.append(f"no route to MASTER_ADDR={master} ({e})")
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not is_loopback(addr):
            return addr
        tried.append(f"host name {socket.gethostname()} is {addr}")
    except OSError as e:
        tried.append(f"host name {socket.gethostname()} does not resolve ({e})")
    raise ConfigError("servers of a multi-host run need an address the other hosts reach, but "
                      + "; ".join(tried) + ": export MASTER_ADDR as this node's address (or its name on the cluster "
                      "network), or start the servers yourself and pass inference.addresses")


def _first_free_gpu(cfg: RunConfig) -> Optional[int]:
    """Real SGLang servers go on the GPUs after this host's trainer ranks (0 .. local ranks - 1)."""
    import torch

    if not torch.cuda.is_available():
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else cfg.allocation().train.world_size




class InferenceService:
    """Servers plus client. `engine` is what the rollout layer calls (`agenerate`, pause/continue)."""

    def __init__(self, cfg: RunConfig, version: Optional[Version] = None, weights_root: Any = None,
                 cpu_share: float = 1.0, events: Any = None):
        self.cfg = cfg
        self.launcher: Any = None
        self.router: Any = None  # the smg the run started (inference.router=smg)
        self.router_address: Optional[str] = None
        self._supervisor: Optional[ServerSupervisor] = None  # set before any return: close() reads it
        self.tokenizer: Any = None
        self.vocab_size = 64
        self.addresses: list[str] = []
        inf = cfg.inference
        if inf.backend == "simulated":
            from mega_async.inference.sim.simulated import SimulatedEngine

            self.engine: Any = SimulatedEngine(vocab_size=self.vocab_size, token_latency=(0.0, 0.002), seed=cfg.seed,
                                               version=version)
            self.gpus_per_server = 1
            return
        from transformers import AutoConfig, AutoTokenizer

        from mega_async.inference.client import SGLangClient
        from mega_async.inference.servers import ServerLauncher, run_server_spec
        from mega_async.bridge.model_cards import ensure_weights

        n, tp, ep = server_layout(cfg)
        if inf.router == "smg" and api_key(cfg):  # before any server starts
            raise ConfigError(f"inference.router=smg with an API key ({inf.api_key_env}): smg takes the servers' key "
                              "only on its command line, where every user of the host can read it; start smg "
                              "yourself and pass inference.router_address")
        if inf.backend == "embedded" and (tp > 1 or ep > 1):
            raise ConfigError(f"parallel.allocation={cfg.parallel.allocation!r}: the embedded server runs one rank "
                              f"(t1, e1); got t{tp} e{ep}. Use inference.backend=sglang for tensor/expert-parallel servers")
        self.gpus_per_server = tp
        model = cfg.model.path
        if inf.backend == "embedded" or not inf.addresses:  # servers we launch load the card's weights
            ensure_weights(model, seed=cfg.seed)
        self.vocab_size = AutoConfig.from_pretrained(model).vocab_size
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        addresses = list(inf.addresses)
        if not addresses:
            gpu = _first_free_gpu(cfg) if inf.backend == "sglang" else None
            spec = run_server_spec(cfg, num_servers=n, host=_server_host(), tp=tp, ep=ep, api_key=api_key(cfg),
                                   weights_root=str(weights_root) if weights_root else None, base_gpu_id=gpu,
                                   # no GPU here: real SGLang's CPU engine (mega_async.inference.sglang.cpu)
                                   device="cpu" if inf.backend == "sglang" and gpu is None else None,
                                   num_threads=max(1, int((os.cpu_count() or 1) * cpu_share) // n))
            self.launcher = ServerLauncher(spec, log_dir=str(cfg.run_dir / "server_logs"))
            addresses = self.launcher.start()
        self.addresses = addresses
        self.router_address = inf.router_address
        if inf.router == "smg":
            self.router_address = self._start_router(addresses)
        self.engine = SGLangClient(addresses, api_key=api_key(cfg), request_timeout=inf.request_timeout,
                                   max_retries=inf.max_retries, unhealthy_timeout=inf.unhealthy_timeout,
                                   version=version, events=events, router=self.router_address)
        if self.launcher is not None or self.router is not None:
            self._supervisor = ServerSupervisor(self.launcher, self.engine, inf.max_server_restarts, events=events,
                                                router=self.router)

    def _start_router(self, addresses: list[str]) -> str:
        """smg in front of `addresses`; stopped with the servers (close), or at once if this fails."""
        from mega_async.inference.router import RouterLauncher, find_smg
        from mega_async.inference.sglang.cpu import engine_python

        inf = self.cfg.inference
        try:
            try:
                python: Optional[str] = engine_python()
            except FileNotFoundError:
                python = None
            smg = find_smg(inf.router_bin, python)
            log_dir = self.cfg.run_dir / "server_logs"
            log_dir.mkdir(parents=True, exist_ok=True)
            self.router = RouterLauncher(smg, addresses, host=_server_host(), args=inf.router_args,
                                         log_path=log_dir / "router.log")
            return self.router.start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()
        if self.router is not None:
            self.router.stop()
        if self.launcher is not None:
            self.launcher.stop()


class ServerSupervisor:
    """Restarts a server the run launched when its process ends, at its address (at another port, which the client
    and a run-started router follow, when another process took its port meanwhile), at most `max_restarts` times
    each; the client keeps it out until it serves the current weights (the weight sync brings them). Past the
    limit the server is given up on (dropped from the client) with one line saying so."""

    def __init__(self, launcher: Any, client: Any, max_restarts: int, interval: float = 0.5, events: Any = None,
                 router: Any = None):
        self.launcher, self.client, self.max_restarts, self.interval = launcher, client, max_restarts, interval
        self.events = events
        n = len(launcher.procs) if launcher is not None else 0
        self.restarts = [0] * n
        self.not_before = [0.0] * n  # backoff: 1, 2, 4 ... 30 s between restarts of one server
        self.given_up: set[int] = set()
        # the run's router (inference.router=smg): restarted the same way (its index here is -1); meanwhile the
        # client sends generation around it
        self.router = router
        self.router_restarts, self.router_not_before = 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # the servers it restarts die with this thread (PR_SET_PDEATHSIG is per thread): it must not end early
        while not self._stop.wait(self.interval):
            try:
                for i, rc in (self.launcher.exited() if self.launcher is not None else []):
                    if (i not in self.given_up and not self._stop.is_set() and not self.launcher.stopping
                            and time.monotonic() >= self.not_before[i]):
                        self.check(i, rc)
                if self.router is not None and (rc := self.router.exited()) is not None and not self._stop.is_set() \
                        and time.monotonic() >= self.router_not_before and -1 not in self.given_up:
                    self.check_router(rc)
            except Exception:  # noqa: BLE001 - logged; supervision goes on
                logger.exception("server supervisor")

    def check_router(self, rc: int) -> None:
        if self.router_restarts >= self.max_restarts:
            self.given_up.add(-1)
            logger.error("router %s exited %d times (last code %s); given up after inference.max_server_restarts=%d "
                         "restarts: generation goes straight to the servers (log: %s)", self.router.address,
                         self.router_restarts + 1, rc, self.max_restarts, self.router.log_path)
            return
        self.router_restarts += 1
        self.router_not_before = time.monotonic() + min(30.0, 2.0 ** (self.router_restarts - 1))
        logger.warning("router %s exited with code %s; restarting it (%d of %d)", self.router.address, rc,
                       self.router_restarts, self.max_restarts)
        if self.events is not None:
            self.events.emit("router_restarted", router=self.router.address, code=rc, restarts=self.router_restarts)
        try:
            self.router.restart()
        except Exception as e:  # noqa: BLE001 - counted: the next look finds it ended again
            logger.error("router %s could not be started again: %s: %s", self.router.address, type(e).__name__, e)

    def check(self, i: int, rc: int) -> None:
        address = self.launcher.addresses[i]
        if self.restarts[i] >= self.max_restarts:
            self.given_up.add(i)
            why = (f"its process exited {self.restarts[i] + 1} times (last code {rc}); given up after "
                   f"inference.max_server_restarts={self.max_restarts} restarts (log: {self.launcher.log_path(i)})")
            logger.error("server %d (%s): %s", i, address, why)
            self.client.drop(address, why)
            return
        self.restarts[i] += 1
        self.not_before[i] = time.monotonic() + min(30.0, 2.0 ** (self.restarts[i] - 1))
        logger.warning("server %d (%s) exited with code %s; restarting it (%d of %d)", i, address, rc,
                       self.restarts[i], self.max_restarts)
        if self.events is not None:
            self.events.emit("server_restarted", server=address, code=rc, restarts=self.restarts[i])
        try:
            moved = self.launcher.restart(i)
            if moved:  # its port was taken while it was down: the client and the router follow it
                self.client.readdress(address, moved)
                if self.router is not None:
                    self.router.readdress(address, moved)
                if self.events is not None:
                    self.events.emit("server_moved", server=address, to=moved)
                address = moved
            self.client.expect_back(address, self.launcher.startup_timeout)
        except Exception as e:  # noqa: BLE001 - counted: the next look finds it ended again
            logger.error("server %d (%s) could not be started again: %s: %s", i, address, type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
