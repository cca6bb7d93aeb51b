"""The Slurm job's trainer rendezvous without a port chosen in advance (launch/slurm/job.sbatch): rank 0's store
binds a port the kernel picks and publishes it in MEGA_ASYNC_MASTER_PORT_FILE; the other ranks wait for it. Before,
the batch script asked the node for a free port and the ranks bound it seconds later (after importing torch and
Megatron), a window in which another process could take it and fail the job."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mega_async.trainer.parallel import PORT_FILE_ENV, published_store

ROOT = Path(__file__).resolve().parents[2]
RANK = """
import torch, torch.distributed as dist
from mega_async.trainer.parallel import init_distributed
init_distributed("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print("rank", dist.get_rank(), "of", dist.get_world_size(), "sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""


def test_two_srun_ranks_meet_through_the_port_file(tmp_path):
    port_file = tmp_path / "master_port.7.0"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.update(SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1", PYTHONPATH=str(ROOT), **{PORT_FILE_ENV: str(port_file)})
    procs = [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "SLURM_PROCID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (1, 0)]  # rank 1 first: it waits for the file
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 1 of 2 sum 3" in outs[0] and "rank 0 of 2 sum 3" in outs[1]
    port = int(port_file.read_text())
    assert 0 < port < 65536 and not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


def test_a_rank_without_its_port_says_where_it_waited(tmp_path):
    f = tmp_path / "master_port.7.0"
    with pytest.raises(RuntimeError, match=r"rank 1: rank 0 did not publish its rendezvous port in .*master_port.7.0 "
                                           r"within 0.5s .*driver.log"):
        published_store("127.0.0.1", str(f), rank=1, world=2, timeout_s=0.5)
    f.write_text("http://x\n")
    with pytest.raises(RuntimeError, match="is not a port; rank 0 writes its port there"):
        published_store("127.0.0.1", str(f), rank=1, world=2, timeout_s=5)


def test_a_bad_wait_setting_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGA_ASYNC_MASTER_PORT_WAIT", "soon")
    with pytest.raises(RuntimeError, match="MEGA_ASYNC_MASTER_PORT_WAIT='soon': give the seconds"):
        published_store("127.0.0.1", str(tmp_path / "p"), rank=1, world=2)
