"""A pure-torch stand-in for `sgl_kernel` (SGLang's compiled kernels) that lets SGLang 0.5.23 serve on a CPU.

PyPI has no CPU build of sgl_kernel, yet SGLang imports it unconditionally on CPU and calls one function of it
without the AMX backend: `assign_req_to_token_pool_cpu` (`sglang/srt/mem_cache/allocation.py`, every extend). Every other
kernel SGLang's CPU path uses is gated on the AMX backend being available, which SGLang decides by probing
`torch.ops.sgl_kernel.convert_weight_packed`: this stand-in registers no torch op, so SGLang takes its torch
fallbacks (MoE through `moe_forward_native`, attention through `torch_native`). SGLang's CPU modules import more
names at module level (`copy_all_layer_kv_cache_cpu`, the speculative-decoding kernels ...) than it calls: any
other name imports as a kernel that raises NotImplementedError, naming itself, when it is called.

Only the real-engine launcher puts this directory on a server's PYTHONPATH (mega_async.inference.sglang.cpu).
"""
from __future__ import annotations

import torch

__version__ = "0.0.0+mega_async.cpu_stand_in"
IMPLEMENTED = ("assign_req_to_token_pool_cpu",)


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """In place: `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
    out_cache_loc[prefix[i]:prefix[i + 1]]`, prefix the running sum of `end_offset - start_offset`
    (sgl_kernel's CPU kernel and the `assign_req_to_token_pool` Triton kernel it replaces)."""
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: req_to_token of shape {tuple(req_to_token.shape)} "
                         f"has no rows of pool_len={pool_len}")
    starts, ends, rows = start_offset.tolist(), end_offset.tolist(), req_pool_indices.tolist()
    total = sum(e - s for s, e in zip(starts, ends))
    if total != out_cache_loc.numel():
        raise ValueError(f"assign_req_to_token_pool_cpu: {total} new slots in the offsets, "
                         f"{out_cache_loc.numel()} in out_cache_loc")
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: SGLang called a kernel that mega_async's CPU stand-in for sgl_kernel does not "
            f"implement (it implements {', '.join(IMPLEMENTED)}; mega_async/inference/sglang/cpu/pythonpath/"
            "sgl_kernel): this model or option needs SGLang's compiled kernels; serve it on a GPU, or with the "
            "embedded server")

    kernel.__name__ = kernel.__qualname__ = name
    return kernel


def __getattr__(name: str):
    if name.startswith("__"):  # the import machinery's probes of dunder names stay plain misses
        raise AttributeError(name)
    return _missing(name)
