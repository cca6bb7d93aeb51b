"""Runs first in every Python process of a CPU SGLang server the project launched (this directory leads its
PYTHONPATH): installs the fixes of mega_async.inference.sglang.cpu.patches, which apply as SGLang imports the
modules they fix, then runs the sitecustomize this one shadows, if there is one."""
import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    from mega_async.inference.sglang.cpu.patches import install

    install()


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_chain()
