"""Typed run configuration: one dataclass per section, each validating itself (`ConfigError`, one line naming the
key). Loading it from YAML and overrides, and writing it back, is `mega_async.api.config_load`'s."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from mega_async.api.allocation import Allocation, AllocationError, parse_allocation  # pure Python, no torch

logger = logging.getLogger("mega_async.api.config")


class ConfigError(ValueError):
    """A configuration problem, reported as one line that names the key."""

    def __init__(self, message: str):
        super().__init__(f"ConfigError: {message}")


@dataclass
class ModelConfig:
    path: str = "models/tiny-qwen3-moe"  # HF-format directory (config.json, tokenizer, safetensors)
    dtype: str = "float32"  # float32 | bfloat16 | float16

    def validate(self) -> None:
        _choice("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class ParallelConfig:
    # AReaL-style allocation: inference part '+' trainer part, e.g. sglang:d4t2+megatron:d2p2t2e4
    allocation: str = "sglang:d1+megatron:d1"

    def validate(self) -> None:
        try:
            parse_allocation(self.allocation)
        except AllocationError as e:
            why = str(e).removeprefix("AllocationError: ")
            raise ConfigError(f"parallel.allocation={self.allocation!r}: {why}") from None


MIN_SYNC_TIMEOUT_S = 1.0  # trainer.sync_timeout: below it no weight-update group can be set up


def host_name_ok(host: str) -> bool:
    """An IP address, or a host name as RFC 1123 spells one (a name of digits and dots must be an IPv4 address)."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or len(host) > 253 or all(lb.isdigit() for lb in labels):
        return False
    return all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", lb) for lb in labels)


MAX_SEED = 2 ** 31 - 1  # every consumer takes it: torch, numpy (< 2**32), SGLang's int fields, seed + server index


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed={seed} must be in [0, {MAX_SEED}] (the servers, numpy and torch take seeds of 32 "
                          "bits or fewer)")


# flags of a server's (and the router's) command line that the run sets and relies on: never from extra_args
SERVER_OWNED_FLAGS = ("--host", "--port", "--api-key", "--model-path", "--model", "--tokenizer-path")
ROUTER_OWNED_FLAGS = ("--host", "--port", "--worker-urls", "--api-key")


def owned_flag(args: Sequence[str], owned: Sequence[str]) -> Optional[str]:
    """The first of `args` that sets one of `owned` (also by an abbreviation argparse would take: --po for --port),
    else None."""
    for a in args:
        name = str(a).split("=", 1)[0]
        if name.startswith("--") and len(name) > 3 and any(o == name or o.startswith(name) for o in owned):
            return name
    return None


