"""torchrun as the local launcher runs it: `python -m mega_async.launch.agent <torchrun arguments>`.

The same agent (torch.distributed.run), plus a record of how each failed rank ended (exit code, or the signal
that killed it) in `$MEGA_ASYNC_ERROR_DIR/failures.json`, in the order torchrun saw them, so the launching
command can say "trainer rank 1 was killed by SIGKILL" instead of torchrun's exit code.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

FAILURES = "failures.json"


def failure_records(failures: dict) -> list[dict[str, Any]]:
    """torchrun's {global rank: ProcessFailure}, first seen first, as plain records."""
    out = []
    for rank, f in failures.items():
        out.append({"rank": int(rank), "exitcode": int(f.exitcode), "pid": int(f.pid), "time": int(f.timestamp),
                    "signal": f.signal_name() if f.exitcode < 0 else None})
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from mega_async.utils.lifeline import ERROR_DIR_ENV, LAUNCHER_ENV, ProcessRef

    try:
        torchrun(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        d = os.environ.get(ERROR_DIR_ENV)
        if d:
            (Path(d) / FAILURES).write_text(json.dumps(failure_records(e.failures)))
        raise
    except SignalException as e:  # torchrun stopped its ranks: the launching command says why, not a traceback
        launcher = ProcessRef.parse(os.environ.get(LAUNCHER_ENV, ""))
        if launcher is not None and not launcher.alive():
            print(f"mega-async train: the launching command (pid {launcher.pid}) is gone; every rank was stopped",
                  file=sys.stderr, flush=True)
            if os.environ.get(ERROR_DIR_ENV):  # the command's own cleanup never ran
                shutil.rmtree(os.environ[ERROR_DIR_ENV], ignore_errors=True)
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
