"""Megatron-Core 0.16 on a CPU with gloo: the patch set, applied only when CUDA is unavailable.

Megatron assumes CUDA in a few dozen places (device="cuda" literals, torch.cuda.current_device()
as a buffer device, CUDA streams/events in the MoE dispatcher, CUDA RNG state forking, .cuda()
on tied embeddings). Rather than editing each function, the modules that do so see a `torch`
whose CUDA-only pieces resolve to the CPU (`_CpuTorch`), plus the few targeted patches below.
Each patch names what it works around. On a GPU nothing is patched.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types
from typing import Any

import torch

logger = logging.getLogger("mega_async.trainer.cpu")

_APPLIED = False

# Megatron modules that create tensors on "cuda" or touch torch.cuda.* on the paths we run.
_MODULES = [
    "megatron.core.utils",  # GlobalMemoryBuffer: torch.cuda.current_device() as buffer device
    "megatron.core.parallel_state",  # torch.cuda.device_count / current_device in group setup
    "megatron.core.tensor_parallel.layers",  # parameter init on torch.cuda.current_device()
    "megatron.core.tensor_parallel.random",  # CUDA RNG state get/set
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.transformer.utils",  # get_default_causal_mask builds the mask with device="cuda"
    "megatron.core.transformer.module",
    "megatron.core.transformer.mlp",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",  # torch.cuda.current_stream in maybe_move_tensor_to_cpu
    "megatron.core.transformer.moe.token_dispatcher",  # torch.cuda.Stream/Event for the D2H side stream
    "megatron.core.transformer.moe.shared_experts",  # torch.cuda.Stream for overlap
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.multi_token_prediction",  # MTP loss tracker and CP roll on current_device()
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # freqs on current_device()
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens = torch.zeros(..., device="cuda")
    "megatron.core.pipeline_parallel.p2p_communication",  # shape tensors on current_device()
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.distributed.param_and_grad_buffer",  # grad buffers on current_device()
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",  # found_inf etc. with device='cuda'
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",  # norms on current_device()
    "megatron.core.timers",
    # distributed checkpoints: torch.cuda.synchronize / current_device around the file writes
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.tensor_aware_state_dict",
]


class _Null:
    """Stands in for CUDA streams and events: every method is a no-op, record_event() has synchronize()."""

    def __init__(self, *a: Any, **k: Any):
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: _Null()

    def __enter__(self) -> "_Null":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _cpu_device(dev: Any) -> Any:
    if isinstance(dev, int):  # torch.cuda.current_device() style index
        return "cpu"
    if isinstance(dev, str) and dev.startswith("cuda"):
        return "cpu"
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    return dev


def _cuda_stub() -> types.SimpleNamespace:
    real = torch.cuda
    ns = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")})
    ns.current_device = lambda: "cpu"
    ns.is_available = lambda: False
    ns.device_count = lambda: 0
    ns.Stream = _Null
    ns.Event = _Null
    ns.current_stream = lambda *a, **k: _Null()
    ns.default_stream = lambda *a, **k: _Null()
    ns.stream = lambda *a, **k: contextlib.nullcontext()
    ns.synchronize = lambda *a, **k: None
    ns.empty_cache = lambda: None
    ns.nvtx = types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                    range=lambda *a, **k: contextlib.nullcontext())
    ns.get_rng_state = lambda *a, **k: torch.get_rng_state()
    ns.set_rng_state = lambda state, *a, **k: None
    ns.manual_seed = lambda seed: None
    ns.memory_allocated = lambda *a, **k: 0
    ns.max_memory_allocated = lambda *a, **k: 0
    return ns


class _CpuTorch(types.ModuleType):
    """`torch` as seen by patched Megatron modules: CUDA devices become the CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "triu",
                  "tril", "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "eye", "linspace")

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _cuda_stub()
        for name in self._FACTORIES:
            setattr(self, name, self._wrap(getattr(torch, name)))
        self.device = lambda *a, **k: torch.device("cpu") if a and _cpu_device(a[0]) == "cpu" and a[0] != "cpu" \
            else torch.device(*a, **k)
        self.autocast = lambda device_type="cpu", *a, **k: torch.autocast(_cpu_device(device_type), *a, **k)

    @staticmethod
    def _wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def inner(*a: Any, **k: Any) -> Any:
            if "device" in k:
                k["device"] = _cpu_device(k["device"])
            return fn(*a, **k)

        return inner

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _with_cuda_type_names(fn: Any) -> Any:
    orig_type = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        if a or k:
            return orig_type(self, *a, **k)
        name = orig_type(self)
        return name.replace("torch.", "torch.cuda.", 1) if not self.is_cuda else name

    @functools.wraps(fn)
    def inner(*a: Any, **k: Any) -> Any:
        torch.Tensor.type = cuda_named_type  # type: ignore[method-assign]
        try:
            return fn(*a, **k)
        finally:
            torch.Tensor.type = orig_type  # type: ignore[method-assign]

    return inner


