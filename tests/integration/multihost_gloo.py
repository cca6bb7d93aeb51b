"""One rank of test_multihost's gloo check, run on a namespace "node": `default` builds the trainer's group
(init_distributed from MASTER_ADDR/RANK/WORLD_SIZE) and all-reduces; `weights` builds a weight-update
group as the sync and the server build it (init_custom_process_group, rank 0 hosting the store at
MASTER_ADDR) and broadcasts. Prints one JSON line: the results, GLOO_SOCKET_IFNAME and node_address()."""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from mega_async.utils.comm import destroy_custom_process_group, init_custom_process_group
from mega_async.inference.service import node_address

kind = sys.argv[1]
rank, master, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if kind == "default":
    from mega_async.trainer.parallel import init_distributed

    init_distributed("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    result = t.tolist()
    print("all-reduced; destroying", file=sys.stderr, flush=True)
    dist.destroy_process_group()
else:
    pg = init_custom_process_group("gloo", f"tcp://{master}:{port}", 2, rank, "mamh_weights",
                                   timeout=datetime.timedelta(seconds=60))
    t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    dist.broadcast(t, src=0, group=pg)
    result = t.tolist()
    print("broadcast; destroying", file=sys.stderr, flush=True)
    destroy_custom_process_group(pg)
print("destroyed", file=sys.stderr, flush=True)
print(json.dumps({"rank": rank, "result": result, "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                  "node_address": node_address()}), flush=True)
# skip the interpreter's teardown: torch's C++ statics of a store client whose store host has exited can
# abort at exit ("terminate called without an active exception", 1 run in ~10 here), after the work is done
os._exit(0)
