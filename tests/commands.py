"""The one builder of `mega-async` command lines that tests run in a subprocess (also the `train_cmd` fixture)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Union

ROOT = Path(__file__).resolve().parents[1]


def mega_async(*args: str) -> list[str]:
    """`mega-async ARGS...` as this interpreter runs it (the checkout's package, whatever is on PATH)."""
    return [sys.executable, "-m", "mega_async.cli", *map(str, args)]


def train_command(config: Union[str, Path], root_dir: Union[str, Path], *overrides: str,
                  tensorboard: bool = False) -> list[str]:
    """`mega-async train -c CONFIG logging.root_dir=ROOT_DIR [logging.tensorboard=false] OVERRIDES...`; `config` is a
    path, or a name under configs/ (`tiny_cpu`)."""
    path = Path(config)
    if not path.suffix:
        path = ROOT / "configs" / f"{config}.yaml"
    return mega_async("train", "-c", str(path), f"logging.root_dir={root_dir}",
                      *([] if tensorboard else ["logging.tensorboard=false"]), *overrides)
