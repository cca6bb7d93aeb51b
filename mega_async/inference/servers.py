"""Start N inference servers (embedded or real SGLang) on free ports, wait for /health, stop them all.

Servers run in their own process groups and die with the launcher (PDEATHSIG on Linux, atexit,
and `stop()` in every failure path), so no orphan process survives a crash of the driver.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mega_async.api.sglang_releases import dp_attention_args
from mega_async.utils.comm import PORT_ATTEMPTS, free_port, listens, lost_the_port, output_since, port_free
from mega_async.inference.sglang import cpu as sglang_cpu
from mega_async.inference.sglang.cpu import engine_python

logger = logging.getLogger("mega_async.inference.servers")


def _die_with_parent() -> None:  # runs in the child before exec
    os.setsid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


@dataclass
class ServerSpec:
    backend: str  # embedded | sglang
    model_path: str
    num_servers: int = 1
    host: str = "127.0.0.1"
    weights_root: Optional[str] = None
    api_key: Optional[str] = None
    tp_size: int = 1
    ep_size: int = 1
    dp_size: int = 1
    enable_dp_attention: bool = False
    moe_a2a_backend: Optional[str] = None
    dtype: Optional[str] = None
    seed: int = 0
    num_threads: Optional[int] = None  # CPU threads per embedded server; default cores / num_servers
    base_gpu_id: Optional[int] = None  # real SGLang: server i uses GPUs base + i * tp_size ... (after the trainer's)
    extra_args: Sequence[str] = field(default_factory=list)
    allow_untested_sglang: bool = False  # launch an installed SGLang outside the tested release range
    device: Optional[str] = None  # real SGLang: "cpu" on a machine without a GPU (mega_async.inference.sglang.cpu)
    radix_cache: Optional[bool] = None  # None: the backend's default (embedded on; real SGLang off, as AReaL)
    python: Optional[str] = None  # real SGLang's interpreter; None: engine_python() (this one when it has SGLang)
    release: Optional[str] = None  # real SGLang's release, where known: the flags' spelling (`dp_attention_args`)


def installed_sglang(python: str) -> Optional[str]:
    """The SGLang release `python` has (None: none): read here for this interpreter, else asked of it."""
    if python != sys.executable:
        return sglang_cpu.probe(python)["sglang"]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def sglang_release(python: Optional[str] = None) -> Optional[str]:
    """The SGLang release of `python` (else engine_python()), None when it has none or cannot be asked."""
    try:
        return installed_sglang(python or engine_python())
    except Exception:  # noqa: BLE001 - a probe that fails: the spelling every tested release accepts
        return None


def untested_sglang(allow: bool = False, python: Optional[str] = None) -> Optional[str]:
    """One line when the SGLang of the servers' interpreter (`python`, else engine_python()) is missing or outside
    the tested range (None: fine, or allowed)."""
    try:
        python = python or engine_python()
        return release_problem(installed_sglang(python), python, allow)
    except (FileNotFoundError, RuntimeError) as e:
        return str(e)


def release_problem(installed: Optional[str], python: str, allow: bool = False) -> Optional[str]:
    """untested_sglang's verdict on the release `installed` that `python` has."""
    from mega_async.api.sglang_releases import TESTED_RANGE, untested_reason

    if installed is None:
        where = "" if python == sys.executable else f" in {python}"
        return (f"inference.backend=sglang: SGLang is not installed{where}; pip install -e .[gpu] (SGLang "
                f"{TESTED_RANGE}), on a machine without a GPU {sglang_cpu.INSTALL_HINT}, or use "
                "inference.backend=embedded")
    why = untested_reason(installed)
    if why is None or allow:
        if why:
            logger.warning("%s; launching it anyway (inference.allow_untested_sglang)", why)
        return None
    return (f"inference.backend=sglang: {why}: install a tested release (pip install -e .[gpu]) or set "
            "inference.allow_untested_sglang=true to launch it anyway")


ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


