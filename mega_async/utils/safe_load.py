"""Reading checkpoint files a run did not just write (a colleague's run, a copied or damaged directory): nothing
is unpickled beyond tensors, plain containers and checkpoint-metadata classes, nothing outside the checkpoint is
opened, and every refusal is one `CheckpointError` line naming the file.

Three doors run code in a stock Megatron/torch load and are closed here:
- the distributed checkpoint's `.metadata` is a full pickle (torch's FileSystemReader.read_metadata):
  read with an unpickler that admits only the metadata dataclasses (`read_dist_metadata`);
- its `BytesStorageMetadata` entries (a layer's `_extra_state`, Megatron's ShardedObjects) are
  `torch.load(weights_only=False)`ed by DefaultLoadPlanner.load_bytes: loaded with `weights_only=True`;
- `common.pt` and the run's own torch files: `weights_only=True` always (`safe_torch_load`).
`dist_load` is `megatron.core.dist_checkpointing.load` through these readers; it also refuses NaN/inf weights
as they are read, and turns torch's `CheckpointException ranks:dict_keys([0])` into a line that says what.
"""
from __future__ import annotations

import io
import pickle
import re
import stat
from pathlib import Path
from typing import Any, Iterator

import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, incomplete, damaged, or with content we refuse to load)."""


def first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text or type(e).__name__)[:300]


# ---- .metadata -----------------------------------------------------------------------------------------
_DCP = "torch.distributed.checkpoint"
_METADATA_CLASSES = {
    f"{_DCP}.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                         "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}.planner": {"SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType",
                        "TensorWriteData", "BytesIOWriteData"},
    f"{_DCP}.filesystem": {"_StorageInfo"},
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata", "MCoreSavePlan"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "bytearray"},
    "datetime": {"datetime"},
    "torch": {"Size", "device"},
    "torch.serialization": {"_get_layout"},  # a layout from its name
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},  # StorageMeta.checkpoint_id (torch's own writer)
}
_TORCH_ATTRS = {"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
                "strided", "contiguous_format", "preserve_format", "channels_last", "float8_e4m3fn", "float8_e5m2",
                "complex64"}  # dtypes, layouts and memory formats, pickled as torch.<name>


def _safe_getattr(obj: Any, name: str) -> Any:
    if obj is torch and name in _TORCH_ATTRS:
        return getattr(torch, name)
    raise pickle.UnpicklingError(f"getattr({getattr(obj, '__name__', obj)!r}, {name!r}) is not allowed")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the checkpoint-metadata dataclasses by name, nothing that calls code (no torch.load, no storages)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _safe_getattr
        if module == "torch" and name in _TORCH_ATTRS:
            return getattr(torch, name)
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint-metadata class")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids (storages) are not checkpoint metadata")


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
MAX_BYTES_ENTRY = 64 << 20  # a BytesStorageMetadata entry (an _extra_state is ~1 KB; TE's FP8 state a few KB)


def read_dist_metadata(path: str | Path) -> Any:
    """The `Metadata` of a torch distributed checkpoint (`<dir>/.metadata`), unpickled with checkpoint classes
    only; every storage entry must lie inside a regular file of `<dir>` (no path, no link, within its size)."""
    from torch.distributed.checkpoint.metadata import Metadata

    p = Path(path)
    try:
        data = _regular_file(p).read_bytes()
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, TypeError, ImportError, IndexError,
            KeyError, OSError, RecursionError, MemoryError) as e:
        raise CheckpointError(f"{p}: refused to load: {first_line(e)} (a checkpoint's metadata may hold only "
                              "checkpoint classes; this file was not written by torch.distributed.checkpoint, is "
                              "damaged or was tampered with)") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointError(f"{p}: holds a {type(meta).__name__}, not a distributed checkpoint's Metadata")
    _check_storage(p, meta)
    return meta


def _regular_file(p: Path) -> Path:
    try:
        st = p.lstat()
    except FileNotFoundError:
        raise CheckpointError(f"{p}: missing; the checkpoint is incomplete") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{p}: is a symbolic link; a checkpoint's files must be its own (copy the file in)")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{p}: is not a regular file")
    return p


def _check_storage(meta_path: Path, meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    d, sizes = meta_path.parent, {}
    for idx, info in (meta.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not _PLAIN_NAME.match(rel):
            raise CheckpointError(f"{meta_path}: an entry points at {rel!r}, not a file of this checkpoint")
        if rel not in sizes:
            sizes[rel] = _regular_file(d / rel).stat().st_size
        off, n = getattr(info, "offset", None), getattr(info, "length", None)
        if not (isinstance(off, int) and isinstance(n, int) and off >= 0 and n >= 0 and off + n <= sizes[rel]):
            raise CheckpointError(f"{d / rel}: {sizes[rel]} bytes, but {getattr(idx, 'fqn', idx)} is stored at "
                                  f"{off}+{n} ({meta_path.name}): the file is truncated or not this checkpoint's")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{d / rel}: {idx.fqn} is stored through transforms "
                                  f"{info.transform_descriptors!r}; this reader accepts plain entries only")
        if isinstance(meta.state_dict_metadata.get(idx.fqn), BytesStorageMetadata) and n > MAX_BYTES_ENTRY:
            raise CheckpointError(f"{d / rel}: the object {idx.fqn} is {n} bytes (more than {MAX_BYTES_ENTRY}); "
                                  "not a checkpoint this code wrote")


def check_bytes_entries(model_dir: str | Path, meta: Any) -> int:
    """Load every object entry (`BytesStorageMetadata`) of a distributed checkpoint with `weights_only=True`
    before any library would unpickle it in full; returns how many there were."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    d, n = Path(model_dir), 0
    for idx, info in (meta.storage_data or {}).items():
        if not isinstance(meta.state_dict_metadata.get(idx.fqn), BytesStorageMetadata):
            continue
        with (d / info.relative_path).open("rb") as f:
            f.seek(info.offset)
            _weights_only(io.BytesIO(f.read(info.length)), f"{d / info.relative_path}: {idx.fqn}")
        n += 1
    return n


