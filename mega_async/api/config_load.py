"""Loading a typed config: dataclass defaults <- YAML file <- `key.sub=value` overrides (OmegaConf), hostile files
refused unread or unexpanded, unknown keys answered with did-you-mean, every setting listed for --help, and the
resolved config written back to the run directory as `config.yaml`. One loader for every command's schema
(`RunConfig`, `SFTConfig`)."""
from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from mega_async.api.config import ConfigError, RunConfig, _yaml_value

logger = logging.getLogger("mega_async.api.config")


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults <- YAML file <- dotted overrides; returns a validated `RunConfig`."""
    return load_typed(RunConfig, path, overrides, command="mega-async train", example="configs/tiny_cpu.yaml",
                      removed=REMOVED_KEYS)

REMOVED_KEYS = {"inference.num_servers": "the inference part of parallel.allocation says how many servers run "
                                         "(sglang:d2+megatron:d1 = two servers)"}

MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB: a larger file is refused unread

MAX_YAML_NODES = 100_000  # values of a config file with its aliases expanded ("billion laughs" files stop here)

def load_typed(schema: type, path: str | os.PathLike | None, overrides: Sequence[str], *, command: str,
               example: str, renamed: dict[str, str] | None = None, removed: dict[str, str] | None = None) -> Any:
    """The one loader of every typed config (`RunConfig`, `mega_async.run.sft.SFTConfig`): dataclass defaults <- YAML
    file <- dotted overrides, then `validate()`. `renamed` old -> new dotted keys (the old one accepted with one
    warning), `removed` key -> why (refused). Every problem is one ConfigError line naming the key."""
    data = read_yaml(path, example) if path is not None else {}
    overrides = list(overrides)
    for ov in overrides:
        if "=" not in ov or ov.startswith("="):
            raise ConfigError(f"override {ov!r} is not key=value: write {ov.strip('=') or 'KEY'}=VALUE "
                              f"(`{command} --help` lists every key)")
        key, _, value = ov.partition("=")
        _safe_yaml(value, f"override {ov!r}", marks=False)  # one line for bad YAML; aliases bounded like a file's
    for key, why in (removed or {}).items():
        if _find(data, key) or any(ov.startswith(key + "=") for ov in overrides):
            raise ConfigError(f"{key} was removed: {why}")
    for old, new in (renamed or {}).items():
        hit = _find(data, old)
        if hit and _find(data, new):
            raise ConfigError(f"{path}: {old} and {new} are both set; {old} was renamed to {new}: keep only {new}")
        if hit:
            _set(data, new, hit[0].pop(hit[1]))
        if hit or any(ov.startswith(old + "=") for ov in overrides):
            overrides = [new + ov[len(old):] if ov.startswith(old + "=") else ov for ov in overrides]
            logger.warning("%s was renamed to %s: write %s (the old name still loads, for now)", old, new, new)
    layers: list[Any] = [OmegaConf.structured(schema)] + ([OmegaConf.create(data)] if data else [])
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(overrides))
        cfg = OmegaConf.to_object(OmegaConf.merge(*layers))
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e, schema, path, overrides, command)) from None
    cfg.validate()
    return cfg

def _one_line(err: OmegaConfBaseException, schema: type, path: Any, overrides: Sequence[str], command: str) -> str:
    key = getattr(err, "full_key", None) or "<root>"
    msg = str(err).splitlines()[0].strip() if str(err) else type(err).__name__
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and key != "<root>":
        close = did_you_mean(schema, key)
        msg = "unknown key; " + (f"did you mean {' or '.join(close)}?" if close else f"`{command} --help` lists "
                                 "every key")
    given = any(ov.partition("=")[0] == key or ov.startswith(key + ".") for ov in overrides)
    return f"{'override ' if given else f'{path}: ' if path else ''}{key}: {msg}"

def did_you_mean(schema: type, key: str) -> list[str]:
    """Up to three keys of the config `schema` that an unknown dotted `key` may have meant: a close name in the
    same section, the same name in another section, else a close dotted key."""
    leaves = [k for k, _, _ in config_keys(schema)]
    names = set(leaves) | {k.rsplit(".", 1)[0] for k in leaves if "." in k}
    parent, _, leaf = key.rpartition(".")
    here = {n.rpartition(".")[2]: n for n in names if n.rpartition(".")[0] == parent}
    close = [here[m] for m in difflib.get_close_matches(leaf, sorted(here), n=3, cutoff=0.6)]
    close += [n for n in leaves if n.rpartition(".")[2] == leaf and n not in close]
    return (close or difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.7))[:3]

def config_keys(schema: type, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every setting of the dataclass config `schema` as (dotted key, type, default), sections flattened in field
    order: what `--help` lists and what an unknown key is matched against."""
    out: list[tuple[str, Any, Any]] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            out += config_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out.append((prefix + f.name, hints[f.name], default))
    return out