@dataclass
class InferenceConfig:
    backend: str = "embedded"  # embedded (CPU server in-tree) | sglang (real servers) | simulated
    # existing servers, one per server of the allocation's inference part; empty = launch them. How many
    # servers and their tp/ep come from parallel.allocation's inference part (sglang:d2t4 = 2 servers, tp 4)
    addresses: list[str] = field(default_factory=list)
    request_timeout: float = 300.0  # seconds for one /generate round trip
    # the API key is read from this environment variable (never from the config: config.yaml is written to the
    # run directory, and servers we launch get it through their environment, not their command line)
    api_key_env: str = "MEGA_ASYNC_API_KEY"
    api_key: Optional[str] = None  # refused when set: see api_key_env
    max_retries: int = 3  # 5xx answers in a row before a server is dropped (even if its /health answers)
    unhealthy_timeout: float = 30.0  # seconds without any usable server before the run stops
    # a server the run launched whose process ends is started again, at most this many times each (then given
    # up on); it serves again once it has the current weights (0: never restarted)
    max_server_restarts: int = 3
    extra_args: list[str] = field(default_factory=list)  # passed through to sglang.launch_server
    # the radix (prefix) cache of the servers the run launches: None = the backend's default (the embedded server
    # keeps it; real SGLang servers get --disable-radix-cache, as AReaL launches them); true / false: both backends.
    # Weight updates flush it either way, so it saves prefill only within a version (a group's shared prompt,
    # multi-turn sessions), never for a request resent after an abort
    radix_cache: Optional[bool] = None
    # launch an installed SGLang outside the tested release range (mega_async.api.sglang_releases)
    allow_untested_sglang: bool = False
    # a router in front of the servers (docs/inference.md, "A router in front"): none | smg (the run starts smg in
    # front of its servers, or of inference.addresses). The run's generation goes through it while every server
    # serves the current weights; control and weights go straight to the servers
    router: str = "none"
    router_address: Optional[str] = None  # a router already running in front of inference.addresses (host:port)
    router_args: list[str] = field(default_factory=list)  # more `smg launch` flags, e.g. [--policy, round_robin]
    router_bin: Optional[str] = None  # the smg executable (default: smg on PATH, else beside the engine's python)

    def validate(self) -> None:
        _choice("inference.backend", self.backend, ("embedded", "sglang", "simulated"))
        _choice("inference.router", self.router, ("none", "smg"))
        if (self.router != "none" or self.router_address) and self.backend == "simulated":
            raise ConfigError("inference.router/router_address: the simulated engine has no servers to route to; "
                              "use inference.backend=embedded or sglang")
        if self.router_address and self.router != "none":
            raise ConfigError(f"inference.router_address={self.router_address!r} names a running router and "
                              f"inference.router={self.router} asks the run to start one: set one of the two")
        if self.router_address and not self.addresses:
            raise ConfigError("inference.router_address: a router started outside the run cannot know the servers "
                              "the run launches; give the servers behind it in inference.addresses, or let the run "
                              "start the router (inference.router=smg)")
        if self.router == "none" and (self.router_args or self.router_bin):
            raise ConfigError("inference.router_args/router_bin are for a router the run starts: set "
                              "inference.router=smg, or leave them out")
        _positive("inference.request_timeout", self.request_timeout)
        if self.api_key is not None:
            raise ConfigError(f"inference.api_key must not be set: it would be written to the run's config.yaml; "
                              f"export the key in the environment variable {self.api_key_env} "
                              "(inference.api_key_env) instead")
        if not self.api_key_env or not self.api_key_env.replace("_", "").isalnum():
            raise ConfigError(f"inference.api_key_env={self.api_key_env!r} must be an environment variable name")
        _positive("inference.max_retries", self.max_retries, allow_zero=True)
        _positive("inference.unhealthy_timeout", self.unhealthy_timeout)
        _positive("inference.max_server_restarts", self.max_server_restarts, allow_zero=True)
        if self.radix_cache is not None and (self.addresses or self.backend == "simulated"):
            why = ("inference.addresses names servers already running: start them with or without "
                   "--disable-radix-cache yourself" if self.addresses else "the simulated engine has no cache")
            raise ConfigError(f"inference.radix_cache={str(self.radix_cache).lower()} is for the servers the run "
                              f"launches; {why}, and leave inference.radix_cache out")
        for key, args, owned in (("inference.extra_args", self.extra_args, SERVER_OWNED_FLAGS),
                                 ("inference.router_args", self.router_args, ROUTER_OWNED_FLAGS)):
            if (flag := owned_flag(args, owned)) is not None:
                raise ConfigError(f"{key} sets {flag}, which the run sets itself (it must know where its servers "
                                  "listen and what they serve): drop it (the model is model.path, the key "
                                  "inference.api_key_env)")
        if self.radix_cache and "--disable-radix-cache" in self.extra_args:
            raise ConfigError("inference.radix_cache=true and --disable-radix-cache in inference.extra_args contradict "
                              "each other: drop the flag, or set inference.radix_cache=false")


