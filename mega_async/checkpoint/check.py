"""A checkpoint is checked as a whole before a resume starts anything: its manifest (every file's size and
sha256, written last) first, then trainer.json's fields, the distributed checkpoint's metadata and objects,
the RNG and rollout files, and what the checkpoint's run was (model, batch size, task) against this config.
Every refusal is one line, `<path>: <what>; <fix>`. The run directory itself may hold no symbolic link and
nothing but files and folders, so that nothing outside it is followed, truncated or deleted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

from mega_async.utils.safe_load import (CheckpointError, check_bytes_entries, first_line, read_dist_metadata,
                                  safe_torch_load)

logger = logging.getLogger("mega_async.checkpoint.format")

MANIFEST = "manifest.json"
MAX_JSON_BYTES = 16 << 20  # trainer.json, manifest.json, metadata.json: a few KB when genuine
_CHUNK = 8 << 20


# ---- the run directory ----------------------------------------------------------------------------------
def check_run_dir(run_dir: str | Path) -> None:
    """Refuse a run directory holding a symbolic link, a FIFO/socket/device, or a hard-linked log (a resume
    truncates and appends to the logs, and deletes old weights and checkpoints: only inside the directory)."""
    root = Path(run_dir)
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root):  # does not descend into linked folders
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise CheckpointError(f"{p}: is a symbolic link (to {os.readlink(p)}); a run directory must hold its "
                                      "own files: replace the link by what it points to, or start another trial_name")
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise CheckpointError(f"{p}: is not a regular file or folder; remove it")
            if Path(dirpath) == root and stat.S_ISREG(st.st_mode) and st.st_nlink > 1 \
                    and name.endswith((".jsonl", ".log")):
                raise CheckpointError(f"{p}: has {st.st_nlink} hard links (a resume truncates and appends to it); "
                                      "replace it by a copy")


# ---- manifest -------------------------------------------------------------------------------------------
def _files(ckpt: Path) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(ckpt):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(ckpt).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_all(ckpt: Path, rels: list[str]) -> dict[str, str]:
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:  # hashlib releases the GIL
        return dict(zip(rels, pool.map(lambda r: _sha256(ckpt / r), rels)))


def write_manifest(ckpt: str | Path) -> Path:
    """`<ckpt>/manifest.json`: size and sha256 of every other file of the checkpoint (written last)."""
    d = Path(ckpt)
    rels = _files(d)
    digests = _hash_all(d, rels)
    files = {r: {"size": (d / r).stat().st_size, "sha256": digests[r]} for r in rels}
    tmp = d / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump({"format": "mega_async-checkpoint", "version": 1, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / MANIFEST)
    return d / MANIFEST


def read_json(path: Path, what: str, fix: str) -> Any:
    """A small JSON file of a checkpoint: a regular file, bounded, parsed, else one line."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({what}); {fix}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file ({what}); {fix}")
    if st.st_size > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {st.st_size} bytes, more than a {what} can be; {fix}")
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({first_line(e)}): truncated or damaged; {fix}") from None


def verify_manifest(ckpt: str | Path) -> bool:
    """Every file the manifest lists is there with its size and sha256, and no other file; False when the
    checkpoint has no manifest (written before manifests existed)."""
    d = Path(ckpt)
    if not (d / MANIFEST).exists() and not (d / MANIFEST).is_symlink():
        return False
    fix = _fix(d)
    m = read_json(d / MANIFEST, "checkpoint manifest", fix)
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, dict) and isinstance(v.get("size"), int)
                                              and isinstance(v.get("sha256"), str) for v in files.values()):
        raise CheckpointError(f"{d / MANIFEST}: not a checkpoint manifest (files: {{path: {{size, sha256}}}}); {fix}")
    present = set(_files(d))
    for rel in sorted(files):
        if rel not in present:
            raise CheckpointError(f"{d / rel}: missing (listed in {MANIFEST}): the checkpoint is incomplete; {fix}")
    for rel in sorted(present - set(files)):
        raise CheckpointError(f"{d / rel}: not in {MANIFEST} (not written with this checkpoint); remove it")
    for rel, want in sorted(files.items()):
        st = (d / rel).lstat()
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{d / rel}: not a regular file (a link or special file); {fix}")
        size = st.st_size
        if size != want["size"]:
            raise CheckpointError(f"{d / rel}: {size} bytes, {MANIFEST} says {want['size']} (truncated or changed "
                                  f"since it was written); {fix}")
    digests = _hash_all(d, sorted(files))
    for rel, want in sorted(files.items()):
        if digests[rel] != want["sha256"]:
            raise CheckpointError(f"{d / rel}: its sha256 differs from {MANIFEST} (the file changed since the "
                                  f"checkpoint was written); {fix}")
    return True


