"""Embedded inference server: SGLang's native HTTP protocol over a transformers model (CPU or GPU).

    python -m mega_async.server --model models/tiny-qwen3-moe --host 127.0.0.1 --port 30000

app.py (native HTTP endpoints), openai_api.py (/v1/*), info.py (information endpoints),
generate_protocol.py and protocol.py (pure request parsing and response bodies, no I/O), engine.py (the
continuous-batching engine), sampling.py, prefix_cache.py, routing.py (routed experts), weights.py and
updates.py (weight loading and updates), memory.py (release/resume), cli.py (arguments, main).
"""
from mega_async.server.app import EmbeddedServer
from mega_async.server.cli import main, parse_args

__all__ = ["EmbeddedServer", "main", "parse_args"]
