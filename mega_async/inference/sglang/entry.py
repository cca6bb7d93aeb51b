"""Start real SGLang (`python -m sglang.launch_server ...`) with the API key taken from the environment.

`python -m mega_async.inference.sglang.entry ARGS` = `python -m sglang.launch_server ARGS --api-key $KEY`, but the
key never appears on a command line (`ps`, /proc/<pid>/cmdline), only in this process's argv copy.
"""
from __future__ import annotations

import os
import runpy
import sys

from mega_async.inference.servers import API_KEY_ENV


def main() -> None:
    key = os.environ.pop(API_KEY_ENV, None)
    args = sys.argv[1:]
    if "--api-key" in args:
        raise SystemExit("sglang_entry: pass the API key in the environment variable "
                         f"{API_KEY_ENV}, not as --api-key")
    sys.argv = ["sglang.launch_server", *args, *(["--api-key", key] if key else [])]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
