"""Stand-ins for the packages SGLang's modules import at module level that cannot run (or be installed) on a
CPU-only test machine; for the interop receiver (tests/integration/sglang_receiver.py) only.

Only these are stubbed; everything else SGLang imports is the real package (see sglang_releases.DEPS):

    triton       GPU kernel compiler: sglang/srt/utils/common.py imports it at the top, kernels are
                 decorated with @triton.jit at import. torch probes for triton too (inductor, the flop
                 counter), so the torch modules that do are imported first and see it absent.
    torchvision  a binary built against one CUDA torch: only SGLang's multimodal processors use it
                 (0.5.20: sglang/srt/utils/common.py; 0.5.23: sglang/srt/multimodal/internvl_utils.py).
    xgrammar     grammar-constrained decoding, a 44 MB binary needing triton and tvm_ffi:
                 sglang/srt/function_call/inkling_detector.py imports StructuralTag, which is typing.Any
                 here, as in SGLang's own fallback when xgrammar is missing (entrypoints/openai/protocol.py).
    tvm_ffi      (0.5.23) the FFI of SGLang's CUDA kernels: sglang/kernels/ops/communication/all_reduce.py.

A stand-in resolves any attribute to another stand-in, is a no-op decorator, and is falsy, so module-level
code that only names them runs; calling into one does nothing useful, which no weight-update path does.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
import typing

STUBS = {
    "0.5.20": ("triton", "torchvision", "xgrammar"),
    "0.5.23": ("triton", "torchvision", "xgrammar", "tvm_ffi"),
}
ALL = ("triton", "torchvision", "xgrammar", "tvm_ffi")  # a release not listed gets every stand-in

_ATTRS = {"xgrammar": {"StructuralTag": typing.Any}}


def for_version(version: str) -> tuple[str, ...]:
    return STUBS.get(version, ALL)


class _Anything(types.ModuleType):
    """A module whose every attribute is another stand-in: names resolve, nothing runs."""

    def __getattr__(self, name: str) -> "_Anything":
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _Anything(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a bare decorator: the function stays itself
        return _decorator

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __getitem__(self, key: typing.Any) -> "_Anything":
        return self

    def __iter__(self) -> typing.Iterator:
        return iter(())

    def __bool__(self) -> bool:
        return False


def _decorator(fn: typing.Any = None, *args: typing.Any, **kwargs: typing.Any) -> typing.Any:
    return fn if callable(fn) else _decorator


class _JITFunction:
    """triton.runtime.jit.JITFunction: what @triton.jit returns; launching one fails."""

    def __init__(self, fn: typing.Any):
        self.fn = fn

    def __getitem__(self, grid: typing.Any) -> typing.Any:
        raise RuntimeError("triton is stubbed in this test (tests/integration/sglang_stubs.py): no kernel can run")


def _triton() -> dict[str, types.ModuleType]:
    t = _Anything("triton")
    t.__path__ = []
    t.__version__ = "3.4.0"
    runtime = _Anything("triton.runtime")
    runtime.__path__ = []
    jit_mod = _Anything("triton.runtime.jit")
    jit_mod.JITFunction = _JITFunction
    runtime.jit = jit_mod
    t.runtime = runtime

    def jit(fn: typing.Any = None, **kw: typing.Any) -> typing.Any:
        return _JITFunction(fn) if fn is not None else _JITFunction

    t.jit = jit
    return {"triton": t, "triton.runtime": runtime, "triton.runtime.jit": jit_mod}


def _torch_without_triton() -> None:
    """torch probes for triton and then uses its real API (inductor, the flop counter): the torch modules that
    probe at import are imported before the stand-in exists, so they see it absent."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.runtime.triton_compat  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401
    from torch.utils._triton import has_triton, has_triton_package

    if has_triton_package() or has_triton():
        raise RuntimeError("a real triton is installed: the interop receiver expects none (CPU-only test)")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: typing.Iterable[str]):
        self.names = set(names)

    def find_spec(self, name: str, path: typing.Any, target: typing.Any = None) -> typing.Any:
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        m = _Anything(spec.name)
        m.__path__ = []
        if "." not in spec.name:
            m.__version__ = "0.0.0"  # transformers parses the version of a package it finds
        for k, v in _ATTRS.get(spec.name, {}).items():
            setattr(m, k, v)
        return m

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install(names: typing.Iterable[str]) -> list[str]:
    """Put the stand-ins for `names` in place (before any SGLang import); returns the names."""
    names = list(names)
    if "triton" in names:
        _torch_without_triton()
        sys.modules.update(_triton())
    sys.meta_path.insert(0, _Finder(names))
    return names
