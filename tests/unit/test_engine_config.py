"""The engine takes its share of the run config by field name, not from a hand-copied list: every key set in the
trainer and algorithm sections reaches it, and no engine field goes without a config key except the few that only
the SFT entry point and the optimizer's defaults set."""
from dataclasses import fields

from mega_async import config as c
from mega_async.config import load_config
from mega_async.trainer.engine import EngineConfig

ENGINE_ONLY = {"adam_eps", "loss", "label_smoothing", "temperature"}  # temperature: rollout.temperature


def test_every_trainer_and_algorithm_key_of_an_engine_field_reaches_the_engine():
    cfg = load_config(None, ["trainer.lr=3e-6", "trainer.min_lr=1e-7", "trainer.lr_decay=cosine",
                             "trainer.max_tokens_per_mb=1234", "trainer.ppo_n_minibatches=2", "algorithm.eps_clip=0.3",
                             "algorithm.eps_clip_high=0.4", "algorithm.prox_logp=loglinear", "algorithm.kl_coef=0.05",
                             "algorithm.kl_estimator=k2", "algorithm.imp_weight_mode=tis",
                             "algorithm.imp_weight_bounds=[0.2,3.0]", "rollout.temperature=0.7"])
    e = EngineConfig.from_run_config(cfg)
    assert (e.lr, e.min_lr, e.lr_decay, e.max_tokens_per_mb, e.ppo_n_minibatches) == (3e-6, 1e-7, "cosine", 1234, 2)
    assert (e.eps_clip, e.eps_clip_high, e.prox_logp, e.kl_coef, e.kl_estimator) == (0.3, 0.4, "loglinear", 0.05, "k2")
    assert e.imp_weight_mode == "tis" and e.imp_weight_bounds == (0.2, 3.0) and e.temperature == 0.7
    for f in fields(EngineConfig):
        for section in (cfg.trainer, cfg.algorithm):
            if hasattr(section, f.name):
                assert getattr(e, f.name) == (tuple(getattr(section, f.name)) if f.name == "imp_weight_bounds"
                                              else getattr(section, f.name)), f.name


def test_no_engine_field_is_left_without_a_config_key():
    keys = {f.name for sec in (c.TrainerConfig, c.AlgorithmConfig) for f in fields(sec)}
    unset = {f.name for f in fields(EngineConfig)} - keys
    assert unset == ENGINE_ONLY, f"engine fields with no trainer/algorithm key: {sorted(unset - ENGINE_ONLY)}"


def test_rollout_temperature_zero_trains_at_one():
    assert EngineConfig.from_run_config(load_config(None, ["rollout.temperature=0"])).temperature == 1.0