def describe_config(schema: type) -> str:
    """`--help`'s list of every section, key, type and default of the config `schema` (generated: cannot drift)."""
    rows = [(k, _type_name(t), "(required)" if d is dataclasses.MISSING else _yaml_value(d))
            for k, t, d in config_keys(schema)]
    width = max(len(k) for k, _, _ in rows)
    lines = ["settings, as `key  type = default`: set them in the -c YAML file (a mapping per section) or as",
             "key=value overrides, e.g. trainer.lr=1e-6. What each does: docs/configuration.md (sections, load",
             f"order, errors) and the comment beside it in {schema.__module__.replace('.', '/')}.py"]
    section = None
    for key, t, d in rows:
        here = key.partition(".")[0] if "." in key else "(top level)"
        if here != section:
            lines.append(f"  {here}:")
            section = here
        lines.append(f"    {key:<{width}}  {t} = {d}")
    return "\n".join(lines)

def _type_name(t: Any) -> str:
    args = [a for a in typing.get_args(t) if a is not type(None)]
    if typing.get_origin(t) is typing.Union:
        return " | ".join(_type_name(a) for a in args) + " | null"
    if typing.get_origin(t) is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(t, "__name__", str(t))

def read_yaml(path: str | os.PathLike, example: str = "see configs/") -> dict:
    """A config file's top-level mapping, or ConfigError in one line: a missing file, one over MAX_CONFIG_BYTES,
    invalid YAML (file:line:column), aliases expanding past MAX_YAML_NODES values, a top level not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass an existing YAML file (e.g. {example})")
    if p.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: {p.stat().st_size:,} bytes is larger than a config file may be "
                          f"({MAX_CONFIG_BYTES:,}); pass the run's YAML config")
    try:
        data = _safe_yaml(p.read_text(encoding="utf-8"), str(p))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save the config as UTF-8") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    return data or {}

def _safe_yaml(text: str, where: str, marks: bool = True) -> Any:
    """yaml.safe_load with the expanded size bounded before any object is built; errors as one line naming
    where (with :line:column when `marks`)."""
    try:
        loader = yaml.SafeLoader(text)  # checks the characters
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expansion(node, where, marks)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
        context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
        mark, what = mark or cmark, problem or context or str(e).splitlines()[0]
        if marks and problem and context and cmark and (cmark.line, cmark.column) != (mark.line, mark.column):
            what += f" ({context} at line {cmark.line + 1}, column {cmark.column + 1})"
        if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow: only its offset is known
            line, col = text.count("\n", 0, e.position), e.position - text.rfind("\n", 0, e.position) - 1
            mark = yaml.Mark(where, e.position, line, col, None, None)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark and marks else where
        raise ConfigError(f"{at}: invalid YAML: {what.strip()}; fix the {'file' if marks else 'value'} there") \
            from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply to be a config") from None

def _check_expansion(root: yaml.Node, where: str, marks: bool = True) -> None:
    """Count the values of the document with every alias expanded, visiting each node once (by identity): a
    "billion laughs" file is refused in milliseconds, before its object graph is built; so is a recursive alias."""
    def at(node: yaml.Node) -> str:
        return f"{where}:{node.start_mark.line + 1}" if marks else where

    sizes: dict[int, int] = {}
    open_: set[int] = set()  # nodes being counted: the path from the root
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = [c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        if done:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in kids)
            if sizes[id(node)] > MAX_YAML_NODES:
                raise ConfigError(f"{at(node)}: its aliases expand to more than {MAX_YAML_NODES:,} values (a \"billion "
                                  "laughs\" file); write the values out")
        elif id(node) in open_:
            raise ConfigError(f"{at(node)}: an alias refers to a node that contains it; a config cannot be "
                              "recursive")
        elif id(node) not in sizes:
            open_.add(id(node))
            stack += [(node, True)] + [(c, False) for c in kids]

def _find(data: dict, dotted: str) -> Optional[tuple[dict, str]]:
    """(the mapping holding `dotted`'s last name, that name) when the nested dict sets it, else None."""
    *head, leaf = dotted.split(".")
    for h in head:
        data = data.get(h) if isinstance(data, dict) else None
    return (data, leaf) if isinstance(data, dict) and leaf in data else None

def _set(data: dict, dotted: str, value: Any) -> None:
    *head, leaf = dotted.split(".")
    for h in head:
        data = data.setdefault(h, {})
    data[leaf] = value

def to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)

def save_config(cfg: RunConfig, run_dir: str | os.PathLike | None = None) -> Path:
    """Write the resolved config to `<run_dir>/config.yaml` (atomically) and return its path."""
    d = Path(run_dir) if run_dir is not None else cfg.run_dir
    d.mkdir(parents=True, exist_ok=True)
    out = d / "config.yaml"
    tmp = out.with_suffix(".yaml.tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, out)
    return out