@dataclass
class RolloutConfig:
    consumer_batch_size: int = 8  # B: prompt groups per training step
    max_concurrent_rollouts: Optional[int] = None  # episodes in flight; None = B * (eta + 1)
    max_staleness: int = 2  # eta: max versions between a sample's head and the step training on it
    group_size: int = 4  # samples per prompt (GRPO)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    reward_timeout: float = 15.0  # seconds; a reward slower than this rejects the sample
    dynamic_filter: bool = True  # drop groups whose rewards are all equal (DAPO)
    # after this many dropped groups in a row the next one is kept anyway, so a solved task cannot
    # stall the run (null: no limit)
    dynamic_filter_max_drops: Optional[int] = 20
    # rlvr: one generation per sample | multi_turn: on a wrong answer a feedback turn and another try |
    # package.module:factory, factory(cfg, tokenizer, reward_fn) -> RolloutWorkflow (your own workflow)
    workflow: str = "rlvr"
    max_turns: int = 3  # multi_turn: tries per sample
    turn_discount: float = 0.9  # multi_turn: the reward is multiplied by this for every extra turn
    # failed episodes (errors, not rejections) in a row before the run stops with the first error; null = never
    max_consecutive_failures: Optional[int] = 32
    # ask the servers for every token's routed experts (SGLang: --enable-return-routed-experts, added to servers
    # the run launches); the trainer reports how often its routing differs (mismatch/route_*)
    return_routed_experts: bool = False
    # how a weight sync interrupts generation: abort (in-flight requests return their partial output and are
    # resubmitted; AReaL) | retract (the servers requeue them, prefilled again under the new weights) | in_place
    # (they keep their KV cache of the old weights) | none (no interruption: the sync waits for in-flight
    # requests to finish first; the paper's non-interruptible baseline)
    interrupt: str = "abort"
    # a control experiment: synchronous training fed batches generated exactly k versions earlier (step s trains
    # on what version s-k generated; steps s < k on version 0's), from a FIFO of generated batches: no rollout
    # overlaps a training step, so staleness is the only difference from sync (0: off). Needs max_staleness=0
    stale_batches: int = 0

    @property
    def staleness_budget(self) -> int:
        """The executor's eta: max_staleness, or stale_batches for the FIFO control."""
        return max(self.max_staleness, self.stale_batches)

    def validate(self) -> None:
        if self.stale_batches < 0 or (self.stale_batches and self.max_staleness):
            raise ConfigError(f"rollout.stale_batches={self.stale_batches} must be >= 0 and needs "
                              f"rollout.max_staleness=0 (got {self.max_staleness}): it is synchronous training on "
                              "k-version-old batches; set one of the two")
        if self.max_consecutive_failures is not None:
            _positive("rollout.max_consecutive_failures", self.max_consecutive_failures)
        _positive("rollout.consumer_batch_size", self.consumer_batch_size)
        _choice("rollout.interrupt", self.interrupt, ("abort", "retract", "in_place", "none"))
        _positive("rollout.max_staleness", self.max_staleness, allow_zero=True)
        if self.max_concurrent_rollouts is not None:
            _positive("rollout.max_concurrent_rollouts", self.max_concurrent_rollouts)
        _positive("rollout.group_size", self.group_size)
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _positive("rollout.temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.top_p} must be in (0, 1]")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"rollout.top_k={self.top_k} must be -1 (all tokens) or >= 1")
        _positive("rollout.reward_timeout", self.reward_timeout)
        if self.dynamic_filter and self.group_size < 2:
            raise ConfigError(f"rollout.dynamic_filter=true needs rollout.group_size >= 2 (got {self.group_size}): "
                              "a group of one always has equal rewards; set rollout.dynamic_filter=false")
        if self.dynamic_filter_max_drops is not None:
            _positive("rollout.dynamic_filter_max_drops", self.dynamic_filter_max_drops)
        wf = self.workflow
        if wf not in ("rlvr", "multi_turn") and not (":" in wf and all(p.isidentifier() for p in
                                                                         wf.replace(":", ".").split("."))):
            raise ConfigError(f"rollout.workflow={wf!r} is not rlvr, multi_turn or package.module:factory")
        _positive("rollout.max_turns", self.max_turns)
        if not 0 < self.turn_discount <= 1:
            raise ConfigError(f"rollout.turn_discount={self.turn_discount} must be in (0, 1]")


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic | gsm8k | jsonl
    path: Optional[str] = None  # local jsonl/parquet file or directory
    split: str = "train"
    max_prompt_tokens: int = 256  # longer prompts are skipped at load (their count is logged)
    max_row_bytes: int = 32 << 20  # a larger dataset row is refused at load, before anything tokenizes it
    shuffle: bool = True  # a seeded permutation per epoch (seed + epoch); the same after a resume
    # the reward function: synthetic | gsm8k | code | package.module:function (fn(prompt, completion, **item));
    # null = the dataset's own (synthetic -> synthetic, gsm8k -> gsm8k; a jsonl dataset must name one)
    reward: Optional[str] = None
    synthetic_target: Optional[int] = None  # synthetic task: one target token for every prompt; None = random each
    chat_template: bool = True  # gsm8k: prompts as chat messages through the tokenizer's chat template
    # held-out problems for evaluation: a file (or a directory with <eval_split>.jsonl/.parquet); null = the
    # eval_split beside data.path when there is one, else the last eval_size rows of the data, kept out of training
    eval_path: Optional[str] = None
    eval_split: str = "test"
    eval_size: int = 64  # N held-out problems scored by greedy pass@1

    def validate(self) -> None:
        _choice("data.name", self.name, ("synthetic", "gsm8k", "jsonl"))
        if self.name == "jsonl" and not self.path:
            raise ConfigError("data.name=jsonl needs data.path (a .jsonl or .parquet file)")
        rw = self.reward
        if rw is None and self.name == "jsonl":
            raise ConfigError("data.name=jsonl needs data.reward (gsm8k, code, synthetic or package.module:function): "
                              "without it every sample would be scored by the synthetic task's reward")
        if rw is not None and rw not in REWARDS and (":" not in rw or not all(rw.partition(":")[::2])):
            raise ConfigError(f"data.reward={rw!r} is not one of {', '.join(REWARDS)} or package.module:function")
        _positive("data.max_prompt_tokens", self.max_prompt_tokens)
        _positive("data.max_row_bytes", self.max_row_bytes)
        _positive("data.eval_size", self.eval_size)
        if self.synthetic_target is not None and self.synthetic_target < 1:
            raise ConfigError(f"data.synthetic_target={self.synthetic_target} must be a token id >= 1 (or null)")


