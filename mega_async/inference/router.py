"""A router in front of the run's servers: `smg` (PyPI; SGLang's model gateway, sglang-router's successor), started
by the run (`inference.router: smg`) or already running (`inference.router_address`).

The run's generation goes through the router while every server serves the current weights; control (pause,
continue, abort) and weights always go straight to the servers (mega_async.inference.client), so the router needs
no part in a weight sync. docs/inference.md, "A router in front".
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from mega_async.utils.comm import PORT_ATTEMPTS, free_port, lost_the_port, output_since
from mega_async.api.config import ConfigError

logger = logging.getLogger("mega_async.inference.router")

INSTALL_HINT = ("install it with `pip install smg` (tools/install_sglang_cpu.sh puts it in the real engine's "
                "environment) or name it with inference.router_bin")


def find_smg(configured: Optional[str] = None, engine_python: Optional[str] = None) -> str:
    """The smg executable: `configured` (inference.router_bin), else `smg` on PATH, else the one next to the real
    engine's interpreter. One line naming the fix when there is none."""
    if configured:
        path = shutil.which(configured) or configured
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise ConfigError(f"inference.router_bin={configured!r} is not an executable file; {INSTALL_HINT}")
        return path
    found = shutil.which("smg")
    if found:
        return found
    if engine_python:
        beside = Path(engine_python).parent / "smg"
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    raise ConfigError(f"inference.router=smg: no `smg` executable on PATH"
                      f"{' or beside ' + engine_python if engine_python else ''}; {INSTALL_HINT}")


def router_command(smg: str, host: str, port: int, workers: Sequence[str], args: Sequence[str] = (),
                   metrics_port: Optional[int] = None) -> list[str]:
    """`smg launch` in front of `workers`. smg's Prometheus endpoint binds 0.0.0.0:29000 by default, which a second
    router on the host cannot have and which every host of the network could read: it goes on `host` at
    `metrics_port` (a free one) unless `args` (inference.router_args) place it."""
    urls = [w if w.startswith("http") else f"http://{w}" for w in workers]
    cmd = [smg, "launch", "--host", host, "--port", str(port), "--worker-urls", *urls, "--log-level", "warn"]
    if not any(a == "--prometheus-port" or a.startswith("--prometheus-port=") for a in args):
        cmd += ["--prometheus-port", str(metrics_port if metrics_port is not None else free_port(host))]
    if not any(a == "--prometheus-host" or a.startswith("--prometheus-host=") for a in args):
        cmd += ["--prometheus-host", host]
    return cmd + list(args)


def readiness(address: str, timeout: float = 2.0) -> Optional[dict]:
    """smg's GET /readiness ({"status", "healthy_workers", "total_workers"}), None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/readiness", timeout=timeout) as r:
            body = json.loads(r.read(65536) or b"{}")
            return body if isinstance(body, dict) else None
    except urllib.error.HTTPError as e:  # 503 while not ready: still a body
        try:
            body = json.loads(e.read(65536) or b"{}")
            return body if isinstance(body, dict) else None
        except ValueError:
            return None
    except (urllib.error.URLError, OSError, ValueError):
        return None


class _PortTaken(RuntimeError):
    """The router's process ended because its port was taken before it bound it."""


class RouterLauncher:
    """Starts smg in front of `workers`, waits until it reports every worker healthy, stops it (its process group)
    at the end; the process dies with the run (PR_SET_PDEATHSIG) and is never left behind."""

    def __init__(self, smg: str, workers: Sequence[str], host: str = "127.0.0.1", args: Sequence[str] = (),
                 log_path: Optional[Path] = None, startup_timeout: float = 120.0):
        self.smg, self.workers, self.host, self.args = smg, list(workers), host, list(args)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.address: Optional[str] = None
        self.metrics_port: Optional[int] = None  # its Prometheus endpoint (kept across restarts)
        self._log_start = 0  # where its log stood when its process was started

    def start(self) -> str:
        self.address = f"{self.host}:{free_port(self.host)}"
        try:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                self._spawn()
                try:
                    self._wait_ready()
                    break
                except _PortTaken as e:
                    if attempt == PORT_ATTEMPTS:
                        raise RuntimeError(str(e)) from None
                    old, self.address, self.metrics_port = self.address, f"{self.host}:{free_port(self.host)}", None
                    logger.warning("the router could not listen at %s or its metrics port (another process took "
                                   "it before it bound); starting it at %s", old, self.address)
        except BaseException:
            self.stop()
            raise
        return self.address

    def _spawn(self) -> None:
        from mega_async.inference.servers import _die_with_parent

        assert self.address is not None
        if self.metrics_port is None:
            self.metrics_port = free_port(self.host)
        cmd = router_command(self.smg, self.host, int(self.address.rsplit(":", 1)[1]), self.workers, self.args,
                             self.metrics_port)
        logger.info("starting router: %s", " ".join(cmd))
        try:
            self._log_start = self.log_path.stat().st_size if self.log_path else 0
        except OSError:
            self._log_start = 0
        log = self.log_path.open("ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        finally:
            if self.log_path:
                log.close()

    def exited(self) -> Optional[int]:
        """Its exit code once its process has ended (None while it runs, or before start)."""
        return self.proc.poll() if self.proc is not None else None

    def restart(self) -> None:
        """Start it again at its address (its log appended); does not wait: the client goes around it until it
        answers /health."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("the router is still running")
        self._spawn()

    def readdress(self, old: str, new: str) -> None:
        """Worker `old` now listens at `new` (the run restarted it at another port). smg's worker list is fixed at
        launch: a running router is started again over the new list, at its address, without waiting (the client
        sends generation around it until it answers, as after a restart); one that is not running (ended, waiting
        for its restart, given up on) only takes the new list for its next start."""
        bare = lambda a: a.split("://", 1)[-1].rstrip("/")  # noqa: E731
        if bare(old) not in [bare(w) for w in self.workers]:
            raise ValueError(f"{old} is not one of the router's workers ({', '.join(self.workers)})")
        self.workers = [new if bare(w) == bare(old) else w for w in self.workers]
        if self.proc is None or self.proc.poll() is not None:
            return
        logger.warning("router %s: worker %s moved to %s; starting the router again over the new list", self.address,
                       old, new)
        self.stop()
        self._spawn()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last: Optional[dict] = None
        while time.monotonic() < deadline:
            assert self.proc is not None and self.address is not None
            rc = self.proc.poll()
            if rc is not None:
                error = _PortTaken if lost_the_port(output_since(self.log_path, self._log_start)) else RuntimeError
                raise error(f"router (smg) exited with code {rc} before it was ready; last log lines "
                            f"({self.log_path}):\n{self.log_tail()}")
            last = readiness(self.address)
            if last and last.get("healthy_workers") == len(self.workers):
                return
            time.sleep(0.2)
        raise TimeoutError(f"router (smg) at {self.address} not ready after {self.startup_timeout:.0f} s (last "
                           f"/readiness {last}); log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:]) if self.log_path else ""
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(grace)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
