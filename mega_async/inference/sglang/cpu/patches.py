"""Fixes SGLang 0.5.23 needs to serve on a CPU, applied when SGLang imports the module each one fixes (an import
hook installed by pythonpath/sitecustomize.py in every server process): never by hand, never to installed files.

- `sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS` maps every device it does not name, `cpu` included,
  to `alloc_with_host_register`, which pins the buffer with `cudaHostRegister`; the routed-experts host buffer
  (`--enable-return-routed-experts`, `state_capturer/base.py`) is allocated through it, so a CPU server crashes at
  start-up. Here `cpu` gets the same allocation without the registration.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

logger = logging.getLogger("mega_async.inference.sglang.cpu")

HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"


def plain_host_alloc(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any,
                     registration_granularity_bytes: Optional[int] = None) -> Any:
    """`alloc_with_host_register` without `cudaHostRegister`: the allocator's buffer (SGLang's mmap), or a plain
    tensor; on a CPU server host memory is the device's memory, nothing to pin."""
    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    import torch

    return torch.empty(dims, dtype=dtype, device=device)


def fix_host_pool(module: ModuleType) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = plain_host_alloc


FIXES: dict[str, Callable[[ModuleType], None]] = {HOST_POOL_MODULE: fix_host_pool}


class _FixingLoader(importlib.abc.Loader):
    """The module's own loader, then its fix."""

    def __init__(self, loader: importlib.abc.Loader, fix: Callable[[ModuleType], None]):
        self.loader, self.fix = loader, fix

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.fix(module)
        logger.info("mega_async: %s fixed for the CPU (%s)", module.__name__, self.fix.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code ... for tracebacks and inspect
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class FixOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules of FIXES through the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None):
        fix = FIXES.get(fullname)
        if fix is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _FixingLoader(spec.loader, fix)
                return spec
        return None


def install() -> None:
    """Install the hook once; a module already imported is fixed at once."""
    if not any(isinstance(f, FixOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, FixOnImport())
    for name, fix in FIXES.items():
        if name in sys.modules:
            fix(sys.modules[name])