@dataclass
class AlgorithmConfig:
    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None  # asymmetric clip-high (DAPO); None = eps_clip
    dual_clip: Optional[float] = None  # c > 1 for negative advantages; None = off
    behav_imp_weight_cap: Optional[float] = 5.0  # mask tokens whose behaviour weight exceeds it
    prox_logp: str = "recompute"  # recompute | loglinear | linear | behavior
    adv_norm: str = "group"  # group | drgrpo | rloo | batch | none
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    # token: decoupled PPO (token ratio) | gspo: sequence ratio exp(mean log-ratio), clipped per sequence
    objective: str = "token"
    # the behaviour-weight correction: cap_mask (tokens with w > behav_imp_weight_cap masked) | icepop (tokens with
    # w outside imp_weight_bounds masked) | seq_mask (sequences whose geometric-mean w is outside the bounds
    # masked) | tis (w truncated at behav_imp_weight_cap)
    imp_weight_mode: str = "cap_mask"
    imp_weight_bounds: list[float] = field(default_factory=lambda: [0.5, 5.0])  # [low, high] for icepop, seq_mask
    # R3: the trainer's MoE routers replay the experts each token was generated with (routes from the servers,
    # kept across interruptions); implies rollout.return_routed_experts
    routing_replay: bool = False

    def validate(self) -> None:
        _positive("algorithm.eps_clip", self.eps_clip)
        if self.eps_clip_high is not None and self.eps_clip_high < self.eps_clip:
            raise ConfigError(f"algorithm.eps_clip_high={self.eps_clip_high} must be >= algorithm.eps_clip="
                              f"{self.eps_clip}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (or null to disable)")
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
            raise ConfigError(f"algorithm.behav_imp_weight_cap={self.behav_imp_weight_cap} must be > 1 (or null)")
        _choice("algorithm.prox_logp", self.prox_logp, ("recompute", "loglinear", "linear", "behavior"))
        _choice("algorithm.adv_norm", self.adv_norm, ("group", "drgrpo", "rloo", "batch", "none"))
        _choice("algorithm.kl_estimator", self.kl_estimator, ("k1", "k2", "k3"))
        _choice("algorithm.objective", self.objective, ("token", "gspo"))
        _choice("algorithm.imp_weight_mode", self.imp_weight_mode, ("cap_mask", "icepop", "seq_mask", "tis"))
        lo_hi = list(self.imp_weight_bounds)
        if len(lo_hi) != 2 or not 0 < lo_hi[0] < lo_hi[1]:
            raise ConfigError(f"algorithm.imp_weight_bounds={lo_hi} must be [low, high] with 0 < low < high")
        if self.imp_weight_mode == "tis" and self.behav_imp_weight_cap is None:
            raise ConfigError("algorithm.imp_weight_mode=tis truncates at algorithm.behav_imp_weight_cap: set it "
                              "(e.g. 5)")
        _positive("algorithm.kl_coef", self.kl_coef, allow_zero=True)


