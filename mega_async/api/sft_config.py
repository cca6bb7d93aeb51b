"""The `mega-async sft` config: its sections (model, task, trainer, logging), their validation, and its loader (the
run's `load_typed`). Torch-free, so `mega-async sft --help` lists every setting without importing torch."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from mega_async.api.config import ConfigError, check_finite, check_seed
from mega_async.api.config_load import load_typed


@dataclass
class SFTModel:
    path: str = "models/tiny-addition"  # HF-format card (config, tokenizer; weights when init=pretrained)
    # random: start from a deterministic random init of the card's config drawn with `seed` (written to
    # <run_dir>/init) | pretrained: from the weights in model.path
    init: str = "random"


TASKS = ("addition", "countdown")


@dataclass
class SFTTask:
    # addition (mega_async.data.addition) | countdown (mega_async.data.countdown: long-tailed worked answers)
    name: str = "addition"
    digits: int = 3
    min_count: int = 1  # countdown: the count a - b is log-uniform in [min_count, max_count]
    max_count: int = 74
    eval_size: int = 256  # held-out problems scored at the end (and every eval_interval steps)
    rl_prompts: int = 4096  # train-split prompts written for the RL run
    eval_samples: int = 4  # samples per eval problem at temperature 1 (besides the greedy answer)


@dataclass
class SFTTrainer:
    total_steps: int = 600  # optimizer steps (the old name trainer.steps still loads, with a deprecation warning)
    batch_size: int = 64  # sequences per optimizer step
    lr: float = 3e-3
    min_lr: float = 0.0
    warmup_steps: int = 20
    lr_decay: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # weight of the uniform distribution over the vocabulary in the target (torch's label_smoothing): the SFT
    # model learns the answer but samples it at temperature 1 only about (1 - e)^answer tokens of the time
    label_smoothing: float = 0.0
    max_tokens_per_mb: int = 4096
    eval_interval: int = 0  # steps between evaluations on dev problems (held out, not those of eval.jsonl)
    # stop at the first evaluation whose greedy held-out exact match reaches this (null: run all steps). The
    # task's learning curve rises steeply at a step that moves with seed and versions; stopping on accuracy
    # gives RL a start of known skill (configs/addition_sft_cpu.yaml: 0.3)
    stop_at_accuracy: Optional[float] = None
    threads: Optional[int] = None  # torch threads; null = the cores this process may run on


@dataclass
class SFTLogging:
    root_dir: str = "runs"
    level: str = "INFO"


RENAMED = {"trainer.steps": "trainer.total_steps"}  # old SFT key -> the name `mega-async train` uses


@dataclass
class SFTConfig:
    experiment_name: str = "addition_sft"
    trial_name: str = "run0"
    seed: int = 1
    model: SFTModel = field(default_factory=SFTModel)
    task: SFTTask = field(default_factory=SFTTask)
    trainer: SFTTrainer = field(default_factory=SFTTrainer)
    logging: SFTLogging = field(default_factory=SFTLogging)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.root_dir) / self.experiment_name / self.trial_name

    def validate(self) -> None:
        """Raises ConfigError naming the first bad key."""
        check_finite(self)
        check_seed(self.seed)
        t, k = self.trainer, self.task
        for key, v in (("trainer.total_steps", t.total_steps), ("trainer.batch_size", t.batch_size),
                       ("task.eval_size", k.eval_size), ("task.rl_prompts", k.rl_prompts),
                       ("task.eval_samples", k.eval_samples), ("trainer.max_tokens_per_mb", t.max_tokens_per_mb)):
            if v < 1:
                raise ConfigError(f"{key}={v} must be >= 1")
        if not 1 <= k.digits <= 9:
            raise ConfigError(f"task.digits={k.digits} must be in [1, 9]")
        if k.name not in TASKS:
            raise ConfigError(f"task.name={k.name!r} is not one of {', '.join(TASKS)}")
        if k.name == "countdown" and not 1 <= k.min_count <= k.max_count < 10 ** k.digits:
            raise ConfigError(f"task.min_count={k.min_count}, task.max_count={k.max_count}: need 1 <= min_count <= "
                              f"max_count < 10**task.digits = {10 ** k.digits}")
        if t.lr <= 0 or not 0 <= t.min_lr <= t.lr:
            raise ConfigError(f"trainer.lr={t.lr} must be > 0 and trainer.min_lr={t.min_lr} in [0, lr]")
        if not 0 <= t.warmup_steps < t.total_steps:
            raise ConfigError(f"trainer.warmup_steps={t.warmup_steps} must be in [0, trainer.total_steps="
                              f"{t.total_steps})")
        if not 0 <= t.label_smoothing < 1:
            raise ConfigError(f"trainer.label_smoothing={t.label_smoothing} must be in [0, 1)")
        if self.model.init not in ("random", "pretrained"):
            raise ConfigError(f"model.init={self.model.init!r} is not one of random, pretrained")
        if t.lr_decay not in ("constant", "linear", "cosine"):
            raise ConfigError(f"trainer.lr_decay={t.lr_decay!r} is not one of constant, linear, cosine")
        if t.eval_interval < 0 or (t.threads is not None and t.threads < 1):
            raise ConfigError("trainer.eval_interval must be >= 0 and trainer.threads >= 1 (or null)")
        if t.stop_at_accuracy is not None and (not 0 < t.stop_at_accuracy <= 1 or not t.eval_interval):
            raise ConfigError(f"trainer.stop_at_accuracy={t.stop_at_accuracy} must be in (0, 1] and needs "
                              "trainer.eval_interval > 0 (the evaluations it stops at)")


def load_sft_config(path: Optional[str], overrides: Sequence[str] = ()) -> SFTConfig:
    """Defaults <- YAML <- dotted overrides, validated (ConfigError, one line naming the key): the loader of
    `mega-async train` (mega_async.api.config.load_typed); trainer.steps loads as trainer.total_steps, with a warning."""
    return load_typed(SFTConfig, path, overrides, command="mega-async sft", example="configs/addition_sft_cpu.yaml",
                      renamed=RENAMED)