def run_server_spec(cfg: Any, *, num_servers: int, host: str, tp: int, ep: int, dp_attention: int = 1,
                    api_key: Optional[str] = None, weights_root: Optional[str] = None,
                    base_gpu_id: Optional[int] = None, device: Optional[str] = None,
                    num_threads: Optional[int] = None, model_path: Optional[str] = None,
                    release: Optional[str] = None) -> ServerSpec:
    """The one ServerSpec of a run's servers, for both launchers (this host's `InferenceService` and the Slurm
    job's renderer): what the run's config asks of every server (backend, model, dtype, seed, radix cache,
    inference.extra_args, SGLang's --enable-return-routed-experts when the run collects routes); the launcher
    gives where and how wide (count, host, TP/EP, DP attention, GPUs, threads, the key or its placeholder)."""
    inf = cfg.inference
    extra = list(inf.extra_args)
    if (cfg.rollout.return_routed_experts or cfg.algorithm.routing_replay) and ROUTED_EXPERTS_FLAG not in extra:
        extra.append(ROUTED_EXPERTS_FLAG)
    return ServerSpec(inf.backend, model_path or str(cfg.model.path), num_servers=num_servers, host=host,
                      api_key=api_key, tp_size=tp, ep_size=ep, dp_size=dp_attention,
                      enable_dp_attention=dp_attention > 1, dtype=cfg.model.dtype, seed=cfg.seed, extra_args=extra,
                      allow_untested_sglang=inf.allow_untested_sglang, radix_cache=inf.radix_cache,
                      weights_root=weights_root, base_gpu_id=base_gpu_id, device=device, num_threads=num_threads,
                      release=release)


def server_command(spec: ServerSpec, port: int, index: int = 0) -> list[str]:
    """The command line for server `index` (the sglang form follows docs/sglang-protocol.md)."""
    if spec.backend == "embedded":
        cmd = [sys.executable, "-m", "mega_async.server", "--model", spec.model_path, "--host", spec.host,
               "--port", str(port), "--random-seed", str(spec.seed + index)]
        if spec.weights_root:
            cmd += ["--weights-root", spec.weights_root]
        if spec.dtype:
            cmd += ["--dtype", spec.dtype]
        # CPU servers on one host share its cores; oversubscribed OpenMP threads spin against each other
        cmd += ["--num-threads", str(cpu_threads(spec))]
    elif spec.backend == "sglang":
        # through a shim that reads the API key from the environment (never on a command line)
        entry = "mega_async.inference.sglang.entry" if spec.api_key else "sglang.launch_server"
        cmd = [spec.python or sys.executable, "-m", entry, "--model-path", spec.model_path, "--host", spec.host,
               "--port", str(port), "--tp-size", str(spec.tp_size), "--random-seed", str(spec.seed + index),
               "--skip-server-warmup"]
        if spec.base_gpu_id is not None:
            cmd += ["--base-gpu-id", str(spec.base_gpu_id + index * spec.tp_size)]
        if spec.ep_size > 1:
            cmd += ["--ep-size", str(spec.ep_size)]
        if spec.enable_dp_attention:
            cmd += dp_attention_args(spec.release, spec.dp_size)
        elif spec.dp_size > 1:
            cmd += ["--dp-size", str(spec.dp_size)]
        if spec.moe_a2a_backend:
            cmd += ["--moe-a2a-backend", spec.moe_a2a_backend]
        if spec.dtype:
            cmd += ["--dtype", spec.dtype]
        if spec.device == "cpu":
            cmd += sglang_cpu.cpu_args(spec.extra_args, spec.dtype)
    else:
        raise ValueError(f"backend {spec.backend!r}: use embedded or sglang")
    off = spec.radix_cache is False or (spec.radix_cache is None and spec.backend == "sglang")
    if off and "--disable-radix-cache" not in spec.extra_args:
        cmd += ["--disable-radix-cache"]
    return cmd + list(spec.extra_args)


API_KEY_ENV = "MEGA_ASYNC_API_KEY"  # what the embedded server and the SGLang shim read


