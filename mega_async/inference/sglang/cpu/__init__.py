"""The real SGLang engine (0.5.23) on a machine without a GPU: its interpreter, flags and environment.

SGLang's CPU path needs what PyPI does not give it: `sgl_kernel` (a pure-torch stand-in in `pythonpath/`) and a
plain allocation for the routed-experts host buffer (`patches.py`, applied in each server process by
`pythonpath/sitecustomize.py` when SGLang imports the module it fixes). Only the launcher puts `pythonpath/` on a
server's PYTHONPATH. The engine lives in its own environment, built by `bash tools/install_sglang_cpu.sh`
(SGLANG_CPU_VENV names it; docs/inference.md, "The real engine on CPU"). Imports nothing heavy.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"
VENV_ENV = "SGLANG_CPU_VENV"  # the engine's environment; tools/install_sglang_cpu.sh reads the same variable
DEFAULT_VENV = "/tmp/mega_async_sglang_cpu"
INSTALL_HINT = "bash tools/install_sglang_cpu.sh (it builds the engine's environment and prints its python)"

# KV-cache slots of one server unless inference.extra_args sets --max-total-tokens (SGLang would size it from free RAM,
# most of it). 32,768 tokens hold 64 sequences of 512 tokens, a few MB for the tiny models
DEFAULT_MAX_TOTAL_TOKENS = 32768


def engine_python(env: Optional[Mapping[str, str]] = None) -> str:
    """The interpreter that runs the real SGLang servers the project launches: $SGLANG_CPU_VENV's python when set;
    else this one when it has SGLang; else the install script's default environment; one line saying how to get one
    when none has it."""
    env = os.environ if env is None else env
    venv = env.get(VENV_ENV)
    if venv:
        python = Path(venv) / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(f"{VENV_ENV}={venv} has no bin/python: build it with {INSTALL_HINT}")
        return str(python)
    if _here_has_sglang():
        return sys.executable
    python = Path(DEFAULT_VENV) / "bin" / "python"
    if python.exists():
        return str(python)
    raise FileNotFoundError(f"inference.backend=sglang: SGLang is not installed here and there is no engine "
                            f"environment ({VENV_ENV} unset, {DEFAULT_VENV} absent): on a machine without a GPU run "
                            f"{INSTALL_HINT}; with GPUs pip install -e .[gpu]; or use inference.backend=embedded")


def _here_has_sglang() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def cpu_args(extra_args: Sequence[str], dtype: Optional[str]) -> list[str]:
    """The flags a CPU server needs, each left out when `extra_args` (inference.extra_args) sets it itself:
    the CPU device and the torch attention backend (SGLang's others are CUDA kernels), no overlap schedule (it
    overlaps CPU scheduling with a GPU forward, which a CPU server does not have), an explicit KV pool size, sleep
    while idle (else the scheduler's loop keeps a core busy), float32 unless the model's dtype says otherwise (the
    fp32 trainer's logprobs then equal the server's)."""
    wanted = [("--device", "cpu"), ("--attention-backend", "torch_native"), ("--disable-overlap-schedule", None),
              ("--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS)), ("--sleep-on-idle", None)]
    if not dtype:
        wanted.append(("--dtype", "float32"))
    out: list[str] = []
    for flag, value in wanted:
        if not _has_flag(extra_args, flag):
            out += [flag] if value is None else [flag, value]
    return out


def cpu_env(env: Mapping[str, str], num_threads: int) -> dict[str, str]:
    """A CPU server's environment: SGLang's CPU engine on, the stand-in first on PYTHONPATH, its share of the
    cores (OpenMP threads of servers on one host must not oversubscribe it)."""
    out = dict(env)
    out["SGLANG_USE_CPU_ENGINE"] = "1"
    out["PYTHONPATH"] = os.pathsep.join([str(PYTHONPATH_DIR)] + [p for p in [env.get("PYTHONPATH", "")] if p])
    out["OMP_NUM_THREADS"] = str(num_threads)
    return out


_PROBE = """import importlib.util, json
from importlib.metadata import PackageNotFoundError, version
try:
    sglang = version("sglang")
except PackageNotFoundError:
    sglang = None
spec = importlib.util.find_spec("mega_async")
print(json.dumps({"sglang": sglang, "mega_async": spec.submodule_search_locations[0] if spec else None}))
"""


def probe(python: str) -> dict[str, Optional[str]]:
    """What `python` has: SGLang's version and where its mega_async lives (None: absent). One short subprocess."""
    import json
    import subprocess

    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise RuntimeError(f"the engine's interpreter {python} does not run: {type(e).__name__}: {e}") from None


def engine_problem(python: str, found: dict[str, Optional[str]]) -> Optional[str]:
    """One line when `python` (as `probe` found it) cannot run CPU servers: the stand-in and the fixes are
    mega_async's, so the engine's environment must import this project."""
    if found.get("mega_async") is None:
        return (f"inference.backend=sglang on a machine without a GPU: the engine's interpreter {python} cannot "
                f"import mega_async (the sgl_kernel stand-in and SGLang's CPU fixes are ours): {INSTALL_HINT}")
    return None