RECOMPUTE = ("none", "selective", "full")  # trainer.recompute
# Megatron-Core 0.16's selective recompute modules (moe_act needs grouped GEMM, i.e. Transformer Engine; mla_up_proj
# needs MLA: Megatron refuses either elsewhere in one line)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass
class TrainerConfig:
    total_steps: int = 10
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_decay: str = "constant"  # constant | linear | cosine
    grad_clip: float = 1.0
    max_tokens_per_mb: int = 4096
    ppo_n_minibatches: int = 1
    # activation recompute (Megatron-Core's): none (every activation kept for the backward) | selective (only the
    # `recompute_modules` parts of each layer are run again in the backward) | full (each chunk of
    # `recompute_num_layers` layers keeps only its input and runs its forward again in the backward)
    recompute: str = "none"
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])  # selective: Megatron's names
    recompute_num_layers: int = 1  # full: layers per recomputed chunk
    save_interval: int = 0  # steps between checkpoints (<run_dir>/checkpoints/step_<N>); 0 = only at the end
    # also a checkpoint after the first step that ends this many minutes (wall clock, rank 0's) after the last one
    # or the start: a long run on a cluster loses at most about this much to a crash or a pre-emption whose
    # warning is too short to write one; 0 = off
    save_every_minutes: float = 0.0
    keep_checkpoints: int = 2  # newest complete checkpoints kept
    # every this many steps, and after the last, the trained weights as an HF directory (<run_dir>/hf_snapshots/
    # step_<S>, S the 0-based step just done as in metrics.jsonl; all kept: the tiny card's are ~1 MB), to score
    # offline, e.g. held-out accuracy against wall clock (tools/bench_paper.py); 0 = off
    hf_snapshot_interval: int = 0
    hf_snapshot_keep: int = 0  # the newest HF snapshots kept (older ones removed after each new one); 0 = all
    # never: start fresh (refused when the run directory already holds a run) | auto: continue from the newest
    # complete checkpoint if there is one, else start fresh | require: continue, refused without a checkpoint
    # (`mega-async train --resume`)
    resume: str = "never"
    # fields that may differ from the checkpoint's run on a resume (each logged), from RESUME_OVERRIDES; any other
    # difference (model, group size, seed) or one not named here is refused
    resume_override: list[str] = field(default_factory=list)
    weight_sync: str = "distributed"  # distributed (torch.distributed broadcast) | disk (HF dirs the servers load)
    sync_bucket_bytes: int = 512 << 20  # byte budget of one weight bucket (a layer's experts never split)
    sync_load_format: str = "flattened_bucket"  # flattened_bucket (one buffer per bucket) | tensor (one per tensor)
    # model_dtype: weights as trained (model.dtype) | fp8_block: e4m3 in the 128x128 blocks of model.path's FP8
    # checkpoint plus each weight's weight_scale_inv, what servers started on it load (mega_async.bridge.fp8)
    sync_weight_format: str = "model_dtype"
    sync_backend: Optional[str] = None  # gloo | nccl; null = nccl with CUDA, else gloo
    sync_timeout: float = 300.0  # seconds for one group set-up, bucket or server reply
    sync_master_address: Optional[str] = None  # where servers reach the trainer's stage heads; null = route to them
    keep_weight_versions: int = 2  # disk mode: newest version directories kept
    verify_sync: bool = False  # after each sync: every server holds exactly the weights the trainer sent
    verify_sync_tol: float = 1e-4  # probe only: the largest logprob difference allowed
    # checksum: every server's /weights_checker per-tensor checksums equal the trainer's digest of its own weights
    # (exact, names the server and the tensors) | probe: logprobs of a crafted prompt set within verify_sync_tol of
    # the trainer's (blind to a stale bucket at small learning rates) | auto: checksum wherever the servers can
    # hash their weights (the embedded server, SGLang 0.5.18+), else probe
    verify_sync_method: str = "auto"
    eval_interval: int = 0  # steps between evaluations on the held-out split (greedy pass@1); 0 = off
    # multi-token-prediction layers (num_nextn_predict_layers: DeepSeek-V3, GLM-4.5), which SGLang serves as its
    # NextN draft: train (jointly, their cross-entropy x mtp_loss_scaling_factor beside the policy loss, logged as
    # mtp_loss) | freeze (never run, carried unchanged) | init (freshly initialised, then trained like train) |
    # off (none built, synced or exported). A checkpoint carrying none of them (transformers saves none) trains
    # without them under train and freeze, with a warning. Set for a model without them: refused (`check_mtp`).
    mtp: str = "train"
    mtp_loss_scaling_factor: float = 0.1

    def _check_recompute(self) -> None:
        _choice("trainer.recompute", self.recompute, RECOMPUTE)
        for m in self.recompute_modules:
            _choice("trainer.recompute_modules", m, RECOMPUTE_MODULES)
        _positive("trainer.recompute_num_layers", self.recompute_num_layers)
        default = TrainerConfig()
        if self.recompute != "selective" and self.recompute_modules != default.recompute_modules:
            raise ConfigError(f"trainer.recompute_modules={self.recompute_modules} is read with "
                              f"trainer.recompute=selective only (it is {self.recompute}): set both, or leave the "
                              "modules out")
        if self.recompute != "full" and self.recompute_num_layers != default.recompute_num_layers:
            raise ConfigError(f"trainer.recompute_num_layers={self.recompute_num_layers} is read with "
                              f"trainer.recompute=full only (it is {self.recompute}): set both, or leave it out")
        if self.recompute == "selective" and not self.recompute_modules:
            raise ConfigError("trainer.recompute=selective with no trainer.recompute_modules recomputes nothing: "
                              "name modules (core_attn, layernorm, mlp, moe, shared_experts, ...) or use none")

    def recompute_options(self) -> dict[str, Any]:
        """Megatron-Core's TransformerConfig fields for trainer.recompute ({} for none)."""
        if self.recompute == "full":
            return {"recompute_granularity": "full", "recompute_method": "uniform",
                    "recompute_num_layers": self.recompute_num_layers}
        if self.recompute == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.recompute_modules)}
        return {}

    def check_mtp(self, mtp_layers: int) -> None:
        """A model without MTP layers and an MTP setting changed from its default: refused in one line (a setting
        is never accepted and then ignored)."""
        if mtp_layers:
            return
        default = TrainerConfig()
        changed = [f"trainer.{k}={getattr(self, k)}" for k in ("mtp", "mtp_loss_scaling_factor")
                   if getattr(self, k) != getattr(default, k) and not (k == "mtp" and self.mtp == "off")]
        if changed:
            raise ConfigError(f"{', '.join(changed)}: this model has no multi-token-prediction layers "
                              "(num_nextn_predict_layers 0 or absent); leave the MTP settings out")

    def validate(self) -> None:
        _positive("trainer.eval_interval", self.eval_interval, allow_zero=True)
        if self.mtp is False or self.mtp in ("False", "false"):  # YAML 1.1 reads an unquoted `off` as false
            self.mtp = "off"
        _choice("trainer.mtp", self.mtp, ("train", "freeze", "init", "off"))
        _positive("trainer.mtp_loss_scaling_factor", self.mtp_loss_scaling_factor, allow_zero=True)
        _positive("trainer.total_steps", self.total_steps)
        _positive("trainer.lr", self.lr)
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"trainer.min_lr={self.min_lr} must be in [0, trainer.lr={self.lr}]")
        _positive("trainer.weight_decay", self.weight_decay, allow_zero=True)
        _positive("trainer.warmup_steps", self.warmup_steps, allow_zero=True)
        if self.warmup_steps >= self.total_steps and self.warmup_steps > 0:
            raise ConfigError(f"trainer.warmup_steps={self.warmup_steps} must be < trainer.total_steps="
                              f"{self.total_steps}")
        _choice("trainer.lr_decay", self.lr_decay, ("constant", "linear", "cosine"))
        _positive("trainer.grad_clip", self.grad_clip, allow_zero=True)
        _positive("trainer.max_tokens_per_mb", self.max_tokens_per_mb)
        _positive("trainer.ppo_n_minibatches", self.ppo_n_minibatches)
        self._check_recompute()
        _positive("trainer.save_interval", self.save_interval, allow_zero=True)
        _positive("trainer.save_every_minutes", self.save_every_minutes, allow_zero=True)
        _positive("trainer.keep_checkpoints", self.keep_checkpoints)
        _positive("trainer.hf_snapshot_interval", self.hf_snapshot_interval, allow_zero=True)
        _positive("trainer.hf_snapshot_keep", self.hf_snapshot_keep, allow_zero=True)
        if self.hf_snapshot_keep and not self.hf_snapshot_interval:
            raise ConfigError("trainer.hf_snapshot_keep limits HF snapshots, which trainer.hf_snapshot_interval=0 "
                              "turns off: set an interval, or leave hf_snapshot_keep out")
        _choice("trainer.resume", str(self.resume), ("never", "auto", "require"))
        for key in self.resume_override:
            _choice("trainer.resume_override", key, RESUME_OVERRIDES)
        _choice("trainer.weight_sync", self.weight_sync, ("distributed", "disk"))
        _positive("trainer.sync_bucket_bytes", self.sync_bucket_bytes)
        _choice("trainer.sync_load_format", self.sync_load_format, ("flattened_bucket", "tensor"))
        _choice("trainer.sync_weight_format", self.sync_weight_format, ("model_dtype", "fp8_block"))
        if self.sync_weight_format == "fp8_block" and self.verify_sync and self.verify_sync_method == "probe":
            raise ConfigError("trainer.verify_sync_method=probe compares the servers' logprobs with the trainer's, "
                              "which FP8 weights change by design (trainer.sync_weight_format=fp8_block): use "
                              "checksum or auto")
        if self.sync_backend is not None:
            _choice("trainer.sync_backend", self.sync_backend, ("gloo", "nccl"))
        if not self.sync_timeout >= MIN_SYNC_TIMEOUT_S:
            raise ConfigError(f"trainer.sync_timeout={self.sync_timeout:g} is below {MIN_SYNC_TIMEOUT_S:g} s: a "
                              "weight-update group cannot even be set up in that time; use seconds (default 300)")
        if self.sync_master_address is not None and not host_name_ok(self.sync_master_address):
            raise ConfigError(f"trainer.sync_master_address={self.sync_master_address!r} is not an IP address or a "
                              "host name: give the address the servers reach this trainer at (or leave it out)")
        _positive("trainer.keep_weight_versions", self.keep_weight_versions)
        _positive("trainer.verify_sync_tol", self.verify_sync_tol)
        _choice("trainer.verify_sync_method", self.verify_sync_method, ("auto", "probe", "checksum"))


