"""HF <-> Megatron names of multi-token-prediction (MTP) layers (DeepSeek-V3, GLM-4.5: `num_nextn_predict_layers`).

An HF checkpoint appends MTP layer k (0-based) as `model.layers.{num_hidden_layers + k}.*`: `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`, a full decoder block (`self_attn.*`, `mlp.*` with its experts), and copies of the
embedding (`embed_tokens`) and output head (`shared_head.head`). Megatron-Core builds it as `mtp.layers.{k}.*`:
`enorm`, `hnorm`, `eh_proj`, `final_layernorm` (= shared_head.norm) and `transformer_layer.*`, and shares the
model's embedding and output layer (as DeepSeek-V3 trains it and SGLang's NextN draft serves it: the draft takes
the target's embedding and head and skips the layer's own copies). So the copies load from nothing (the main
embedding and head are read) and are exported as copies of them. Pure name mapping: no model is built here.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Optional

_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
# the MTP layer's own modules: Megatron suffix -> HF suffix under model.layers.{N + k}
OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "final_layernorm.weight": "shared_head.norm.weight"}
# the checkpoint's per-layer copies of what Megatron shares: main HF name -> HF suffix under model.layers.{N + k}
SHARED = {"model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}


def mtp_layers(hf: Any) -> int:
    """How many MTP layers an HF config asks for (0 when none)."""
    return int(getattr(hf, "num_nextn_predict_layers", 0) or 0)


def global_name(name: str, num_layers: int) -> str:
    """A Megatron MTP parameter name -> the name the family's tables map: the MTP layer's decoder block becomes
    decoder layer num_layers + k (its HF layer); its own modules keep their `mtp.layers.k.` names."""
    m = _MTP.match(name)
    if m and m[2].startswith("transformer_layer."):
        return f"decoder.layers.{num_layers + int(m[1])}." + m[2][len("transformer_layer."):]
    return name


def hf_names(name: str, num_layers: int) -> Optional[list[str]]:
    """HF names of an MTP layer's own module (enorm, hnorm, eh_proj, final_layernorm); None for any other name."""
    m = _MTP.match(name)
    if m and m[2] in OWN:
        return [f"model.layers.{num_layers + int(m[1])}.{OWN[m[2]]}"]
    return None


def export_names(hf_name: str, num_layers: int, mtp: int, main_here: bool, mtp_here: bool) -> list[str]:
    """The HF names one exported tensor goes out under: the embedding and output head also as every MTP layer's
    copy on the stage that holds the MTP layers; a stage holding only the MTP layers' embedding copy (pipeline
    parallel: the last stage) exports it only as those copies."""
    suffix = SHARED.get(hf_name)
    if suffix is None or not mtp:
        return [hf_name]
    copies = [f"model.layers.{num_layers + k}.{suffix}" for k in range(mtp)] if mtp_here else []
    return ([hf_name] if main_here else []) + copies


def is_mtp_hf_name(hf_name: str, num_layers: int) -> bool:
    """Whether an HF tensor belongs to an MTP layer (model.layers.{>= num_hidden_layers}.*)."""
    m = re.match(r"^model\.layers\.(\d+)\.", hf_name)
    return bool(m) and int(m[1]) >= num_layers


def shared_copy_of(hf_name: str, num_layers: int) -> Optional[str]:
    """The main tensor an MTP layer's embedding or head copy duplicates (None for any other name)."""
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", hf_name)
    if not m or int(m[1]) < num_layers:
        return None
    for main, suffix in SHARED.items():
        if m[2] == suffix:
            return main
    return None


# trainer.mtp: train (load and train the checkpoint's MTP layers) | freeze (load, never run, carried unchanged) |
# init (freshly initialised MTP layers, trained from here) | off (no MTP layers: built, trained, synced nor exported)
MODES = ("train", "freeze", "init", "off")


def held_layers(names: Iterable[str], num_layers: int) -> set[int]:
    """The MTP layers (0-based k) of which a checkpoint carries any tensor: model.layers.{num_layers + k}.*."""
    held = set()
    for name in names:
        m = re.match(r"^model\.layers\.(\d+)\.", name)
        if m and int(m[1]) >= num_layers:
            held.add(int(m[1]) - num_layers)
    return held


def plan(asked: int, held: set[int], mode: str, where: str) -> tuple[int, bool, Optional[str]]:
    """What the trainer builds of a card's `asked` MTP layers when its checkpoint carries the layers `held`, under
    trainer.mtp=`mode`: (layers built, whether they start fresh instead of loading, a warning to log or None).

    transformers keeps no MTP layer (DeepseekV3ForCausalLM and Glm4MoeForCausalLM have no module for it), so a model
    saved with save_pretrained says num_nextn_predict_layers: 1 and carries none of its weights: under train or
    freeze it trains without them (said once; the exports say 0), under init it gets fresh ones. A checkpoint
    holding some of the asked layers only is refused (a ValueError, one line)."""
    if mode not in MODES:
        raise ValueError(f"trainer.mtp={mode!r}: use one of {', '.join(MODES)}")
    if not asked or mode == "off":
        return 0, False, None
    if mode == "init":
        return asked, True, None
    if not held:
        return 0, False, (f"{where}: config.json asks for {asked} multi-token-prediction layer(s) "
                          "(num_nextn_predict_layers) but the checkpoint carries none of their weights (as "
                          "transformers saves a model): the model is built, trained and exported without them (the exported "
                          "config.json says num_nextn_predict_layers: 0, so no NextN draft can be served from it); "
                          "trainer.mtp=init trains fresh ones, trainer.mtp=off says this on purpose")
    if held != set(range(asked)):
        raise ValueError(f"{where}: config.json asks for {asked} multi-token-prediction layer(s) "
                         f"(num_nextn_predict_layers) but the checkpoint carries layer(s) "
                         f"{', '.join(map(str, sorted(held)))} of them (0-based, after the "
                         f"model's own): set num_nextn_predict_layers to what it holds, or trainer.mtp=init (fresh "
                         "layers) or trainer.mtp=off (none)")
    return asked, False, None
