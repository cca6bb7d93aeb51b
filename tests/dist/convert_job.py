"""tools/convert_checkpoint.py as one job of a shared launch (tests/dist/jobs.py): the tool runs as
`torchrun tools/convert_checkpoint.py <args>` would, and its exit code, stdout and stderr are written to
RECORD.rank<R>.json. An expected failure (exit 2 on a single rank) leaves the launch to the next job; a failure
on several ranks ends it, as torchrun would (a rank left in a collective would wait for gloo's timeout).

    convert_job.py RECORD hf-to-mcore --hf DIR --out OUT --allocation megatron:t2
"""
import contextlib
import io
import json
import logging
import os
import runpy
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"


def main() -> None:
    record, args = Path(sys.argv[1]), sys.argv[2:]
    out, err = io.StringIO(), io.StringIO()
    sys.argv = [str(TOOL), *args]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(str(TOOL), run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        finally:  # the tool's logging.basicConfig wrote to the captured stream: the next job configures its own
            for h in list(logging.root.handlers):
                logging.root.removeHandler(h)
    rank = os.environ.get("RANK", "0")
    Path(f"{record}.rank{rank}.json").write_text(json.dumps({"code": code, "stdout": out.getvalue(),
                                                             "stderr": err.getvalue()}))
    if code and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
