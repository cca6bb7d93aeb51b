"""launch/slurm/lib.sh's report of a failed trainer step, sourced in bash with the logs a multi-node job
leaves: the rank that failed first is often not the driver (srun kills the driver without a word), so its
own one-line error from trainer_rank<N>.log is what the job log and the driver's log must say."""
import subprocess
import sys
from pathlib import Path

LIB = Path(__file__).resolve().parents[2] / "launch" / "slurm" / "lib.sh"


def trainer_error(tmp_path: Path, logs: dict) -> str:
    (tmp_path / "logs").mkdir()
    for name, text in logs.items():
        (tmp_path / "logs" / name).write_text(text)
    r = subprocess.run(["bash", "-c", f'source "{LIB}"; ma_trainer_error'], capture_output=True, text=True,
                       env={"RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_the_failing_rank_on_another_node_is_named(tmp_path):
    out = trainer_error(tmp_path, {
        "driver.log": "rank 0/2 on n1\n[W] ProcessGroupGloo.cpp:524 Warning: Unable to resolve hostname\n",
        "trainer_rank1.log": "rank 1/2 on n2\nTraceback ...\nRuntimeError: Gloo connectFullMesh failed\n"
                             "mega-async train: rank 1: RuntimeError: Gloo connectFullMesh failed, "
                             "remote=[127.0.0.1]\n"})
    assert out == ("errors of the ranks: rank 1: RuntimeError: Gloo connectFullMesh failed, remote=[127.0.0.1] "
                   "(logs/trainer_rank1.log)")


def test_every_rank_that_said_why_in_rank_order(tmp_path):
    out = trainer_error(tmp_path, {
        "driver.log": "mega-async train: rank 0: SyncError: could not build the weight-update groups\n",
        "trainer_rank10.log": "mega-async train: rank 10: ValueError: ten\n",
        "trainer_rank2.log": "mega-async train: rank 2: ValueError: two\n"})
    assert out == ("errors of the ranks: rank 0: SyncError: could not build the weight-update groups "
                   "(logs/driver.log); rank 2: ValueError: two (logs/trainer_rank2.log); "
                   "rank 10: ValueError: ten (logs/trainer_rank10.log)")


def test_no_rank_line_falls_back_to_the_driver_log(tmp_path):
    out = trainer_error(tmp_path, {"driver.log": "step 0\nKilled\nbye\n", "trainer_rank1.log": "step 0\n"})
    assert out == "last error in logs/driver.log: Killed"


SERVER_SH = LIB.parent / "server.sh"


def start_server_sh(tmp_path: Path, command: list, taken_port: int, taken_times: int, tries: int = 5):
    """server.sh as srun runs it on a node, with a $PYTHON whose free_port answers `taken_port` (held by the test)
    the first `taken_times` times: the port another process took between the ask and the server's bind."""
    import os
    import sys

    (tmp_path / "logs" / "addresses").mkdir(parents=True)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\nif [[ "$*" == *free_port* ]]; then n=$(cat {tmp_path}/asked 2>/dev/null || echo 0)\n'
                    f'  echo $((n + 1)) >{tmp_path}/asked\n'
                    f'  if ((n < {taken_times})); then echo {taken_port}; exit 0; fi\nfi\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    (tmp_path / "bin").mkdir()  # no Slurm controller here: scontrol (if installed) would wait for one
    (tmp_path / "bin" / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "scontrol").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "RUN_DIR": str(tmp_path), "PYTHON": str(fake), "SLURMD_NODENAME": "127.0.0.1",
           "MA_INDEX": "0", "MA_PORT_TRIES": str(tries), "TMPDIR": str(tmp_path),
           "PYTHONPATH": str(LIB.parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(tmp_path / "server0.log", "wb")
    return subprocess.Popen(["bash", str(SERVER_SH), *command], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_a_server_over_several_nodes_is_reported_from_its_rank_logs(tmp_path):
    """A server spanning nodes writes one log per rank (srun --output=...server<i>.rank%t.log); the job's failure
    line takes the error from the rank that has one, naming its log."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "server0.log").write_text("srun: launching server0\n")
    (tmp_path / "logs" / "server0.rank0.log").write_text("loading weights\n")
    (tmp_path / "logs" / "server0.rank1.log").write_text("torch.OutOfMemoryError: CUDA out of memory\n")
    r = subprocess.run(["bash", "-c", f'source "{LIB}"; ma_last_error "$RUN_DIR/logs/server0.log"'],
                       capture_output=True, text=True, env={"RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       timeout=30)
    assert r.stdout.strip() == "logs/server0.rank1.log: torch.OutOfMemoryError: CUDA out of memory", r.stderr
    (tmp_path / "logs" / "server0.rank1.log").write_text("ok\n")
    r = subprocess.run(["bash", "-c", f'source "{LIB}"; ma_last_error "$RUN_DIR/logs/server0.log"'],
                       capture_output=True, text=True, env={"RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       timeout=30)
    assert r.stdout.strip() == "srun: launching server0"  # no error line anywhere: the main log's last line


def test_a_servers_start_up_limit_counts_from_its_own_latest_start(tmp_path):
    """launch.startup_timeout per server, from its latest (re)start (server.sh writes addresses/<name>.started),
    not from the job's first wait: a server started again late still gets the whole limit."""
    import time

    (tmp_path / "logs" / "addresses").mkdir(parents=True)
    (tmp_path / "logs" / "addresses" / "server0.started").write_text(f"{int(time.time())}\n")
    script = (f'source "{LIB}"; sleep 30 & MA_PID[server0]=$!; MA_LOG[server0]="$RUN_DIR/logs/server0.log"; '
              'MA_NODE[server0]=vm; SECONDS=1000; ma_wait_healthy server0 3 0')
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                       env={"RUN_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    took = time.monotonic() - t0
    assert r.returncode == 1 and "component server0 on vm not healthy 3s after it started" in r.stderr, r.stderr
    assert took >= 2, took  # counted from its start, not from the job's t0 1000 s ago (which failed at once)


def test_server_sh_starts_again_on_another_port_when_its_port_was_taken(tmp_path):
    """The free-port-then-bind window of the job script: the server's first port is taken before it binds it;
    server.sh starts it again on another, rewrites the address the job waits on, and the server serves."""
    import os
    import signal
    import socket
    import sys
    import time
    import urllib.request

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    cmd = [sys.executable, "-m", "http.server", "--bind", "__HOST__", "__PORT__", "--directory", str(tmp_path)]
    p = start_server_sh(tmp_path, cmd, taken, taken_times=2)
    try:
        addr_file = tmp_path / "logs" / "addresses" / "server0"
        body = None
        for _ in range(300):  # at most 30 s
            assert p.poll() is None, (tmp_path / "server0.log").read_text()
            addr = addr_file.read_text().strip() if addr_file.exists() else ""
            assert not addr.endswith(f":{taken}")  # never published at the port another process holds
            if addr:
                try:
                    body = urllib.request.urlopen(f"http://{addr}/logs/", timeout=2).read()
                    break
                except OSError:
                    pass
            time.sleep(0.1)
        assert body is not None and b"addresses" in body
        log = (tmp_path / "server0.log").read_text()
        assert log.count(f"port {taken} was taken before it bound it") == 2 and "(try 3 of 5)" in log
        assert "Address already in use" in log  # the server's own words still reach the step's log
    finally:
        os.killpg(p.pid, signal.SIGTERM)  # as srun signals the step
        rc = p.wait(timeout=30)
        holder.close()
    assert rc != 0 and "try 4" not in (tmp_path / "server0.log").read_text()  # a signal is no reason to retry
    assert not list(tmp_path.glob("ma_server0_*"))  # its scratch file is gone


def test_server_sh_gives_up_after_its_tries_and_never_retries_other_failures(tmp_path):
    import socket
    import sys

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        serve = [sys.executable, "-m", "http.server", "--bind", "__HOST__", "__PORT__"]
        p = start_server_sh(tmp_path / "a", serve, taken, taken_times=99, tries=2)
        assert p.wait(timeout=60) != 0
        log = (tmp_path / "a" / "server0.log").read_text()
        assert "(try 2 of 2)" in log and "try 3" not in log and log.count("was taken before it bound it") == 1
        crash = [sys.executable, "-c", "import sys; print('bad model'); sys.exit(3)", "__PORT__"]
        p = start_server_sh(tmp_path / "b", crash, taken, taken_times=0)
        assert p.wait(timeout=60) == 3
        log = (tmp_path / "b" / "server0.log").read_text()
        assert "bad model" in log and "try 2" not in log
        # once it listened (published), its end is the step's end, whatever it said on the way
        late = [sys.executable, "-c", "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', "
                "int(sys.argv[1]))); s.listen(); print('Address already in use (a log line)', flush=True); "
                "time.sleep(2.5); sys.exit(4)", "__PORT__"]
        p = start_server_sh(tmp_path / "c", late, taken, taken_times=0)
        assert p.wait(timeout=60) == 4
        log = (tmp_path / "c" / "server0.log").read_text()
        assert "(published)" in log and "try 2" not in log
    finally:
        holder.close()
