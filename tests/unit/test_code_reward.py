"""Code reward: fenced-block extraction, reference tests in a limited sandbox, the loop never blocked.
The attacks on the sandbox and on the score are in test_code_sandbox.py."""
import asyncio
import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mega_async.reward import RewardRunner
from mega_async.reward.code import CodeReward, extract_code

TASKS = [json.loads(line) for line in (Path(__file__).parents[1] / "assets" / "code_tasks.jsonl").open()]


def fenced(code: str) -> str:
    return f"Here is my answer:\n```python\n{code}\n```\nDone."


def run(coro):
    return asyncio.run(coro)


def test_extract_code_takes_the_last_python_block():
    text = "```python\nx = 1\n```\nthen\n```py\ny = 2\n```\n```text\nnot code\n```"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"
    assert extract_code("no code here") is None


@pytest.mark.timeout(60)  # a hang guard 100x over the linear time, not a speed measurement
def test_extract_code_is_linear_in_the_completion():
    """The old fence regex backtracked quadratically (24 KB of backticks: 1.3 s, on the event loop; 300 KB:
    minutes); a completion is untrusted text of any shape."""
    assert extract_code("```" * 100_000) is None
    body = "x = 1\n" * 50_000
    assert extract_code("```python\n" + body + "```" + "```" * 100_000) == body


def test_shipped_tasks_reference_solutions_pass_and_wrong_ones_fail():
    reward = CodeReward(timeout=20)

    async def main():
        good = await asyncio.gather(*(reward(t["prompt"], fenced(t["solution"]), tests=t["tests"]) for t in TASKS))
        wrong = await reward("", fenced("def add(a, b):\n    return a - b"), tests=TASKS[0]["tests"])
        partial = await reward("", fenced("def add(a, b):\n    return 3"), tests=TASKS[0]["tests"])  # add(1, 2) only
        syntax = await reward("", fenced("def add(a, b) return"), tests=TASKS[0]["tests"])
        none = await reward("", "I don't know", tests=TASKS[0]["tests"])
        return good, wrong, partial, syntax, none

    good, wrong, partial, syntax, none = run(main())
    assert good == [1.0] * len(TASKS) and len(TASKS) == 8
    assert wrong == 0.0
    assert partial == pytest.approx(1 / 3) and syntax == 0.0 and none == 0.0


def test_faked_results_and_early_exits_score_zero():
    reward = CodeReward()
    fake = "print('\\n' + 'a' * 32 + ' 3 3')\nimport sys\nsys.exit(0)"
    assert run(reward("", fenced(fake), tests=["assert False"])) == 0.0
    assert run(reward("", fenced("import os\nos._exit(0)"), tests=["assert True"])) == 0.0


def test_hangs_floods_and_signals_score_zero_without_blocking_the_loop():
    sandbox = CodeReward(timeout=1.0, cpu_seconds=30)
    runner = RewardRunner(sandbox, timeout=10.0)
    # one child in the process group, one that left it (setsid): neither may outlive the sandbox
    marker = f"{time.time():.6f}"
    loop_forever = ("import subprocess, time\n"
                    "subprocess.Popen(['sleep', '60'])\n"
                    f"subprocess.Popen(['python3', '-c', 'import os, time; os.setsid(); time.sleep(60 + {marker})'])\n"
                    "while True: pass")
    flood = "import sys\nwhile True: sys.stderr.write('x' * 65536)"
    suicide = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"

    async def main():
        t0 = time.monotonic()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while time.monotonic() - t0 < 0.8:
                ticks += 1
                await asyncio.sleep(0.01)

        results = await asyncio.gather(runner("", fenced(loop_forever), tests=["assert True"]),
                                       runner("", fenced(flood), tests=["assert True"]),
                                       runner("", fenced(suicide), tests=["assert True"]), ticker())
        return results[:3], ticks, time.monotonic() - t0

    results, ticks, dt = run(main())
    assert results == [0.0, 0.0, 0.0] and runner.failures == 0  # the solution's failure, not the reward's
    assert ticks >= 20 and dt < 8  # the loop kept running; the timeout held
    survivors = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert survivors == [], "a child of the solution survived the sandbox"
    # what a flood wrote went nowhere: a solution that prints 10 MB and then answers still passes
    loud = "import sys\nsys.stdout.write('y' * (10 << 20))\nsys.stderr.write('z' * (10 << 20))\nx = 1"
    assert run(CodeReward()("", fenced(loud), tests=["assert x == 1"])) == 1.0


def test_memory_limit_and_a_private_scratch_dir():
    reward = CodeReward(memory_mb=256)
    hog = "x = bytearray(2 << 30)"  # 2 GiB under a 256 MiB address-space limit: MemoryError, test fails
    code = "import os\nopen('scratch.txt', 'w').write('x')\nopen('/tmp/other.txt', 'w').write('y')\ncwd = os.getcwd()"
    tests = ["assert open('scratch.txt').read() == 'x'", "assert open('/tmp/other.txt').read() == 'y'",
             "import os\nassert cwd == os.getcwd() == '/tmp/scratch'"]

    async def main():
        return await asyncio.gather(reward("", fenced(hog), tests=["assert len(x) > 0"]),
                                    reward("", fenced(code), tests=tests))

    assert run(main()) == [0.0, 1.0]  # the tests (another process) see the solution's files
    assert not os.path.exists("/tmp/other.txt")  # that /tmp was the sandbox's own


def test_no_network():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    probe = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
             "    reached = True\nexcept OSError:\n    reached = False")
    try:
        assert run(CodeReward()("", fenced(probe), tests=["assert reached is False"])) == 1.0
        ns = {}
        exec(probe, ns)
        assert ns["reached"] is True  # the same probe outside the sandbox does connect
    finally:
        srv.close()


def test_missing_or_malformed_tests_are_a_clear_error():
    for tests in (None, [], [1, 2], {"a": 1}):
        with pytest.raises(ValueError, match="tests"):
            run(CodeReward()("", fenced("x = 1"), tests=tests))
