"""A port from free_port() can be taken by another process before the process it was picked for binds it (the
window is seconds for a server that imports torch first): every place that listens at such a port tries a new
one when the bind says so, a bounded number of times; any other failure is not retried."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mega_async.utils.comm import lost_the_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("log,taken", [
    ("OSError: [Errno 98] Address already in use", True),  # the embedded server (Python's bind)
    ("Error starting router: Failed to bind the HTTP listener on 127.0.0.1:1: Address already in use (os error 98)",
     True),  # smg
    ("[Errno 98] error while attempting to bind on address ('127.0.0.1', 30000): address already in use", True),
    ("port: 48395, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use", True),  # TCPStore
    ("ERROR Port is already in use. dist_init_port=39000 port_base=39001 detokenizer_port=39002", True),  # SGLang
    ("OSError: [Errno 99] Cannot assign requested address", False),
    ("RuntimeError: model weights not found", False),
])
def test_what_says_the_port_was_taken(log, taken):
    assert lost_the_port(log) is taken


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_one_rank_group_of_a_plain_process_tries_another_port():
    r = run("""
        import socket
        import torch.distributed as dist
        import mega_async.utils.comm as comm
        from mega_async.trainer.parallel import init_distributed

        held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen()
        given, real = iter([held.getsockname()[1]] * 2), comm.free_port
        comm.free_port = lambda host="127.0.0.1": next(given, None) or real(host)
        init_distributed("gloo")  # two ports taken, the third binds
        assert dist.is_initialized() and next(given, None) is None
        dist.destroy_process_group()
        given = iter([held.getsockname()[1]] * 3)
        try:
            init_distributed("gloo")
        except RuntimeError as e:
            assert "address already in use" in str(e), e
            print("refused after 3")
    """)
    assert r.returncode == 0 and "refused after 3" in r.stdout, r.stderr[-3000:]
