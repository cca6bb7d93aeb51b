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


@pytest.fixture(autouse=True)
def _megatron_attention_env():
    """Megatron-Core sets NVTE_*_ATTN in os.environ when a test builds a model in this process (its attention
    backend); runs that tests start afterwards inherit them, and a model of another backend then refuses to build.
    Each test leaves them as it found them."""
    import os

    keys = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    before = {k: os.environ.get(k) for k in keys}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
