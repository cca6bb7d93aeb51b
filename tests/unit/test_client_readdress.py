"""SGLangClient.readdress (the run started a server again at another port) with RouterLauncher.readdress, adopt
(a later pipeline stage's head learns the members rank 0 names), comm.port_free, which tells a restart that its
port was taken, and comm.listens, which tells whose listener holds a port."""
import socket

import pytest

from mega_async.utils.comm import free_port, listens, port_free
from mega_async.inference.client import SGLangClient


def test_a_moved_server_keeps_its_state_and_is_reached_at_its_new_address():
    c = SGLangClient(["127.0.0.1:1001", "127.0.0.1:1002"])
    moved = c.servers[1]
    moved.healthy, moved.down = False, "connection refused"
    c.readdress("127.0.0.1:1002", "127.0.0.1:2002")
    assert c.addresses == ["http://127.0.0.1:1001", "http://127.0.0.1:2002"]
    assert c.servers[1] is moved and not moved.healthy  # the same server, still out until it serves
    assert c._named(["127.0.0.1:2002"]) == [moved]
    with pytest.raises(ValueError, match="is not one of this client's servers"):
        c._named(["127.0.0.1:1002"])
    with pytest.raises(ValueError, match="already one of this client's servers"):
        c.readdress("127.0.0.1:1001", "http://127.0.0.1:2002")
    with pytest.raises(ValueError, match="is not one of this client's servers"):
        c.readdress("127.0.0.1:9", "127.0.0.1:3003")


def test_adopt_adds_only_the_servers_it_does_not_know():
    c = SGLangClient(["127.0.0.1:1001"])
    c.adopt(["http://127.0.0.1:1001", "127.0.0.1:2002", "127.0.0.1:2002/"])
    assert c.addresses == ["http://127.0.0.1:1001", "http://127.0.0.1:2002"]
    assert [s.address for s in c._named(["127.0.0.1:2002"])] == ["http://127.0.0.1:2002"]
    c.adopt([])
    assert len(c.servers) == 2


def test_a_later_stage_head_takes_a_moved_server_to_its_new_address_instead_of_keeping_both():
    """Rank 0's client saw server 2 started again at another port, twice; a later pipeline stage head's client
    (which still knows it at its first address) gets rank 0's members and `moved`, and keeps it once."""
    rank0 = SGLangClient(["127.0.0.1:1001", "127.0.0.1:1002"])
    rank0.readdress("127.0.0.1:1002", "127.0.0.1:2002")
    rank0.readdress("127.0.0.1:2002", "127.0.0.1:3002")
    assert rank0.moved == {"http://127.0.0.1:1002": "http://127.0.0.1:3002",
                           "http://127.0.0.1:2002": "http://127.0.0.1:3002"}
    head = SGLangClient(["127.0.0.1:1001", "127.0.0.1:1002"])
    head.adopt(rank0.addresses, moved=rank0.moved)
    assert head.addresses == rank0.addresses == ["http://127.0.0.1:1001", "http://127.0.0.1:3002"]
    head.adopt(rank0.addresses, moved=rank0.moved)  # again: nothing changes
    assert head.addresses == rank0.addresses
    fresh = SGLangClient(["127.0.0.1:1001", "127.0.0.1:2002"])  # it knew the middle address
    fresh.adopt(rank0.addresses, moved=rank0.moved)
    assert fresh.addresses == rank0.addresses
    plain = SGLangClient(["127.0.0.1:1001", "127.0.0.1:1002"])
    plain.adopt(rank0.addresses)  # without `moved`: as before, both (what the fix is for)
    assert len(plain.servers) == 3


def test_port_free_sees_a_listener_but_not_a_closed_one():
    port = free_port()
    assert port_free("127.0.0.1", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not port_free("127.0.0.1", port)
    assert port_free("127.0.0.1", port)


def test_a_router_not_running_only_takes_the_moved_workers_address_for_its_next_start(tmp_path):
    """RouterLauncher.readdress on a router that is not running (ended and waiting for its supervised restart, or
    given up on): the worker list changes, nothing is started (its restarts stay the supervisor's to count)."""
    from mega_async.inference.router import RouterLauncher

    r = RouterLauncher(str(tmp_path / "no-smg"), ["127.0.0.1:1001", "http://127.0.0.1:1002"])
    r.readdress("http://127.0.0.1:1002/", "127.0.0.1:2002")
    assert r.workers == ["127.0.0.1:1001", "127.0.0.1:2002"] and r.proc is None
    with pytest.raises(ValueError, match="is not one of the router's workers"):
        r.readdress("127.0.0.1:1002", "127.0.0.1:3003")


def test_listens_tells_a_processs_own_listener_from_another_ones():
    """server.sh publishes an address only once the process it started (or a child) listens there."""
    import os
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert listens(port, os.getpid()) is False  # bound, not listening
        s.listen()
        assert listens(port, os.getpid()) is True
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert listens(port, other.pid) is False  # someone else's listener on the port
        finally:
            other.kill()
            other.wait()
    assert listens(port, os.getpid()) is False
