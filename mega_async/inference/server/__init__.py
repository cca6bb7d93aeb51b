"""Embedded inference server: SGLang's native HTTP protocol over a transformers model (CPU or GPU).

    python -m mega_async.inference.server --model models/tiny-qwen3-moe --host 127.0.0.1 --port 30000

app.py (HTTP endpoints), protocol.py (request parsing and response bodies, no I/O), updates.py (weight
updates: from disk, and by broadcast over an SGLang-built process group, with pause-window rollback),
cli.py (arguments, main). The batching engine is mega_async/inference/engine.py.
"""
from mega_async.inference.server.app import EmbeddedServer
from mega_async.inference.server.cli import main, parse_args

__all__ = ["EmbeddedServer", "main", "parse_args"]
