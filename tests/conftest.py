import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pytest  # noqa: E402

from tests.commands import train_command  # noqa: E402


@pytest.fixture
def train_cmd():
    """`train_cmd(config, root_dir, *overrides)`: a `mega-async train` command line (tests/commands.py)."""
    return train_command