def cpu_threads(spec: ServerSpec) -> int:
    """CPU threads per server: servers on one host split its cores (oversubscribed OpenMP threads spin)."""
    return spec.num_threads or max(1, (os.cpu_count() or 1) // spec.num_servers)


def server_env(spec: ServerSpec) -> dict[str, str]:
    """The servers' environment: the API key travels here, so `ps` and /proc/<pid>/cmdline never show it; a CPU
    SGLang server also gets SGLang's CPU engine, the sgl_kernel stand-in and its share of the cores."""
    env = dict(os.environ)
    env.pop(API_KEY_ENV, None)
    if spec.api_key:
        env[API_KEY_ENV] = spec.api_key
    if spec.backend == "sglang" and spec.device == "cpu":
        env = sglang_cpu.cpu_env(env, cpu_threads(spec))
    return env


class _PortTaken(RuntimeError):
    """A server process ended because its port was taken before it bound it."""


class ServerLauncher:
    def __init__(self, spec: ServerSpec, log_dir: Optional[str] = None, startup_timeout: float = 300.0):
        if spec.num_servers < 1:
            raise ValueError(f"num_servers={spec.num_servers} must be >= 1")
        if spec.backend == "sglang":
            spec = self._check_sglang(spec)
        if not (Path(spec.model_path) / "config.json").exists() and spec.backend == "embedded":
            raise FileNotFoundError(f"model {spec.model_path} has no config.json; pass an HF-format model directory")
        self.spec = spec
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mega_async_servers_"))
        self.startup_timeout = startup_timeout
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self._stopping = False  # set by stop(): no restart after it (a restart then would be an orphan)
        self._restart_lock = threading.Lock()
        self._logs: list[Path] = []
        self._log_starts: dict[int, int] = {}  # where each server's log stood when its process was started

    @staticmethod
    def _check_sglang(spec: ServerSpec) -> ServerSpec:
        """Before anything starts: the servers' interpreter has a tested SGLang and, for CPU servers, this project
        (the stand-in and the fixes are ours); the spec comes back with its interpreter resolved."""
        import dataclasses

        try:
            python = spec.python or engine_python()
        except FileNotFoundError as e:
            raise RuntimeError(str(e)) from None
        ours = str(Path(__file__).resolve().parents[1])
        found = sglang_cpu.probe(python) if python != sys.executable else {"sglang": installed_sglang(python),
                                                                            "mega_async": ours}
        if problem := release_problem(found["sglang"], python, spec.allow_untested_sglang):
            raise RuntimeError(problem)
        if spec.device == "cpu":
            if problem := sglang_cpu.engine_problem(python, found):
                raise RuntimeError(problem)
            if Path(found["mega_async"] or "").resolve() != Path(ours):
                logger.warning("the engine's interpreter %s imports mega_async from %s, this run from %s: its servers "
                               "run that checkout's stand-in (rerun tools/install_sglang_cpu.sh here to change it)",
                               python, found["mega_async"], ours)
        return dataclasses.replace(spec, python=python)

    def start(self) -> list[str]:
        """Start all servers and wait until each answers /health; on any failure stop them all."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            for i in range(self.spec.num_servers):
                port = free_port(self.spec.host)
                self._logs.append(self.log_dir / f"server{i}.log")
                self.addresses.append(f"{self.spec.host}:{port}")
                self.procs.append(self._spawn(i, "ab"))  # a resume keeps the crashed run's logs
            for i in range(len(self.procs)):
                for attempt in range(1, PORT_ATTEMPTS + 1):
                    try:
                        self._wait_healthy(i)
                        break
                    except _PortTaken as e:
                        if attempt == PORT_ATTEMPTS:
                            raise RuntimeError(str(e)) from None
                        old = self.addresses[i]
                        self.addresses[i] = f"{self.spec.host}:{free_port(self.spec.host)}"
                        logger.warning("server %d could not listen at %s (another process took the port before it "
                                       "bound); starting it at %s", i, old, self.addresses[i])
                        self._kill_group(i)
                        self.procs[i] = self._spawn(i, "ab")
        except BaseException:
            self.stop()
            raise
        return list(self.addresses)

    def _spawn(self, i: int, mode: str) -> subprocess.Popen:
        port = int(self.addresses[i].rsplit(":", 1)[1])
        try:
            self._log_starts[i] = self._logs[i].stat().st_size
        except OSError:
            self._log_starts[i] = 0
        cmd = server_command(self.spec, port, i)
        logger.info("starting server %d: %s", i, " ".join(cmd))
        env = server_env(self.spec)
        if "--num-threads" in cmd:
            env["OMP_NUM_THREADS"] = cmd[cmd.index("--num-threads") + 1]
        with self._logs[i].open(mode) as f:
            return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, preexec_fn=_die_with_parent)

    def exited(self) -> list[tuple[int, int]]:
        """(index, exit code) of every server process that has ended."""
        return [(i, rc) for i, p in enumerate(self.procs) if (rc := p.poll()) is not None]

    def restart(self, i: int) -> Optional[str]:
        """Start server i again (its log appended); does not wait for /health: the client re-admits it once it
        answers with the current weights. At its address, unless another process listens on its port now (taken
        while it was down): then at a new free port, and the new address is returned for the caller to tell the
        client (and a router) about; else None."""
        with self._restart_lock:
            if self._stopping:
                raise RuntimeError("the servers are being stopped")
            if self.procs[i].poll() is None:
                raise RuntimeError(f"server {i} is still running")
            self._kill_group(i)  # what it left (e.g. SGLang's scheduler processes) holds its GPUs
            self._wait_group_gone(i)  # and maybe its listener: only another process's counts below
            moved = None
            if not port_free(self.spec.host, int(self.addresses[i].rsplit(":", 1)[1])):
                moved = f"{self.spec.host}:{free_port(self.spec.host)}"
                logger.warning("server %d: another process listens at %s now (its port was taken while it was down); "
                               "starting it at %s", i, self.addresses[i], moved)
                self.addresses[i] = moved
            self.procs[i] = self._spawn(i, "ab")
            return moved

    def _kill_group(self, i: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.procs[i].pid, signal.SIGKILL)

    def _wait_group_gone(self, i: int, timeout: float = 5.0) -> None:
        """Until no process of server i's group is left (SIGKILL takes a moment), at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.procs[i].pid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)

    def _wait_healthy(self, i: int) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://{self.addresses[i]}/health"
        warned = False
        while time.monotonic() < deadline:
            rc = self.procs[i].poll()
            if rc is not None:
                error = _PortTaken if lost_the_port(output_since(self._logs[i], self._log_starts.get(i, 0))) else RuntimeError
                raise error(f"server {i} exited with code {rc} before becoming healthy; "
                            f"last log lines ({self._logs[i]}):\n{self.log_tail(i)}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    ok = r.status == 200
            except (urllib.error.URLError, ConnectionError, OSError):
                ok = False
            # whatever answers must be our own process (or its children): another one that bound the port between
            # free_port() and our bind would get the trainer's weight-update address; ours then fails to bind and
            # is started again at another port (_PortTaken)
            if ok and listens(int(self.addresses[i].rsplit(":", 1)[1]), self.procs[i].pid) is not False:
                return
            if ok and not warned:
                warned = True
                logger.warning("server %d: another process answers at %s; waiting for our own server to take it or "
                               "to be started again at another port", i, self.addresses[i])
            time.sleep(0.2)
        raise TimeoutError(f"server {i} not healthy after {self.startup_timeout:.0f}s; log: {self._logs[i]}\n{self.log_tail(i)}")

    @property
    def stopping(self) -> bool:
        """stop() has begun: no server is restarted any more."""
        return self._stopping

    def log_path(self, i: int) -> Path:
        return self._logs[i]

    def log_tail(self, i: int, n: int = 20) -> str:
        try:
            return "\n".join(self._logs[i].read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self, i: int) -> None:
        """Kill one server at once (failure injection in tests)."""
        p = self.procs[i]
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop(self, grace: float = 10.0) -> None:
        with self._restart_lock:
            self._stopping = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        atexit.unregister(self.stop)

    def __enter__(self) -> "ServerLauncher":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