def _fix(ckpt: Path) -> str:
    older = sorted(p for p in ckpt.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit() and p != ckpt
                   and int(p.name[5:]) < int(ckpt.name[5:] or 0)) if ckpt.name[5:].isdigit() else []
    if older:
        return f"restore it from where it was copied, or remove {ckpt} to resume from {older[-1].name}"
    return "restore it from where it was copied, or start a fresh run (another trial_name)"


# ---- trainer.json -----------------------------------------------------------------------------------------
_SIZES = ("metrics_bytes", "ledger_bytes", "events_bytes")
_MAX_INT = 1 << 62


def _int(meta: dict, key: str, path: Path, lo: int = 0, required: bool = True) -> None:
    v = meta.get(key)
    if v is None and not required and key not in meta:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _MAX_INT:
        raise CheckpointError(f"{path}: {key}={v!r} must be an integer >= {lo}; the file is damaged or was "
                              f"edited: {_fix(path.parent)}")


def read_trainer_json(path: str | Path) -> dict[str, Any]:
    """trainer.json with its fields' types and ranges checked (one line naming the field)."""
    p = Path(path)
    meta = read_json(p, "checkpoint's trainer state", _fix(p.parent))
    if not isinstance(meta, dict):
        raise CheckpointError(f"{p}: holds a {type(meta).__name__}, not the trainer state (an object); "
                              f"{_fix(p.parent)}")
    for key in ("step", "version"):
        _int(meta, key, p)
    for key in ("world_size", "optimizers"):
        _int(meta, key, p, lo=1)
    for key in _SIZES:
        _int(meta, key, p, required=False)
    if not isinstance(meta.get("allocation"), str):
        raise CheckpointError(f"{p}: allocation={meta.get('allocation')!r} must be a layout string; "
                              f"{_fix(p.parent)}")
    sch = meta.get("scheduler")
    numeric = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps")
    if not isinstance(sch, dict) or not all(isinstance(sch.get(k), (int, float)) and not isinstance(sch.get(k), bool)
                                            for k in numeric) or not isinstance(sch.get("lr_decay_style"), str):
        raise CheckpointError(f"{p}: scheduler must hold numbers {', '.join(numeric)} and lr_decay_style; "
                              f"{_fix(p.parent)}")
    _int(sch, "num_steps", p)
    for key in ("run", "model_config"):
        if key in meta and not isinstance(meta[key], dict):
            raise CheckpointError(f"{p}: {key} must be an object; {_fix(p.parent)}")
    return meta


# ---- what the checkpoint's run was ----------------------------------------------------------------------
# shape- and architecture-defining fields of an HF config.json: a checkpoint resumes only into the same model
MODEL_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "shared_expert_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts",
              "num_experts_per_tok", "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers",
              "moe_layer_freq", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "tie_word_embeddings", "attention_bias")
# fields of the run whose change makes a resume mean something else: refused, or (OVERRIDABLE, see
# mega_async.api.config.RESUME_OVERRIDES) continued when trainer.resume_override names them
RUN_KEYS = ("rollout.consumer_batch_size", "data.synthetic_target", "rollout.group_size", "data.name", "seed",
            "data.shuffle")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def model_record(model_path: str | Path) -> dict[str, Any]:
    try:
        card = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: card[k] for k in MODEL_KEYS if k in card}


