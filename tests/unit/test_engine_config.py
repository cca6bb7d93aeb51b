"""The engine takes the run's trainer and algorithm config sections themselves, not a mirror of their keys; the
flat keyword form for tests and tools routes each key to the section that defines it and refuses unknown ones."""
import pytest

from mega_async.api.config_load import load_config
from mega_async.trainer.engine import EngineConfig


def test_the_engine_holds_the_run_config_sections():
    cfg = load_config(None, ["trainer.lr=3e-6", "algorithm.eps_clip=0.3", "algorithm.imp_weight_bounds=[0.2,3.0]",
                             "rollout.temperature=0.7"])
    e = EngineConfig.from_run_config(cfg)
    assert e.trainer is cfg.trainer and e.algorithm is cfg.algorithm  # one object: nothing copied, nothing dropped
    assert (e.trainer.lr, e.algorithm.eps_clip, e.temperature) == (3e-6, 0.3, 0.7)
    assert EngineConfig.from_run_config(load_config(None, ["rollout.temperature=0"])).temperature == 1.0


def test_flat_keywords_go_to_their_sections_and_unknown_ones_are_refused():
    e = EngineConfig.of(lr=0.05, max_tokens_per_mb=77, prox_logp="behavior", kl_coef=0.1, loss="sft", adam_eps=1.0)
    assert (e.trainer.lr, e.trainer.max_tokens_per_mb) == (0.05, 77)
    assert (e.algorithm.prox_logp, e.algorithm.kl_coef, e.loss, e.adam_eps) == ("behavior", 0.1, "sft", 1.0)
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['learning_rate'\]"):
        EngineConfig.of(learning_rate=0.1)
