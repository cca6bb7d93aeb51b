"""Run under torchrun: vocab-parallel logprobs/entropy and their gradients equal a full-vocabulary reference."""
import torch, sys
import torch.distributed as dist
from mega_async.trainer.parallel import init_parallel_state, parse_allocation
from megatron.core import parallel_state as mpu
init_parallel_state(parse_allocation(sys.argv[1]).train)
from mega_async.trainer.logprobs import vocab_parallel_logprobs
g = torch.Generator().manual_seed(0)
full = torch.randn(6, 64, generator=g); labels = torch.randint(0, 64, (6,), generator=g)
tp, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
x = full.chunk(tp, -1)[r].clone().requires_grad_(True)
lp, ent = vocab_parallel_logprobs(x, labels, temperature=0.7, with_entropy=True)
ref_all = torch.log_softmax(full / 0.7, -1)
ref = ref_all.gather(1, labels[:, None]).squeeze(1); ref_ent = -(ref_all.exp() * ref_all).sum(-1)
(lp.sum() + ent.sum()).backward()
fr = full.clone().requires_grad_(True); ra = torch.log_softmax(fr / 0.7, -1)
(ra.gather(1, labels[:, None]).sum() - (ra.exp() * ra).sum()).backward()
assert max((lp - ref).abs().max().item(), (ent - ref_ent).abs().max().item(), (x.grad - fr.grad.chunk(tp, -1)[r]).abs().max().item()) < 1e-5
print("ok", r, (lp - ref).abs().max().item(), (ent - ref_ent).abs().max().item(), (x.grad - fr.grad.chunk(tp, -1)[r]).abs().max().item())

from mega_async.trainer.parallel import destroy_parallel_state
destroy_parallel_state()