def run_record(cfg: Any) -> dict[str, Any]:
    """trainer.json's `run` and `model_config`: what a resume compares with its own config."""
    return {"run": {k: _get(cfg, k) for k in RUN_KEYS}, "model_config": model_record(cfg.model.path)}


def _compare_run(ckpt: Path, meta: dict, cfg: Any) -> None:
    from mega_async.api.config import RESUME_OVERRIDES

    tj = ckpt / "trainer.json"
    then = meta.get("run")
    if then is None:
        logger.warning("%s has no record of its run (written before it was kept): batch size, task and model are "
                       "not compared with this config", ckpt)
    else:
        allowed = set(cfg.trainer.resume_override)
        for key in RUN_KEYS:
            if key not in then or then[key] == _get(cfg, key):
                continue
            now = _get(cfg, key)
            if key in RESUME_OVERRIDES and key in allowed:
                logger.warning("resuming %s with %s=%r (the checkpoint's run had %r): trainer.resume_override allows "
                               "it", ckpt.name, key, now, then[key])
                continue
            fix = (f"resume with {key}={then[key]!r}, or pass trainer.resume_override=[{key}] to continue with "
                   f"{now!r}" if key in RESUME_OVERRIDES else f"resume with {key}={then[key]!r} or start a fresh run")
            raise CheckpointError(f"{tj}: the checkpoint's run had {key}={then[key]!r}, this config has {now!r}; "
                                  f"{fix}")
    then_model = meta.get("model_config")
    if then_model:
        now_model = model_record(cfg.model.path)
        for key in sorted(set(then_model) | set(now_model)):
            if then_model.get(key) != now_model.get(key):
                raise CheckpointError(f"{tj}: the checkpoint is of another model ({key}={then_model.get(key)!r}, "
                                      f"model.path={cfg.model.path} has {now_model.get(key)!r}); resume with the "
                                      "model card it was trained from")


def _check_rollout(path: Path, cfg: Any) -> None:
    if not path.exists() and not path.is_symlink():
        raise CheckpointError(f"{path}: missing (the rollout state: dataset position, unconsumed rollouts); "
                              f"{_fix(path.parent)}")
    state = safe_torch_load(path)
    ex = state.get("executor") if isinstance(state, dict) else None
    ld = state.get("loader") if isinstance(state, dict) else None
    ok = isinstance(ex, dict) and isinstance(ex.get("episodes"), list) and isinstance(ex.get("counts"), dict) \
        and isinstance(ex.get("batches_out"), int) and isinstance(ld, dict) \
        and all(isinstance(ld.get(k), int) and not isinstance(ld.get(k), bool) and ld[k] >= 0
                for k in ("epoch", "position", "size")) and isinstance(ld.get("seed"), int)
    ok = ok and all(isinstance(e, dict) and e.get("state") in ("done", "running", "waiting")
                    and (e["state"] == "waiting" or isinstance(e.get("head"), int))
                    and isinstance(e.get("journal"), list) for e in ex["episodes"])
    if ok:  # a running episode continues from its journal: it must restore as the executor will
        from mega_async.rollout.journal import EpisodeJournal

        try:
            for e in ex["episodes"]:
                EpisodeJournal.restore(e["journal"])
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError):
            ok = False
    if not ok:
        raise CheckpointError(f"{path}: not the rollout state of a run (executor episodes, dataset position); "
                              f"{_fix(path.parent)}")
    if ld["seed"] != cfg.seed or bool(ld.get("shuffle", True)) != cfg.data.shuffle:
        raise CheckpointError(f"{path}: the checkpoint's dataset order is seed {ld['seed']}, shuffle "
                              f"{bool(ld.get('shuffle', True))}, this config's seed {cfg.seed}, shuffle "
                              f"{cfg.data.shuffle}; resume with seed={ld['seed']} "
                              f"data.shuffle={str(bool(ld.get('shuffle', True))).lower()}")


