"""trainer/cpu.py runs Megatron's `torch.compile`d fusions eagerly on a CPU, whichever imports Megatron first."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import sys, torch
real = torch.compile
{first}
from mega_async.trainer.cpu import apply_cpu_patches
assert apply_cpu_patches()
assert torch.compile is real, "torch.compile is left as it was"
from megatron.core import jit
from megatron.core.transformer.moe import router, experts
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer.torch_norm import L2Norm
compiled = [f for f in (router.TopKRouter._apply_expert_bias, fused_bias_swiglu.swiglu, L2Norm._norm)
            if hasattr(f, "_torchdynamo_orig_callable")]
assert not compiled, compiled
assert jit.jit_fuser is jit.noop_decorator and experts.jit_fuser(len) is len
x = torch.randn(4, 6)
assert torch.equal(fused_bias_swiglu.swiglu(x), torch.nn.functional.silu(x[:, :3]) * x[:, 3:])
print("eager")
"""


def _run(first: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHECK.format(first=first)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "",
                                                      "PYTHONPATH": str(ROOT)})


def test_megatron_imported_by_the_patches_never_compiles():
    r = _run("")
    assert r.returncode == 0 and r.stdout.strip() == "eager", r.stderr[-3000:]


def test_megatron_imported_before_the_patches_is_unwrapped():
    r = _run("import megatron.core.transformer.moe.router, megatron.core.transformer.moe.experts, "
             "megatron.core.transformer.torch_norm")
    assert r.returncode == 0 and r.stdout.strip() == "eager", r.stderr[-3000:]
