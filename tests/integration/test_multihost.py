"""Several hosts on one machine (tests/integration/netns_hosts.py: a network namespace per node, each with its
own address on a private bridge and its own host name), so nothing runs on 127.0.0.1 across nodes:

- a real Slurm on three namespace nodes (slurmctld + one slurmd per node, NodeAddr = the node's address)
  runs the tiny GSM8K job through `mega-async launch slurm` and sbatch: the embedded server on node 0
  bound to its node's address, two trainer ranks on nodes 1 and 2 rendezvousing at node 1's address,
  the driver on node 1, the weight-update group from node 1 to the server on node 0;
- torchrun on two nodes whose host names resolve to 127.0.1.1 (Debian's /etc/hosts): two pipeline stages,
  the driver starting the server on its node; each stage head builds a weight-update group with it;
- the trainer's gloo group and a weight-update group across two nodes whose host names do not resolve.

Every run is the tiny CPU config for 2 steps. Needs root (namespaces), iproute2, and for the Slurm test
slurm-wlm + munge (.ci/slurm_up.sh installs and starts them). Nothing is mocked."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mega_async.bridge.model_cards import TINY_MOE, init_random_weights
from tests.integration import netns_hosts
from tests.integration.netns_hosts import Hosts, SlurmOnHosts

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "gsm8k_tiny_cpu.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def namespaces():
    """Skip (with the reason) where network namespaces cannot be made: not root, no iproute2."""
    why = netns_hosts.unavailable()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return init_random_weights(TINY_MOE, tmp_path_factory.mktemp("multihost") / "moe", seed=3)


def steps(run: Path) -> list[dict]:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def wait_all(procs: list, timeout: float) -> list[tuple]:
    """(exit code, stdout, stderr) of each process; once one fails (or at `timeout`) the others are killed,
    so a rank waiting for a peer that is gone does not hold the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outs = [p.communicate() for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1"}


@pytest.mark.parametrize("kind", ["default", "weights"])
def test_gloo_groups_across_hosts_whose_names_do_not_resolve(tmp_path, kind):
    """Gloo binds to the host name's address and falls back to 127.0.0.1 when the name does not resolve:
    the other node's rank was refused ("connectFullMesh failed ... remote=[127.0.0.1]"). Both the trainer's
    group and a weight-update group now use the interface on the route to the rendezvous."""
    with Hosts(2, tmp_path) as hosts:
        a, b = hosts.nodes
        procs = []
        for rank, node in enumerate((a, b)):
            env = {**_env(), "MASTER_ADDR": a.address, "MASTER_PORT": "29517", "RANK": str(rank), "WORLD_SIZE": "2"}
            env.pop("GLOO_SOCKET_IFNAME", None)
            procs.append(hosts.popen(node, [sys.executable, str(ROOT / "tests/integration/multihost_gloo.py"), kind],
                                     env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = wait_all(procs, 180)
        assert [code for code, _, _ in results] == [0, 0], "\n----\n".join(out + err[-3000:] for _, out, err in results)
        outs = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    expect = [3.0] if kind == "default" else [0.0, 1.0, 2.0, 3.0]
    assert [o["result"] for o in outs] == [expect, expect]
    assert [o["ifname"] for o in outs] == ["eth0", "eth0"]
    # a multi-host run's servers bind to the node's address on the route to MASTER_ADDR
    assert [o["node_address"] for o in outs] == [a.address, b.address]


@pytest.mark.timeout(900)
def test_slurm_job_on_three_hosts(tmp_path, model):
    r = subprocess.run(["bash", str(ROOT / ".ci" / "slurm_up.sh")], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr  # slurm-wlm and munge installed, munged running
    with Hosts(3, tmp_path) as hosts:
        slurm = SlurmOnHosts(hosts, tmp_path / "slurm")
        slurm.start()
        n0, n1, n2 = hosts.nodes
        r = slurm.cmd([sys.executable, "-m", "mega_async.cli", "launch", "slurm", "-c", str(CONFIG), "--nodes", "3",
                       "--gpus-per-node", "1", "--time", "20", "parallel.allocation=sglang:d1+megatron:d2",
                       f"logging.root_dir={tmp_path / 'runs'}", f"model.path={model}"], cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "trainer: 2 ranks (1 per node) on nodes 1-2; driver = rank 0 on node 1" in r.stdout
        job = r.stdout.split("submitted job ")[1].split(":")[0]
        run = tmp_path / "runs" / "gsm8k_tiny_cpu" / "run0"
        logs = run / "logs"
        state, code = slurm.wait_done(job, 600)

        def show(name: str) -> str:
            f = logs / name
            return f.read_text(errors="replace") if f.exists() else ""

        assert (state, code) == ("COMPLETED", "0:0"), (show("job.log") + show("driver.log")[-3000:]
                                                       + show("trainer_rank1.log")[-2000:] + slurm.logs())
        job_log, driver, server = show("job.log"), show("driver.log"), show("server0.log")
        rank1 = show("trainer_rank1.log")
        assert [x["version"] for x in steps(run)] == [1, 2]
        assert (run / "final_hf" / "config.json").exists()
        # the server on node 0 at its node's address (bound there: --host is that address)
        assert re.search(rf"server0 healthy at {re.escape(n0.address)}:\d+", job_log), job_log
        assert f"server 0 node rank 0 on {n0.address} port" in server
        # trainer ranks on nodes 1 and 2, rendezvous at node 1's address; the driver is rank 0 on node 1
        assert f"rank 0/2 on {n1.hostname} (MASTER_ADDR={n1.address} " in driver
        assert f"rank 1/2 on {n2.hostname} (MASTER_ADDR={n1.address} " in rank1
        assert "training done: 2 steps" in driver
        # the weight-update group across hosts: its store on the trainer head, joined by the server on node 0
        assert re.search(rf"weight-update group mega_async_pp0_\d+: trainer \+ 1 server ranks at "
                         rf"{re.escape(n1.address)}:\d+ \(gloo\)", driver), driver[-3000:]
        assert re.search(rf"joining weight group 'mega_async_pp0_\d+': rank 1 of 2 at {re.escape(n1.address)}:",
                         server), server[-3000:]
        assert "training finished" in job_log
        # nothing of the job is left on any node (only the Slurm daemons)
        daemons = {"slurmctld", "slurmd", "slurmstepd", "slurmscriptd"}
        left = []
        for node in hosts.nodes:
            for pid in hosts.pids(node):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                except OSError:
                    continue
                if str(tmp_path) in cmd and not any(d in cmd.split(" ")[0] for d in daemons):
                    left.append(f"{node.hostname}: {cmd}")
        assert not left, left


@pytest.mark.timeout(900)
def test_torchrun_two_hosts_pipeline_stages(tmp_path, model):
    """torchrun on each node (--nnodes 2 --node-rank i, MASTER_ADDR = node 0's address), host names resolving
    to 127.0.1.1: the driver starts the server on its node at the node's address (was the host name's
    127.0.1.1, which the stage head on node 1 cannot reach), both stage heads build a weight-update group
    with it, and two steps complete."""
    with Hosts(2, tmp_path, hosts_files=True) as hosts:
        a, b = hosts.nodes
        procs, outs = [], []
        for node in (a, b):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node.index}",
                   "--nproc-per-node=1", f"--master-addr={a.address}", "--master-port=29518",
                   "-m", "mega_async.cli", "train", "-c", str(CONFIG), "parallel.allocation=sglang:d1+megatron:p2",
                   f"logging.root_dir={tmp_path / 'runs'}", f"model.path={model}"]
            out = open(tmp_path / f"{node.hostname}.log", "w")
            outs.append(out)
            env = _env()
            env.pop("GLOO_SOCKET_IFNAME", None)
            procs.append(hosts.popen(node, cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for out in outs:
                out.close()
        log_a, log_b = ((tmp_path / f"{n.hostname}.log").read_text(errors="replace") for n in (a, b))
        assert codes == [0, 0], log_a[-3000:] + "\n----\n" + log_b[-3000:]
    run = tmp_path / "runs" / "gsm8k_tiny_cpu" / "run0"
    assert [x["version"] for x in steps(run)] == [1, 2]
    assert "training done: 2 steps" in log_a
    # both stages' weight-update groups: pp0's store on node 0, pp1's on node 1, the server at node 0's address
    assert re.search(rf"weight-update group mega_async_pp0_\d+: trainer \+ 1 server ranks at {re.escape(a.address)}:",
                     log_a), log_a[-3000:]
    assert re.search(rf"weight-update group mega_async_pp1_\d+: trainer \+ 1 server ranks at {re.escape(b.address)}:",
                     log_b), log_b[-3000:]
    assert re.search(rf"starting server 0: .* --host {re.escape(a.address)} ", log_a), log_a[-3000:]
    assert f"on http://{a.address}:" in (run / "server_logs" / "server0.log").read_text(errors="replace")
