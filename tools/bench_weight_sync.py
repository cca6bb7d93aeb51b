"""Weight-sync throughput: a full distributed_sync push into an embedded server against a raw gloo
broadcast of the same buckets (same sizes, same order) to a bare receiver, measured in the same run.

    python tools/bench_weight_sync.py [--layouts megatron:d1,megatron:t2,megatron:d2e2] [--repeats 3]

Model: a Qwen3-MoE from the tiny card widened to about 100 MB (fp32). Per layout it prints bytes/s of
both, their ratio (sync / raw, aim >= 0.8) and the sync's phases (gather, bucket, broadcast, server
load), and appends a JSON line to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECEIVER = """
import datetime, json, sys, torch, torch.distributed as dist
from mega_async.utils.comm import init_custom_process_group
addr, port, sizes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
pg = init_custom_process_group("gloo", f"tcp://{addr}:{port}", 2, 1, "raw", datetime.timedelta(seconds=120))
bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
for _ in range(int(sys.argv[4])):
    for b in bufs:
        dist.broadcast(b, src=0, group=pg)
dist.destroy_process_group(pg)
"""


def make_model(root: Path) -> Path:
    from mega_async.bridge.model_cards import TINY_MOE, derive_card

    return derive_card(TINY_MOE, root / "bench-moe", seed=0, hidden_size=256, moe_intermediate_size=256,
                       intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                       num_hidden_layers=8, num_experts=16, num_local_experts=16)


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: one layout, timed pushes, then the raw broadcast of the same buckets (rank 0)."""
    import torch
    import torch.distributed as dist

    from mega_async.utils.comm import free_port, init_custom_process_group
    from mega_async.inference.client import SGLangClient
    from mega_async.inference.servers import ServerLauncher, ServerSpec
    from mega_async.trainer.model import build_model
    from mega_async.trainer.parallel import destroy_parallel_state
    from mega_async.trainer.sync import distributed_sync, RolloutSide
    from mega_async.api.types import WeightVersion

    models = build_model(args.model, args.layout, load_weights=True)
    rank0 = dist.get_rank() == 0
    launcher = None
    addresses = None
    if rank0:
        launcher = ServerLauncher(ServerSpec("embedded", args.model, num_threads=1), log_dir=args.server_logs)
        addresses = launcher.start()
    box = [addresses]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    version = WeightVersion()
    rollout = RolloutSide(SGLangClient(box[0], version=version)) if rank0 else None
    sync = distributed_sync(models, version, rollout, box[0], bucket_bytes=args.bucket_bytes, timeout=120)
    try:
        sync.push()  # warm-up
        runs = []
        for _ in range(args.repeats):
            runs.append(sync.push())
        sizes = []
        if sync.transport.resharder.is_stage_head and rank0:
            sizes = [b.nbytes for b in sync.transport.resharder.buckets()]
        else:
            for _ in sync.transport.resharder.buckets():
                pass
        if rank0:
            port = free_port()
            recv = subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(port), json.dumps(sizes),
                                     str(args.repeats + 1)], env={**os.environ, "PYTHONPATH": str(ROOT)})
            pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "raw")
            bufs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in sizes]
            raw = []
            for i in range(args.repeats + 1):
                t0 = time.perf_counter()
                for b in bufs:
                    dist.broadcast(b, src=0, group=pg)
                if i:
                    raw.append(time.perf_counter() - t0)
            recv.wait(60)
            dist.destroy_process_group(pg)
            nbytes = sum(sizes)
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            total = med([r["sync/push_s"] for r in runs])
            row = {"layout": args.layout, "bytes": nbytes, "buckets": len(sizes),
                   "sync_GBps": nbytes / total / 1e9, "raw_GBps": nbytes / med(raw) / 1e9,
                   "ratio": med(raw) / total, "push_s": total,
                   **{k.replace("sync/", "") + "": med([r[k] for r in runs])
                      for k in ("sync/gather_s", "sync/bucket_s", "sync/broadcast_s", "sync/server_s")}}
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        sync.close()
        if launcher is not None:
            launcher.stop()
        destroy_parallel_state()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="megatron:d1,megatron:t2,megatron:d2e2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-bytes", type=int, default=32 << 20)
    ap.add_argument("--out", default=None, help="JSONL results (default: a temporary file)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--server-logs", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    from mega_async.api.allocation import parse_allocation
    from mega_async.utils.comm import free_port

    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_"))
    out = args.out or str(tmp / "results.jsonl")
    model = make_model(tmp)
    for layout in args.layouts.split(","):
        n = parse_allocation(layout).train.world_size
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", f"--master-port={free_port()}",
               __file__, "--worker", "--model", str(model), "--layout", layout, "--out", out, "--server-logs",
               str(tmp / "logs" / layout.replace(":", "_")), "--repeats", str(args.repeats),
               "--bucket-bytes", str(args.bucket_bytes)]
        r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True)
        if r.returncode:
            print(f"{layout}: failed\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
    print(f"{'layout':16} {'MB':>6} {'buckets':>7} {'sync GB/s':>9} {'raw GB/s':>8} {'ratio':>6} "
          f"{'gather s':>8} {'bucket s':>8} {'bcast s':>8} {'server s':>8}")
    for line in Path(out).read_text().splitlines():
        r = json.loads(line)
        print(f"{r['layout']:16} {r['bytes'] / 1e6:6.1f} {r['buckets']:7d} {r['sync_GBps']:9.3f} {r['raw_GBps']:8.3f} "
              f"{r['ratio']:6.2f} {r['gather_s']:8.3f} {r['bucket_s']:8.3f} {r['broadcast_s']:8.3f} {r['server_s']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