# ---- torch files -------------------------------------------------------------------------------------------
def _weights_only(src: Any, where: str) -> Any:
    try:  # io.BytesIO: Transformer Engine's _extra_state (Megatron allows it too, when imported)
        with torch.serialization.safe_globals([io.BytesIO]):
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{where}: refused to load: {msg[:300]} (only tensors and plain containers are "
                              "accepted)") from None
    except (RuntimeError, OSError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError,
            MemoryError) as e:
        raise CheckpointError(f"{where}: not a readable torch file ({type(e).__name__}: {first_line(e)}); the file "
                              "is truncated or damaged") from None


def safe_torch_load(path: str | Path) -> Any:
    """torch.load of an untrusted file: a regular file (no link), tensors and plain containers only."""
    p = _regular_file(Path(path))
    return _weights_only(p, str(p))


# ---- the distributed checkpoint, read through these doors -----------------------------------------------
def _reader_and_planner(model_dir: Path) -> tuple[type, type]:
    """torch's FileSystemReader reading `.metadata` restricted, and Megatron's load planner loading object
    entries tensors-only and refusing NaN/inf (the classes, built on first use: Megatron imports slowly)."""
    from megatron.core.dist_checkpointing.strategies import torch as mt
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element

    class Reader(FileSystemReader):
        def __init__(self, path: Any) -> None:
            super().__init__(path)
            self._meta: Any = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._meta is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                meta = read_dist_metadata(self._get_metadata_path(kwargs.get("rank")))
                if getattr(meta, "storage_meta", None) is None:
                    meta.storage_meta = StorageMeta()
                meta.storage_meta.load_id = self.load_id
                self._meta = meta
            return self._meta

    class Planner(mt.MCoreLoadPlanner):
        def _file(self, item: Any) -> Path:
            return model_dir / self.metadata.storage_data[item.storage_index].relative_path

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:  # DefaultLoadPlanner's, weights_only
            obj = _weights_only(value, f"{self._file(read_item)}: {read_item.dest_index.fqn}")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

        def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"{self._file(read_item)}: {read_item.dest_index.fqn} holds NaN or inf values "
                                      "(the run that wrote it diverged, or the file was changed): resume from an "
                                      "earlier checkpoint")
            super().commit_tensor(read_item, tensor)

    return Reader, Planner


