"""mega_async.launch.pinning: CPU lists, the equal split, and pinning every thread of real child processes."""
import os
import subprocess
import sys
import time

import pytest

from mega_async.cli import main as cli
from mega_async.launch import pinning

CPUS = sorted(os.sched_getaffinity(0))


def test_parse_and_split():
    assert pinning.parse_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert pinning.parse_cpus("3,1,1") == [1, 3]
    for bad in ("", "a", "3-1", "1-", "-2"):
        with pytest.raises(ValueError, match="is not N or N-M"):
            pinning.parse_cpus(bad)
    assert pinning.split_cpus([3, 2, 1, 0]) == ([0, 1], [2, 3])
    for bad in ([0], [0, 1, 2]):
        with pytest.raises(ValueError, match="two equal halves"):
            pinning.split_cpus(bad)


def child(*marker: str) -> subprocess.Popen:
    """A Python child with three threads (marker words end up in its command line)."""
    code = ("import threading, time\n"
            "for _ in range(2): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
            "print('up', flush=True); time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", code, *marker], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


def affinities(pid: int) -> list[set]:
    return [os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_server_pinner_pins_every_thread_of_server_children_only():
    server, other = child("mega_async.server", "--port", "1"), child("other")
    try:
        with pinning.ServerPinner([CPUS[0]], interval=0.05) as pin:
            deadline = time.monotonic() + 10
            while server.pid not in pin.pinned and time.monotonic() < deadline:
                time.sleep(0.05)
        assert pin.pinned.get(server.pid) == 3
        assert affinities(server.pid) == [{CPUS[0]}] * 3
        assert all(a == set(CPUS) for a in affinities(other.pid))  # not a server: left alone
    finally:
        for p in (server, other):
            p.kill()
            p.wait()


def test_command_line_refuses_odd_sets_and_missing_command(capsys):
    assert cli(["pin", "--cpus", "0-2", "--", "train"]) == 2
    assert "two equal halves" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["pin", "--cpus", "0-1", "--"])