@dataclass
class LoggingConfig:
    root_dir: str = "runs"  # run directory = root_dir/experiment_name/trial_name
    tensorboard: bool = True
    level: str = "INFO"

    def validate(self) -> None:
        _choice("logging.level", self.level, ("DEBUG", "INFO", "WARNING", "ERROR"))


REWARDS = ("synthetic", "gsm8k", "code")
RESUME_OVERRIDES = ("rollout.consumer_batch_size", "data.synthetic_target")  # trainer.resume_override's choices


def api_key(cfg: "RunConfig") -> Optional[str]:
    """The inference API key of a run, from the environment (`inference.api_key_env`); None when unset."""
    return os.environ.get(cfg.inference.api_key_env) or None


@dataclass
class LaunchConfig:
    """`mega-async launch slurm`: the cluster shape (flags override it); the training run never reads it."""
    nodes: Optional[int] = None  # --nodes
    gpus_per_node: Optional[int] = None  # --gpus-per-node (CPU jobs: trainer ranks + servers per node)
    gpu_memory_gib: float = 80.0  # one GPU's memory: the launcher checks the model fits the servers and trainer
    partition: Optional[str] = None
    time: Optional[str] = None  # Slurm time limit, e.g. 04:00:00
    preempt_signal_s: int = 300  # --signal=B:USR1@<s>: the driver checkpoints and exits this long before the end
    startup_timeout: float = 1800.0  # seconds for the job's servers to answer /health
    # gpu: the job asks for GPUs and real SGLang servers run on them | cpu: a cluster (or CI) without GPUs: no GPUs
    # asked for, real SGLang servers run SGLang's CPU engine (tools/install_sglang_cpu.sh's environment), the same
    # job otherwise (the GPU recipes' branch: servers, router, trainer ranks, signals, requeue)
    device: str = "gpu"

    def validate(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            v = getattr(self, key)
            if v is not None:
                _positive(f"launch.{key}", v)
        _positive("launch.gpu_memory_gib", self.gpu_memory_gib)
        _positive("launch.preempt_signal_s", self.preempt_signal_s)
        _positive("launch.startup_timeout", self.startup_timeout)
        _choice("launch.device", self.device, ("gpu", "cpu"))
        if self.time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", self.time):
            raise ConfigError(f"launch.time={self.time!r} is not a Slurm time limit (minutes, HH:MM:SS or "
                              "D-HH:MM:SS)")


@dataclass
class RunConfig:
    experiment_name: str = "tiny"
    trial_name: str = "run0"
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.root_dir) / self.experiment_name / self.trial_name

    def allocation(self) -> Allocation:
        """`parallel.allocation` parsed, once (load_config checked it; every part reads this typed object). Raises
        AllocationError on a string that does not parse (a config built without load_config)."""
        cached = self.__dict__.get("_allocation")
        if cached is None or cached[0] != self.parallel.allocation:  # parsed again only if the string changed
            cached = (self.parallel.allocation, parse_allocation(self.parallel.allocation))
            self.__dict__["_allocation"] = cached
        return cached[1]

    def validate(self) -> None:
        """Every section checks itself, then what spans two sections; raises ConfigError naming the first bad key."""
        check_finite(self)  # NaN/inf in any float setting, before the range checks (NaN compares false)
        for name in ("experiment_name", "trial_name"):
            v = getattr(self, name)
            if not v or "/" in v or v in (".", ".."):
                raise ConfigError(f"{name}={v!r} must be a non-empty name without '/'")
        check_seed(self.seed)
        for section in (self.model, self.parallel, self.inference, self.rollout, self.data, self.algorithm,
                        self.trainer, self.logging, self.launch):
            section.validate()
        r, a, t, inf, alloc = self.rollout, self.algorithm, self.trainer, self.inference, self.allocation()
        if inf.backend == "sglang" and not inf.addresses and not self.model.path:
            raise ConfigError("inference.backend=sglang needs inference.addresses or model.path to launch servers")
        if t.eval_interval and self.data.name != "gsm8k":
            raise ConfigError(f"trainer.eval_interval={t.eval_interval} needs data.name=gsm8k (the held-out split "
                              f"and its pass@1); got data.name={self.data.name}. Set trainer.eval_interval=0")
        if a.adv_norm in ("group", "drgrpo", "rloo") and r.group_size < 2:
            raise ConfigError(f"algorithm.adv_norm={a.adv_norm} needs rollout.group_size >= 2 (got {r.group_size})")
        if (a.objective == "gspo" or a.imp_weight_mode == "seq_mask") and alloc.train.cp > 1:
            key = "objective=gspo" if a.objective == "gspo" else "imp_weight_mode=seq_mask"
            raise ConfigError(f"algorithm.{key} needs whole sequences on one rank; context parallelism "
                              f"c{alloc.train.cp} in parallel.allocation splits them (use c1)")
        if r.workflow == "multi_turn" and inf.backend == "simulated":
            raise ConfigError("rollout.workflow=multi_turn writes feedback turns with the model card's chat template; "
                              "inference.backend=simulated has no tokenizer (use embedded or sglang)")
        if (a.routing_replay or r.return_routed_experts) and inf.backend == "simulated":
            raise ConfigError("algorithm.routing_replay / rollout.return_routed_experts need servers that return "
                              "routed experts; inference.backend=simulated has none (use embedded or sglang)")
        if t.ppo_n_minibatches > r.consumer_batch_size:
            raise ConfigError(f"trainer.ppo_n_minibatches={t.ppo_n_minibatches} exceeds rollout.consumer_batch_size="
                              f"{r.consumer_batch_size}: every mini-batch needs at least one prompt group")
        if inf.backend != "simulated":
            if alloc.inference is None:
                raise ConfigError(f"parallel.allocation={self.parallel.allocation!r} has no inference part: name the "
                                  "servers first, e.g. sglang:d1+megatron:d1")
            n = alloc.inference.strategy.dp
            if alloc.trainer is not None and r.consumer_batch_size < alloc.trainer.strategy.dp:
                raise ConfigError(f"rollout.consumer_batch_size={r.consumer_batch_size} is below the trainer's "
                                  f"data-parallel size {alloc.trainer.strategy.dp}: every DP rank needs at least one "
                                  "prompt group")
            if inf.addresses and len(inf.addresses) != n:
                raise ConfigError(f"inference.addresses lists {len(inf.addresses)} servers but parallel.allocation's "
                                  f"inference part {alloc.inference.backend}:d{n} says {n}")