def _strategies(model_dir: Path) -> tuple[Any, Any]:
    """Megatron's torch_dist load strategy and common strategy, with the reader and planner above."""
    from megatron.core.dist_checkpointing.strategies import torch as mt
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from torch.distributed.checkpoint import load_state_dict

    Reader, Planner = _reader_and_planner(model_dir)

    class Sharded(mt.TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:  # Megatron 0.16's, with Reader/Planner
            flexible = [t for t in mt.nested_values(sharded_state_dict)
                        if isinstance(t, mt.ShardedTensor) and not t.allow_shape_mismatch]
            mismatch = {t.key: t for t in mt.nested_values(sharded_state_dict)
                        if isinstance(t, mt.ShardedTensor) and t.allow_shape_mismatch}
            orig = sharded_state_dict
            sharded_state_dict, flat_mapping, rename_mapping = mt._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict)
            pyt_state_dict = mt.mcore_to_pyt_state_dict(sharded_state_dict, True)
            reader = Reader(checkpoint_dir)
            load_state_dict(pyt_state_dict, reader, planner=Planner(
                shapes_validation_sharded_tensors=flexible, allow_shape_mismatch_sharded_tensors=mismatch))
            self.cached_global_metadata = reader.read_metadata()
            out = {k: mt._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
            out = mt._replace_sharded_keys_with_state_dict_keys(out, flat_mapping, rename_mapping)
            mt._restore_dict_types(out, orig)
            return out

        def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Any = None) -> Any:
            return super().load_tensors_metadata(checkpoint_dir, metadata or Reader(checkpoint_dir).read_metadata())

        def load_sharded_metadata(self, checkpoint_dir: Path) -> Any:
            meta = Reader(checkpoint_dir).read_metadata()
            out = {}
            for key, md in meta.state_dict_metadata.items():
                if isinstance(md, mt.BytesStorageMetadata):
                    obj = mt.ShardedObject.empty_from_unique_key(key)
                    out[obj.unique_key] = obj
            out.update(self.load_tensors_metadata(checkpoint_dir, meta))
            return out

    class Common(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> Any:
            return safe_torch_load(Path(checkpoint_dir) / "common.pt")

        def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> Any:
            raise CheckpointError(f"{checkpoint_dir}: objects stored as separate files are not read (the torch_dist "
                                  "format keeps them in its .distcp files)")

    return Sharded(), Common()


def dist_load(sharded_state_dict: dict, model_dir: str | Path) -> dict:
    """`megatron.core.dist_checkpointing.load` through the readers above; every failure is one CheckpointError."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    d = Path(model_dir)
    read_dist_metadata(d / ".metadata")  # refused here in one line (torch would log its fallbacks' tracebacks)
    sharded, common = _strategies(d)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(d), sharded_strategy=sharded, common_strategy=common)
    except CheckpointError:
        raise
    except CheckpointException as e:  # torch wraps each rank's error: report the first one
        for exc in e.failures.values():
            inner = exc[0] if isinstance(exc, tuple) else exc
            if isinstance(inner, CheckpointError):
                raise inner from None
            raise CheckpointError(f"{d}: {_what(inner)}") from None
        raise CheckpointError(f"{d}: {first_line(e)}") from None
    except (CheckpointingException, RuntimeError, OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise CheckpointError(f"{d}: {_what(e)}") from None


def _what(e: BaseException) -> str:
    msg = first_line(e)
    if "shape mismatch" in msg or "mismatch sizes" in msg or "not in state dict" in msg:
        return (f"{msg}; this checkpoint was written for another model (shapes differ): resume with the model "
                "card it was trained from (model.path)")
    return f"{type(e).__name__}: {msg}"


# ---- HF safetensors directories ------------------------------------------------------------------------
class SafetensorsDir:
    """The tensors of an HF model directory's *.safetensors files (sharded or not): by name (`names`, `in`,
    `get`; files opened once, lazily) or streamed file by file (`items`). The one reader of HF weight files: the
    bridge (Megatron load, conversion) and the embedded server (start-up and disk updates) use it.

    Every file must be a regular file (a FIFO would block the reader forever, a device would stream garbage)
    and, with `root`, lie inside it once resolved (a symlink out of the weights root is refused before anything
    is opened). Every refusal and every file safetensors cannot parse (truncated, corrupt header) is one `error`
    line naming the file."""

    def __init__(self, path: str | Path, root: str | Path | None = None, error: type[Exception] = CheckpointError):
        self.dir, self._error = Path(path), error
        self.files = sorted(self.dir.glob("*.safetensors"))
        if not self.files:
            raise error(f"no *.safetensors files in {self.dir}: not an HF checkpoint directory")
        base = Path(root).resolve() if root is not None else None
        for f in self.files:
            real = f.resolve()
            if base is not None and not real.is_relative_to(base):
                raise error(f"{f} resolves to {real}, outside the allowed weights root {base}")
            try:
                mode = real.stat().st_mode
            except OSError as e:
                raise error(f"cannot stat {f}: {e}") from None
            if not stat.S_ISREG(mode):
                raise error(f"{f} is not a regular file")
        self._where: dict[str, Path] | None = None
        self._open: dict[Path, Any] = {}

    def _file(self, f: Path) -> Any:
        from safetensors import safe_open

        if f not in self._open:
            try:
                self._open[f] = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
                raise self._error(f"cannot read {f.name}: {type(e).__name__}: {e}") from None
        return self._open[f]

    def _index(self) -> dict[str, Path]:
        if self._where is None:
            self._where = {k: f for f in self.files for k in self._file(f).keys()}
        return self._where

    def names(self) -> list[str]:
        return list(self._index())

    def __contains__(self, name: str) -> bool:
        return name in self._index()

    def get(self, name: str) -> torch.Tensor:
        f = self._index()[name]
        try:
            return self._file(f).get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise self._error(f"cannot read {name} from {f.name}: {type(e).__name__}: {e}") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, file by file (each file is closed once read)."""
        for f in self.files:
            sf = self._file(f)
            try:
                for k in sf.keys():
                    yield k, sf.get_tensor(k)
            except Exception as e:  # noqa: BLE001
                raise self._error(f"cannot read {f.name}: {type(e).__name__}: {e}") from None
            finally:
                self._open.pop(f, None)