def patch_without_te() -> None:
    """Megatron's MLA believes Transformer Engine is there whenever its extension module imports, which it does
    without TE (its classes are then mocks): `isinstance(linear_proj, TELinear)` raises. Without TE, MLA is told
    so. Idempotent; for the local layer spec (CPU, or a GPU with layer_spec=local and no TE)."""
    try:
        import transformer_engine  # noqa: F401

        return
    except ImportError:
        pass
    from megatron.core.transformer import multi_latent_attention as mla

    mla.HAVE_TE = False


def _eager(fn: Any = None, **_options: Any) -> Any:
    """`torch.compile` as Megatron's fusions use it (`@torch.compile` or `torch.compile(**options)(fn)`), eager."""
    return fn if fn is not None else (lambda f: f)


def import_megatron() -> bool:
    """Import Megatron-Core with its `jit_fuser` eager when CUDA is unavailable.

    Megatron decorates about thirty small functions with `torch.compile` (`megatron.core.jit.jit_fuser`), some on the
    paths a CPU run takes every step (the router's `_apply_expert_bias`, the alltoall dispatcher's preprocessing, the
    grouped experts' GLU). On a CPU that means importing TorchDynamo and Inductor in every rank (about 1.5 s of CPU
    time) and tracing and compiling C++ with the host compiler in every process, for functions of a few element-wise
    operations on tiny tensors; eager, they compute the same. The first import of `megatron.core` sees an eager
    `torch.compile`; later imports then bind Megatron's `noop_decorator`. Call before anything imports Megatron
    (`init_parallel_state` and the engine do); when Megatron is already imported, `apply_cpu_patches` unwraps the
    compiled functions instead. On a GPU nothing changes. Returns whether it imported Megatron so."""
    if torch.cuda.is_available() or "megatron.core.jit" in sys.modules:
        return False
    real = torch.compile
    torch.compile = _eager  # type: ignore[assignment]
    try:
        from megatron.core import jit as mjit
    finally:
        torch.compile = real  # type: ignore[assignment]
    mjit.disable_jit_fuser()
    return True


def _unwrap_compiled() -> int:
    """Megatron imported before `import_megatron` could run: its compiled functions become their eager originals,
    and its modules' `jit_fuser` the no-op. Returns how many functions were unwrapped."""
    from megatron.core import jit as mjit

    mjit.disable_jit_fuser()
    n = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron.core") or mod is None:
            continue
        if getattr(mod, "jit_fuser", None) is not None and mod is not mjit:
            mod.jit_fuser = mjit.noop_decorator
        owners = [mod] + [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == name]
        for owner in owners:
            for attr, value in list(vars(owner).items()):
                orig = getattr(value, "_torchdynamo_orig_callable", None)
                if orig is not None:
                    setattr(owner, attr, orig)
                    n += 1
    return n