def _yaml_value(v: Any) -> str:
    """`v` as it would be written in the YAML file (a string YAML would read as something else is quoted)."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    if isinstance(v, str):
        try:
            plain = bool(v) and "," not in v and yaml.safe_load(v) == v
        except yaml.YAMLError:
            plain = False
        return v if plain else repr(v)
    if isinstance(v, float) and "e" in repr(v) and "." not in repr(v):  # 1e-05 is a string to YAML 1.1: 1.0e-05
        return repr(v).replace("e", ".0e")
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def check_finite(cfg: Any, prefix: str = "") -> None:
    """Refuse NaN in every float setting of a dataclass config (sections and lists included) and +-inf unless the
    field's metadata has allow_inf: a range check compares false with NaN, so none of them would catch it."""
    for f in dataclasses.fields(cfg):
        v, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(v):
            check_finite(v, key + ".")
            continue
        many = isinstance(v, (list, tuple))
        for i, x in enumerate(v if many else [v]):
            if isinstance(x, float) and (math.isnan(x) or (math.isinf(x) and not f.metadata.get("allow_inf"))):
                default = f"(default {_yaml_value(f.default)})" if f.default is not dataclasses.MISSING else ""
                raise ConfigError(f"{key}{f'[{i}]' if many else ''}={x} is not a finite number: set a number "
                                  f"{default}".rstrip())


def _choice(key: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def _positive(key: str, value: float | int, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")
