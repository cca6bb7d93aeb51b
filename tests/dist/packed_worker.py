"""Run under torchrun: a packed 1-D (THD) forward equals the per-sequence forward at any TP."""
import torch, sys
import torch.distributed as dist
from mega_async.trainer.model import build_model
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from mega_async.algo.packing import pack, seq_alignment
models = build_model(sys.argv[1], sys.argv[2], load_weights=True)
m = models[0]; m.eval()
tp = mpu.get_tensor_model_parallel_world_size()
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(1, 1000, (n,), generator=g) for n in (5, 11, 3, 8)]
p = pack(seqs, align=seq_alignment(tp, 1))
cu = p.cu_seqlens
psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=p.max_seqlen, max_seqlen_kv=p.max_seqlen)
with torch.no_grad():
    out = m(p.tokens[None], p.position_ids[None], None, packed_seq_params=psp)
    out = gather_from_tensor_model_parallel_region(out)[0]
    worst = 0
    for s, (a, n) in zip(seqs, zip(cu[:-1].tolist(), p.lengths)):
        L = s.numel(); Lp = -(-L // tp) * tp
        ids = torch.nn.functional.pad(s, (0, Lp - L))[None]
        ref = gather_from_tensor_model_parallel_region(m(ids, torch.arange(Lp)[None], None))[0]
        worst = max(worst, (out[a:a+n] - ref[:n]).abs().max().item())
assert worst < 1e-5, worst
print("ok", dist.get_rank(), "packed vs per-seq", worst)

from mega_async.trainer.parallel import destroy_parallel_state
destroy_parallel_state()
