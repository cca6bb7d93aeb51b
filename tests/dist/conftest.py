"""Shared fixtures of the multi-rank tests."""
import pytest

from mega_async.model_cards import TINY_DENSE, TINY_MOE, init_random_weights


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """The tiny Qwen3-MoE and dense cards with random weights (seed 0), written once; tests only read them."""
    root = tmp_path_factory.mktemp("tiny")
    return {"moe": init_random_weights(TINY_MOE, root / "moe", seed=0),
            "dense": init_random_weights(TINY_DENSE, root / "dense", seed=0)}