def _check_rng(ckpt: Path, world: int) -> None:
    for r in range(world):
        p = ckpt / "rng" / f"rank{r}.pt"
        if not p.exists() and not p.is_symlink():
            raise CheckpointError(f"{p}: missing (the RNG state of trainer rank {r}; a resume at the same rank count "
                                  f"restores it); {_fix(ckpt)}")
        st = safe_torch_load(p)
        try:  # restored as load_checkpoint will, into throwaway generators
            import random

            import torch

            random.Random().setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in st["python"]))
            torch.Generator().set_state(st["torch"])
        except (TypeError, ValueError, KeyError, RuntimeError, OverflowError) as e:
            raise CheckpointError(f"{p}: not an RNG state ({first_line(e)}); {_fix(ckpt)}") from None


def check_model_dir(model_dir: str | Path) -> None:
    """The distributed checkpoint: Megatron's metadata.json, the pickled .metadata (checkpoint classes only,
    every entry inside its files), each object entry and common.pt loaded tensors-only."""
    d = Path(model_dir)
    fix = _fix(d.parent) if d.parent.name.startswith("step_") else "use a checkpoint written by mega-async"
    if not d.is_dir() or d.is_symlink():
        raise CheckpointError(f"{d}: missing or not a folder (the model and optimizer); {fix}")
    cfgj = read_json(d / "metadata.json", "distributed checkpoint's format", fix)
    if not isinstance(cfgj, dict) or cfgj.get("sharded_backend") != "torch_dist" \
            or cfgj.get("common_backend") != "torch":
        raise CheckpointError(f"{d / 'metadata.json'}: format {cfgj!r}; only Megatron's torch_dist checkpoints are "
                              f"read; {fix}")
    meta = read_dist_metadata(d / ".metadata")
    check_bytes_entries(d, meta)
    for f in sorted(d.glob("*.pt")):
        safe_torch_load(f)


def validate_checkpoint(ckpt: str | Path, cfg: Any, world: int) -> dict[str, Any]:
    """Everything a resume of `cfg` at `world` trainer ranks reads from `ckpt`, checked before it starts;
    returns trainer.json's content. Raises CheckpointError (one line)."""
    import time

    d = Path(ckpt)
    t0 = time.monotonic()
    sealed = verify_manifest(d)
    if not sealed:
        logger.warning("%s has no %s (written before checkpoints had one): its files' sizes and checksums are not "
                       "checked; the rest is", d, MANIFEST)
    meta = read_trainer_json(d / "trainer.json")
    if d.name[5:].isdigit() and int(d.name[5:]) != meta["step"]:
        raise CheckpointError(f"{d / 'trainer.json'}: step {meta['step']}, but the folder is {d.name}; the file "
                              f"belongs to another checkpoint: {_fix(d)}")
    for key in ("metrics_bytes", "ledger_bytes"):
        if key not in meta:
            raise CheckpointError(f"{d / 'trainer.json'}: {key} missing (not a run's checkpoint); {_fix(d)}")
    run_dir = d.parent.parent
    for key, name in zip(_SIZES, ("metrics.jsonl", "rollouts.jsonl", "events.jsonl")):
        if not (run_dir / name).exists():  # removed (e.g. to save space): the run goes on without its old lines
            if meta.get(key, 0):
                logger.warning("%s is missing (the checkpoint saw %d bytes of it): resuming without them",
                               run_dir / name, meta[key])
            continue
        have = (run_dir / name).stat().st_size
        if meta.get(key, 0) > have:
            raise CheckpointError(f"{run_dir / name}: {have} bytes, the checkpoint saw {meta[key]} ({key} in "
                                  f"{d / 'trainer.json'}): the file is not this checkpoint's run or lost its end; "
                                  "restore it, or move it away to resume without its old lines")
    check_model_dir(d / "model")
    if meta["world_size"] == world:
        _check_rng(d, world)
    _compare_run(d, meta, cfg)
    _check_rollout(d / "rollout.pt", cfg)
    logger.info("checkpoint %s checked in %.2fs (%s)", d, time.monotonic() - t0,
                "manifest, sizes and sha256" if sealed else "no manifest")
    return meta
