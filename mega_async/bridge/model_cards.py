"""Model cards under models/: HF configs + tokenizers; random-init weights made locally, never downloaded. What a
card asks for (`count_params`) is checked against the memory there is (`check_fits_memory`) before any model is
built: by the random init here, the embedded server, the trainer and the converter."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

from mega_async.utils.outputs import EXPORT_MARK

logger = logging.getLogger("mega_async.bridge.model_cards")

REPO_ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = REPO_ROOT / "models" / "tiny-qwen3-moe"
TINY_DENSE = REPO_ROOT / "models" / "tiny-qwen3"
# DeepSeek-V3 architecture: MLA, a dense first layer, shared experts, sigmoid + bias group-limited routing
TINY_DEEPSEEK = REPO_ROOT / "models" / "tiny-deepseek-v3"
# GLM-4.5 (Glm4MoeForCausalLM): shared experts, sigmoid + bias routing, partial rotary, qkv bias
TINY_GLM = REPO_ROOT / "models" / "tiny-glm4-moe"
MOE_CARDS = {"qwen3_moe": TINY_MOE, "deepseek_v3": TINY_DEEPSEEK, "glm4_moe": TINY_GLM}


def has_weights(model_dir: str | os.PathLike) -> bool:
    d = Path(model_dir)
    return (d / "model.safetensors").exists() or (d / "model.safetensors.index.json").exists()


def copy_model_files(src: str | os.PathLike, dst: str | os.PathLike, skip: tuple[str, ...] = ()) -> None:
    """An HF directory's files other than its weights (config, tokenizer, chat template, generation config) into
    `dst`: what every writer of an HF directory copies (the export, the converter, the FP8 quantizer). Names in
    `skip` are left out too (a writer that rewrites them)."""
    import shutil

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json" \
                and f.name not in skip and f.name != EXPORT_MARK:  # (the writer marks its own output)
            shutil.copy2(f, dst / f.name)


def ensure_weights(model_dir: str | os.PathLike, seed: int = 0) -> bool:
    """A card with a config but no weights gets its deterministic random init (seed) in place, once; returns
    whether it was written now. Every driver and launcher calls this one (the tiny CPU cards ship configs only)."""
    if has_weights(model_dir):
        return False
    logger.info("%s has no weights yet: writing a deterministic random init (seed %d)", model_dir, seed)
    init_random_weights(model_dir, seed=seed)
    return True


def init_random_weights(model_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, seed: int = 0,
                        force: bool = False) -> Path:
    """Write deterministic random-init safetensors for the config in `model_dir` (to `out_dir` or in place).

    Same seed, same torch version -> the same bytes. Existing weights are kept unless `force`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = Path(model_dir)
    dst = Path(out_dir) if out_dir is not None else src
    if has_weights(dst) and not force:
        return dst
    if not (src / "config.json").exists():
        raise FileNotFoundError(f"{src}/config.json not found: a model card directory needs an HF config")
    check_fits_memory(src, str(src), dtype_bytes=4, what="in float32 for its random init")
    cfg = AutoConfig.from_pretrained(src)
    import torch

    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _random_router_bias(model)
        append_mtp_layers(cfg, model)  # transformers builds no MTP layers: saved beside the model's
    dst.mkdir(parents=True, exist_ok=True)
    import shutil
    import tempfile

    # a folder of its own (two runs or tests initialising one card at once each write whole files, and the
    # last rename wins with the same bytes); removed whatever happens
    save = Path(tempfile.mkdtemp(prefix=".tmp_save.", dir=dst))
    try:
        model.save_pretrained(str(save))
        os.replace(save / "model.safetensors", dst / "model.safetensors")
    finally:
        shutil.rmtree(save, ignore_errors=True)
    if dst != src:
        for f in src.iterdir():
            if f.is_file() and f.name != "model.safetensors" and not (dst / f.name).exists():
                shutil.copy2(f, dst / f.name)
        AutoTokenizer.from_pretrained(src)  # fail early when the card's tokenizer is broken
    logger.info("wrote random-init weights (seed %d, %d params) to %s", seed,
                sum(p.numel() for p in model.parameters()), dst)
    return dst