def apply_cpu_patches() -> bool:
    """Patch Megatron-Core for CPU/gloo when CUDA is unavailable; idempotent. Returns whether patched."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    if not import_megatron():  # imported before, with its compiling jit_fuser
        _unwrap_compiled()
    proxy = _CpuTorch()
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:  # a module missing in this Megatron version: nothing to patch there
            logger.debug("skip %s: %s", name, e)
            continue
        if getattr(mod, "torch", None) is torch:
            mod.torch = proxy

    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    # moe_utils references te_general_gemm unconditionally when Transformer Engine is absent (NameError).
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    # maybe_move_tensor_to_cpu(..., as_numpy=True) only converts CUDA tensors; the alltoall dispatcher
    # then hands tensors, not lists, to all_to_all_single as split sizes.
    orig_move = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.is_cuda:
            return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return tensor.numpy() if as_numpy else tensor

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    patch_without_te()
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu

    # CudaRNGStatesTracker.fork swaps CUDA RNG states; on CPU it is a plain context.
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()

    # LanguageModule.setup_embeddings_and_output_layer calls .cuda() on the tied embedding before the
    # all-reduce across first/last stage; on a CPU-only machine .cuda() can only fail, so it stays put.
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]

    # WrappedTorchNorm (local spec) refuses sequence parallelism; its weights need the
    # `sequence_parallel` attribute so their gradients are all-reduced over TP.
    from megatron.core.transformer import torch_norm

    orig_norm_new = torch_norm.WrappedTorchNorm.__new__

    def norm_new(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> Any:
        sp = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = orig_norm_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    torch_norm.WrappedTorchNorm.__new__ = norm_new  # type: ignore[method-assign]

    # The optimizers sort parameters by `param.type()` against 'torch.cuda.*Tensor' names and reject
    # anything else; inside those two functions only, CPU tensors report their CUDA type name.
    from megatron.core.optimizer import distrib_optimizer, optimizer

    for cls, fn in ((distrib_optimizer.DistributedOptimizer, "_build_model_and_main_param_groups"),
                    (optimizer.Float16OptimizerWithFloat16Params, "__init__")):
        raw = cls.__dict__[fn]
        if isinstance(raw, (staticmethod, classmethod)):
            setattr(cls, fn, type(raw)(_with_cuda_type_names(raw.__func__)))
        else:
            setattr(cls, fn, _with_cuda_type_names(raw))
    # grad clipping asserts param.grad.type() == 'torch.cuda.FloatTensor'
    from megatron.core.optimizer import clip_grads

    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    _patch_uneven_collectives()
    _APPLIED = True
    logger.info("Megatron-Core patched for CPU/gloo (%d modules see CPU devices)", len(_MODULES))
    return True


def _patch_uneven_collectives() -> None:
    """The alltoall dispatcher at EP > 1 with ETP > 1 gathers (and reduce-scatters back) each rank's routed tokens
    over the expert-TP group with per-rank sizes (`output_split_sizes`): list collectives of unequal tensors, which
    NCCL runs and gloo refuses ("invalid tensor size"). Here they run padded to the largest size, then cut back."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_: Any, group: Any, output_split_sizes: Any = None,
                               use_global_buffer: bool = False) -> Any:
        if output_split_sizes is None or group is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(x) for x in output_split_sizes]
        top = max(sizes)
        padded = input_.new_zeros((top, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((top * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * top: r * top + n] for r, n in enumerate(sizes)])

    def reduce_scatter_along_first_dim(input_: Any, group: Any, input_split_sizes: Any = None,
                                       use_global_buffer: bool = False) -> Any:
        if input_split_sizes is None or group is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(x) for x in input_split_sizes]
        top = max(sizes)
        padded = input_.new_zeros((top * len(sizes), *input_.shape[1:]))
        for r, part in enumerate(torch.split(input_, sizes, dim=0)):
            padded[r * top: r * top + part.shape[0]] = part
        out = input_.new_empty((top, *input_.shape[1:]))
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[group.rank()]].contiguous()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim
