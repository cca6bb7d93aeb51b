"""SGLang releases for the interop test, installed without their dependencies into a cache directory.

`ensure_sglang("0.5.23")` -> ~/.cache/mega_async/sglang-0.5.23 (or $MEGA_ASYNC_SGLANG_CACHE/sglang-0.5.23), made
once with `pip install --no-deps --target DIR sglang==0.5.23 <DEPS>`; put it on PYTHONPATH to import that
release. DEPS are the packages SGLang's receive path and HTTP server import at module level that the project
does not install itself: all small, none CUDA, and --no-deps keeps torch (and everything else SGLang
requires) out. The CUDA-only imports are stubbed instead (sglang_stubs.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

OLDEST, NEWEST = "0.5.20", "0.5.23"  # the supported range the interop test covers

DEPS = (
    "msgspec==0.23.0",  # io_struct's request structs
    "pybase64==1.5.1", "dill==0.4.1", "pyzmq==27.3.0",  # sglang/srt/utils, sampling, network
    "sentencepiece==0.2.3", "gguf==0.19.0", "partial-json-parser==0.2.1.1.post7",  # configs, quantization, parsers
    "compressed-tensors==0.18.0", "loguru==0.7.3",  # quantization (compressed-tensors logs with loguru)
    "soundfile==0.14.0",  # the OpenAI audio route
    "fastapi==0.165.0", "starlette==1.10.0", "annotated-doc==0.0.7", "opentelemetry-api==1.45.2",
    "python-multipart==0.0.34", "uvicorn==0.54.0", "uvloop==0.23.0", "setproctitle==1.3.8",  # http_server
    # sglang/srt/utils/common.py and sglang/utils.py (IPython.display) with what they import: a fresh venv has
    # none of them from the project (CI's machine once had them installed by hand, which hid that)
    "orjson==3.11.9", "requests==2.34.2", "urllib3==2.8.0", "charset-normalizer==3.5.3", "idna==3.20",
    "certifi==2026.10.19.post1", "ipython==9.18.1", "ipython-pygments-lexers==1.1.1", "jedi==0.20.1",
    "parso==0.8.7", "matplotlib-inline==0.2.2", "traitlets==5.16.1", "pexpect==4.9.0", "ptyprocess==0.7.0",
    "prompt-toolkit==3.0.53", "wcwidth==0.9.4", "stack-data==0.6.3", "executing==2.3.0", "asttokens==3.0.2",
    "pure-eval==0.2.4", "decorator==5.2.1", "interegular==0.3.3", "cffi==2.1.1", "pycparser==3.12",  # soundfile
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
)


def cache_root() -> Path:
    return Path(os.environ.get("MEGA_ASYNC_SGLANG_CACHE") or Path.home() / ".cache" / "mega_async")


def ensure_sglang(version: str, timeout: float = 900.0) -> Path:
    """The directory holding sglang==`version` and DEPS (installed on first use). Raises RuntimeError naming
    the pip command and its output when the install fails."""
    target = cache_root() / f"sglang-{version}"
    marker = target / ".mega_async_requirements"
    wanted = "\n".join((f"sglang=={version}",) + DEPS)
    if marker.is_file() and marker.read_text() == wanted:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".sglang-{version}-", dir=target.parent))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
           "--target", str(tmp), f"sglang=={version}", *DEPS]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"installing SGLang {version} took over {timeout:.0f} s: {' '.join(cmd)}") from e
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"could not install SGLang {version} for the interop test (PyPI must be reachable): "
                           f"{' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}")
    (tmp / ".mega_async_requirements").write_text(wanted)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target