def append_mtp_layers(cfg: Any, model: torch.nn.Module) -> list[str]:
    """A config with multi-token-prediction layers (num_nextn_predict_layers, DeepSeek-V3 and GLM-4.5) gets them
    as the published checkpoints hold them, model.layers.{num_hidden_layers + k}.*: a decoder block initialised by
    transformers (as layer num_hidden_layers + k), enorm / hnorm / shared_head.norm at one, eh_proj drawn like the
    other linears, and copies of the embedding and head (embed_tokens, shared_head.head). Appended to the model's
    layers, so save_pretrained writes them under its checkpoint names (experts one by one) and the embedded server
    keeps them by those names (transformers' forward runs the first num_hidden_layers only); drawn from the seeded
    generator after the model: deterministic. Returns the added layers' name prefixes."""
    import torch

    k_layers = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    n, h = int(cfg.num_hidden_layers), int(cfg.hidden_size)
    std = float(getattr(cfg, "initializer_range", 0.02))
    for k in range(k_layers):
        layer = type(model.model.layers[-1])(cfg, n + k).float()
        for sub in layer.modules():
            model._init_weights(sub)
        _random_router_bias(layer)
        norm = type(model.model.norm)
        layer.enorm, layer.hnorm = norm(h, eps=cfg.rms_norm_eps), norm(h, eps=cfg.rms_norm_eps)
        layer.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        torch.nn.init.normal_(layer.eh_proj.weight, 0.0, std)
        layer.shared_head = torch.nn.Module()
        layer.shared_head.norm = norm(h, eps=cfg.rms_norm_eps)
        layer.shared_head.head = torch.nn.Linear(h, int(cfg.vocab_size), bias=False)
        layer.embed_tokens = torch.nn.Embedding(int(cfg.vocab_size), h)
        with torch.no_grad():
            for w in (layer.enorm.weight, layer.hnorm.weight, layer.shared_head.norm.weight):
                w.fill_(1.0)
            layer.shared_head.head.weight.copy_(model.lm_head.weight)
            layer.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
        model.model.layers.append(layer.to(next(model.parameters()).dtype))
    return [f"model.layers.{n + k}." for k in range(k_layers)]


def _random_router_bias(model: torch.nn.Module, std: float = 0.02) -> None:
    """transformers initialises sigmoid routers' `e_score_correction_bias` to zeros; a trained DeepSeek-V3 or
    GLM-4.5 has a bias that changes which experts are picked (not their weights). A random one, of the size
    of the sigmoid scores' spread, makes the tiny cards exercise that path."""
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, std)


def derive_card(base: str | os.PathLike, out_dir: str | os.PathLike, seed: int = 0, **config: Any) -> Path:
    """A model card like `base` with some config fields changed (e.g. num_hidden_layers=3), its tokenizer
    files copied and deterministic random weights written; returns `out_dir`."""
    from transformers import AutoConfig

    base, out = Path(base), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.from_pretrained(base)
    for k, v in config.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(out)
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (out / f.name).write_bytes(f.read_bytes())
    init_random_weights(out, seed=seed)
    return out


# --- what a card asks for -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamCount:
    """Parameters of the main model (what transformers builds and the trainer trains); MTP layers apart."""
    dense: int  # embeddings, attention, norms, routers, dense MLPs, shared experts: split by TP (and PP)
    expert: int  # routed experts: split by EP x ETP (and PP)
    expert_active: int = 0  # the routed experts one token passes through (top-k of each MoE layer)
    embed: int = 0  # the input embedding (a lookup, in `dense`)
    head: int = 0  # the output head (in `dense`; 0 when tied to the embedding)
    mtp: int = 0  # multi-token-prediction layers (num_nextn_predict_layers), not in dense/expert
    mtp_active: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.expert

    @property
    def active(self) -> int:
        """Parameters one token's forward multiplies with: the embedding lookup excluded, the head included
        (DeepSeek's convention for "37B activated")."""
        return self.dense - self.embed + self.expert_active

    @property
    def non_embedding(self) -> int:
        return self.total - self.embed - self.head


def _experts(c: Any) -> int:
    return (getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
            or getattr(c, "n_routed_experts", None) or 0)


def _attention(c: Any) -> int:
    """One layer's attention with its two norms: MLA (DeepSeek-V3: q/kv low-rank projections) or GQA."""
    h, heads = c.hidden_size, c.num_attention_heads
    if getattr(c, "kv_lora_rank", None):
        q_lora, kv_lora = getattr(c, "q_lora_rank", None), c.kv_lora_rank
        nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q = h * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        kv = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)  # kv_a (+ rope key), norm, kv_b
        return q + kv + heads * v * h + 2 * h
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2 + 2 * h  # q, o, k, v projections; input and post norms
    if getattr(c, "attention_bias", False):
        attn += heads * hd + 2 * kv * hd + (0 if c.model_type == "glm4_moe" else h)  # GLM: no o_proj bias
    if c.model_type in ("qwen3", "qwen3_moe") or getattr(c, "use_qk_norm", False):
        attn += 2 * hd  # q_norm, k_norm
    return attn


def _moe_layers(c: Any, layers: int) -> int:
    """How many of the layers are MoE, counted without a list (a card may say 10**12 layers)."""
    if not _experts(c):
        return 0
    if getattr(c, "first_k_dense_replace", None) is not None:  # DeepSeek-V3, GLM-4.5: dense layers first
        freq = getattr(c, "moe_layer_freq", 1) or 1
        first = -(-max(0, c.first_k_dense_replace) // freq) * freq  # the first multiple of freq past the dense ones
        return -(-(layers - first) // freq) if layers > first else 0
    step = getattr(c, "decoder_sparse_step", 1) or 1
    only = set(getattr(c, "mlp_only_layers", []) or [])
    return layers // step - sum(1 for i in only if 0 <= i < layers and (i + 1) % step == 0)


def count_params(c: Any) -> ParamCount:
    """Parameters of a Qwen3/Qwen2/Mixtral-, DeepSeek-V3- (MLA, Kimi-K2) or GLM-4.5-style decoder from its
    HF config, as the checkpoint holds them (the router's e_score_correction_bias included)."""
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    experts = _experts(c)
    ffn = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    expert_mlp = 3 * h * ffn
    top_k = getattr(c, "num_experts_per_tok", None) or 0
    shared = (getattr(c, "n_shared_experts", None) or 0) * expert_mlp
    shared += 3 * h * (getattr(c, "shared_expert_intermediate_size", None) or 0)  # Qwen2-MoE
    bias = experts if c.model_type in ("deepseek_v3", "glm4_moe") else 0  # e_score_correction_bias
    router = h * experts + bias + (h if getattr(c, "shared_expert_intermediate_size", None) else 0)
    attn, dense_mlp = _attention(c), 3 * h * c.intermediate_size
    n_moe = _moe_layers(c, layers)
    dense = layers * attn + (layers - n_moe) * dense_mlp + n_moe * (router + shared)
    tied = bool(getattr(c, "tie_word_embeddings", False))
    embed, head = vocab * h, 0 if tied else vocab * h
    mtp_layers = getattr(c, "num_nextn_predict_layers", None) or 0
    # each MTP module: enorm, hnorm, eh_proj (2h -> h), one decoder layer (MoE past the dense ones),
    # shared_head.norm; its embedding and head are the main model's
    mtp_base = 3 * h + 2 * h * h + attn + ((router + shared) if experts else dense_mlp)
    mtp = mtp_layers * (mtp_base + experts * expert_mlp)
    return ParamCount(dense + embed + head + h, n_moe * experts * expert_mlp, n_moe * top_k * expert_mlp,
                      embed, head, mtp, mtp_layers * (mtp_base + top_k * expert_mlp))


class ModelTooLarge(ValueError):
    """A model card asks for more memory than there is; the message names the card and the numbers."""


class _RawConfig:
    """A config.json's fields as attributes (None where absent), read without transformers: its config classes
    build per-layer lists, so a card with 10**12 layers would run out of memory before any check."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:
        return None


def read_card(card: Any) -> Any:
    if isinstance(card, (str, os.PathLike)):
        try:
            with open(Path(card) / "config.json") as f:
                fields = json.load(f)
        except (OSError, ValueError):  # no card or no JSON: what reads it next says so
            fields = {}
        return _RawConfig(fields if isinstance(fields, dict) else {})
    return card


def available_memory() -> int:
    """Bytes this process may still allocate on the host: psutil's available memory, within its cgroup's limit."""
    import psutil

    free = psutil.virtual_memory().available
    try:
        with open("/proc/self/cgroup") as f:
            own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
    except OSError:
        return free
    for ctrl, limit, usage in (("", "memory.max", "memory.current"),
                               ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        if ctrl not in own:
            continue
        d = f"/sys/fs/cgroup{'' if not ctrl else '/' + ctrl}{own[ctrl].rstrip('/')}"
        try:
            cap, used = (open(f"{d}/{name}").read().strip() for name in (limit, usage))
            if cap.isdigit() and used.isdigit():
                free = min(free, max(0, int(cap) - int(used)))
        except OSError:
            pass
    return free


def _size(n: int, unit: str = "") -> str:
    """1.2e+15 (an int of any size, no float overflow) or 3.4 GiB."""
    if unit:
        return f"{n / 2**30:.1f} GiB" if n < 1 << 80 else f"about 2^{n.bit_length() - 30} GiB"
    if n < 10**15:
        return f"{n:,}"
    digits = int((n.bit_length() - 1) * 0.30103)
    return f"about 10^{digits}"


def check_fits_memory(card: Any, where: str, *, dtype_bytes: int, dense_shards: int = 1, expert_shards: int = 1,
                      memory: Optional[int] = None, what: str = "") -> Optional[ParamCount]:
    """Refuse (ModelTooLarge, one line naming `where` and the numbers) a model card (a directory, read as raw JSON,
    or a config) whose parameters, this process's share of them (dense ones split `dense_shards` ways, routed
    experts `expert_shards` ways), need more than `memory` bytes (default: `available_memory()`), before anything
    is allocated. A config this cannot count (fields missing or not numbers) passes: transformers says what is
    wrong with it. Returns the count."""
    c = read_card(card)
    try:
        p = count_params(c)
        need = (p.dense // max(1, dense_shards) + p.expert // max(1, expert_shards)) * dtype_bytes
    except (AttributeError, TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    have = available_memory() if memory is None else memory
    if need > have:
        sizes = ", ".join(f"{k}={getattr(c, k)}" for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                             "moe_intermediate_size", "vocab_size", "num_experts",
                                                             "n_routed_experts", "num_local_experts")
                          if getattr(c, k, None) is not None)
        share = "" if dense_shards == expert_shards == 1 else f" (this process's share: dense / {dense_shards}, " \
                                                               f"experts / {expert_shards})"
        raise ModelTooLarge(f"{where}: the model card asks for {_size(p.total)} parameters ({sizes}): "
                            f"{_size(need, 'B')}{share} {what or f'at {dtype_bytes} bytes each'}, but "
                            f"{_size(have, 'B')} of memory is available here; check the card's sizes")
    return p


DTYPES = ("float32", "bfloat16", "float16")  # dtypes a converted checkpoint may hold (convert --dtype)


def source_dtype(hf_dir: Path) -> str:
    """The dtype an HF directory's config.json names (`dtype`, or the older `torch_dtype`), else float32."""
    try:
        config = json.loads((Path(hf_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32") if isinstance(config, dict) else ""
    return name if name in DTYPES else "float32"


def set_config_dtype(hf_dir: Path, name: str) -> None:
    """config.json says `name` (under the key it uses; `torch_dtype`, which every reader knows, when it has none)."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    if any(config.get(k) != name for k in keys):
        config.update({k: name for k in keys})
        path.write_text(json.dumps(config, indent=2) + "\n")


def set_config_mtp(hf_dir: Path, layers: int) -> None:
    """config.json's num_nextn_predict_layers says the multi-token-prediction layers written beside it (a model
    trained or converted without the ones its card asked for: 0)."""
    path = Path(hf_dir) / "config.json"
    config = json.loads(path.read_text())
    if int(config.get("num_nextn_predict_layers") or 0) != layers:
        config["num_nextn_predict_layers"] = layers
        path.write_text(json.dumps(config, indent=2) + "\n")
