"""The trainer's own `/weights_checker` digest: from its HF-named tensors, the per-tensor checksums a server must
report when it serves exactly those weights. Pure (torch and hashlib only), no I/O.

SGLang's WeightChecker (python/sglang/srt/utils/weight_checker.py, 0.5.18-0.5.23) hashes every parameter and
buffer of the model *as the server holds it* (`model.named_parameters()`, then `named_buffers()`, minus rotary
caches and `skip_tensor_list`), one rank at a time: `tensor_hash` (managers/mm_utils.py) is the first 8 bytes of
sha256 over the tensor's bytes on the CPU and `gpu_tensor_hash` (kernels/ops/memory/gpu_tensor_hash.py, a Triton
kernel) on a GPU. The names are the server's, not the checkpoint's, so each server name is rebuilt here from the
checkpoint tensors it is loaded from:

    the same name                          the tensor itself (norms, routers, embeddings, ...)
    *.experts.gate_up_proj / down_proj      transformers 5's fused experts (the embedded server): stack over e of
                                            cat(gate_e, up_e) / of down_e
    *.self_attn.qkv_proj.{weight,bias}      SGLang's QKVParallelLinear: cat(q, k, v)
    *.gate_up_proj.weight                   SGLang's MergedColumnParallelLinear: cat(gate, up)
    *.experts.w13_weight / w2_weight        SGLang's FusedMoE: stack over e of cat(gate_e, up_e) / of down_e
    embed_tokens / lm_head                  as is, or padded with zero rows to a multiple of 64 (SGLang's
                                            VocabParallelEmbedding pads and zero-fills)

each cast to the server's dtype first (learned from the reply: the dtype and hash under which the server's copy of
one plain tensor matches). What is rebuilt is exact; what is not (a tensor-parallel shard, a weight SGLang derives
after loading such as DeepSeek's absorbed `w_kc`/`w_vc`, a quantized weight) is `uncovered`, named, and left to
the checks that need no digest (changed with the sync, equal across servers of one layout).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from mega_async.bridge.mtp import is_mtp_hf_name

VOCAB_PADDING = 64  # SGLang's DEFAULT_VOCAB_PADDING_SIZE
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_QKV = re.compile(r"^(?P<p>.*\.self_attn)\.qkv_proj\.(?P<w>weight|bias)$")
_GATE_UP = re.compile(r"^(?P<p>.*)\.gate_up_proj\.weight$")
_FUSED_HF = re.compile(r"^(?P<p>.*\.experts)\.(?P<k>gate_up_proj|down_proj)$")
_FUSED_SGL = re.compile(r"^(?P<p>.*\.experts)\.(?P<k>w13_weight|w2_weight)$")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


# ---- SGLang's two tensor hashes --------------------------------------------------------------------------------
def sha_hash(t: torch.Tensor) -> str:
    """SGLang's `tensor_hash` of a CPU tensor: 16 hex digits of the first 8 bytes of sha256 over its bytes."""
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()[:8]
    return f"{int.from_bytes(digest, 'big'):016x}"


_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer on uint32 values held in int64 (every product kept to 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & _M32) | (x >> (32 - r))


def _fmix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def gpu_hash(t: torch.Tensor, seed: int = 0x243F6A88, tile_words: int = 8192, chunk: int = 1 << 22) -> str:
    """SGLang's `gpu_tensor_hash` (the Triton kernel a GPU server hashes with), in plain torch on any device: per
    tile of 8192 little-endian uint32 words, two sums of fmix32(word ^ position mix) folded with the byte count,
    the tiles' 64-bit values summed, then splitmix64. Bit-exact by construction (integer arithmetic only)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n_bytes = b.numel()
    if n_bytes == 0:
        return f"{0:016x}"
    pad = (4 - n_bytes % 4) % 4
    if pad:
        b = torch.cat([b, torch.zeros(pad, dtype=torch.uint8, device=b.device)])
    words = b.view(torch.int32)
    n = words.numel()
    s1, s2 = seed & _M32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & _M32
    tiles = (n + tile_words - 1) // tile_words
    h1 = torch.zeros(tiles, dtype=torch.int64, device=b.device)
    h2 = torch.zeros(tiles, dtype=torch.int64, device=b.device)
    for start in range(0, n, chunk):  # chunk is a multiple of the tile: each slice adds into whole tiles
        v = words[start:start + chunk].to(torch.int64) & _M32
        i = torch.arange(start, start + v.numel(), dtype=torch.int64, device=b.device)
        p1 = (((i * 0x27D4EB2D) + s1) & _M32) ^ _rotl32(i, 15)
        p2 = (((i * 0x165667B1) + s2) & _M32) ^ _rotl32(i, 13)
        tile = i // tile_words
        h1.index_add_(0, tile, _fmix32(v ^ p1))
        h2.index_add_(0, tile, _fmix32(v ^ p2))
    total = 0
    for a, c in zip((h1 & _M32).tolist(), (h2 & _M32).tolist()):
        a, c = _fmix32_int(a ^ ((n * 4) & _M32)), _fmix32_int(c ^ ((n * 4) & _M32))
        total = (total + ((a << 32) | c)) & _M64
    x = total
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return f"{x:016x}"


HASHES: dict[str, Callable[[torch.Tensor], str]] = {"sha256": sha_hash, "gpu": gpu_hash}


# ---- server names from checkpoint names ----------------------------------------------------------------------
def recipe(server_name: str, num_experts: Optional[int]) -> Optional[tuple[list[list[str]], bool]]:
    """The checkpoint tensors a server tensor is built from: rows, each concatenated along dim 0, and whether the
    rows are stacked (the experts of one layer); None when no rule applies (then only the name itself matches)."""
    if (m := _FUSED_HF.match(server_name) or _FUSED_SGL.match(server_name)) is not None:
        if not num_experts:
            return None
        p, down = m["p"], m["k"] in ("down_proj", "w2_weight")
        return [[f"{p}.{e}.down_proj.weight"] if down else [f"{p}.{e}.gate_proj.weight", f"{p}.{e}.up_proj.weight"]
                for e in range(num_experts)], True
    if (m := _QKV.match(server_name)) is not None:
        return [[f"{m['p']}.{x}_proj.{m['w']}" for x in "qkv"]], False
    if (m := _GATE_UP.match(server_name)) is not None and ".experts." not in server_name:
        return [[f"{m['p']}.gate_proj.weight", f"{m['p']}.up_proj.weight"]], False
    return None


def _build(rows: list[list[torch.Tensor]], stacked: bool) -> torch.Tensor:
    cat = [torch.cat(r, 0) if len(r) > 1 else r[0] for r in rows]
    return torch.stack(cat, 0) if stacked else cat[0]


def _padded(t: torch.Tensor) -> Optional[torch.Tensor]:
    rows = -(-t.shape[0] // VOCAB_PADDING) * VOCAB_PADDING
    if rows == t.shape[0]:
        return None
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))], 0)


@dataclass
class Flavor:
    """How one server rank holds its weights: dtype and hash (None until learned from a plain tensor)."""

    dtype: Optional[torch.dtype] = None
    hash: Optional[str] = None


@dataclass
class Expected:
    """The trainer's digest for one server rank's reply, and what it could not rebuild."""

    checksums: dict[str, list[str]] = field(default_factory=dict)  # server name -> acceptable checksums
    uncovered: list[str] = field(default_factory=list)  # server names no rule rebuilds
    unused: list[str] = field(default_factory=list)  # checkpoint names no server name is built from


def learn_flavor(reply: dict[str, str], named: Iterable[tuple[str, torch.Tensor]]) -> Optional[Flavor]:
    """The dtype and hash under which the server's copy of some plain tensor equals the trainer's, trying the
    first few the server also names (None: none matches under any, e.g. every one of them was not updated)."""
    tried = 0
    for name, t in named:
        if name not in reply or not t.dtype.is_floating_point or name.endswith(_VOCAB):
            continue
        for dtype in (t.dtype, *[d for d in DTYPES if d != t.dtype]):
            for h, fn in HASHES.items():
                if fn(t.to(dtype)) == reply[name]:
                    return Flavor(dtype, h)
        tried += 1
        if tried >= 8:
            break
    return None


class DigestBuilder:
    """Feed the checkpoint tensors once (`add`, in any order); `expected()` gives each server name's checksum(s).

    Built for one reply's names: a tensor is kept only until every server tensor built from it is hashed (a
    layer's experts are held until the last of them arrives), so memory stays about one fused group."""

    def __init__(self, names: Iterable[str], flavor: Flavor, num_experts: Optional[int],
                 mtp_from: Optional[int] = None):
        self.flavor = flavor
        self.mtp_from = mtp_from  # tensors of HF layers from here on (MTP layers the server does not keep): skipped
        self.hash = HASHES[flavor.hash or "sha256"]
        self._want: dict[str, tuple[list[list[str]], bool]] = {}
        self.expected = Expected()
        self._uses: dict[str, list[str]] = {}  # checkpoint name -> server names waiting on it
        for s in names:
            self._want[s] = recipe(s, num_experts) or ([[s]], False)
            for r in self._want[s][0]:
                for part in r:
                    self._uses.setdefault(part, []).append(s)
        self._have: dict[str, torch.Tensor] = {}
        self._fed: set[str] = set()

    def add(self, name: str, t: torch.Tensor) -> None:
        self._fed.add(name)
        waiting = self._uses.get(name)
        if not waiting:
            if self.mtp_from is None or not is_mtp_hf_name(name, self.mtp_from):
                self.expected.unused.append(name)
            return
        self._have[name] = t.to(self.flavor.dtype) if self.flavor.dtype and t.dtype.is_floating_point else t
        for s in list(waiting):
            rows, stacked = self._want.get(s, (None, False))
            if rows is None or not all(p in self._have for r in rows for p in r):
                continue
            t_s = _build([[self._have[p] for p in r] for r in rows], stacked)
            sums = [self.hash(t_s)]
            if s.endswith(_VOCAB) and (p := _padded(t_s)) is not None:
                sums.append(self.hash(p))
            self.expected.checksums[s] = sums
            del self._want[s]
            for r in rows:
                for p in r:
                    self._uses[p].remove(s)
                    if not self._uses[p]:
                        self._have.pop(p, None)

    def finish(self) -> Expected:
        """Server names some of whose parts the trainer never sent are `uncovered` (a name no rule explains, or a
        fused tensor of a layout not rebuilt here)."""
        self.expected.uncovered = sorted(self._want)
        self._have.clear()
        return self.expected


# weights SGLang derives after loading or keeps quantized: no checkpoint tensor rebuilds them here
DERIVED = ("w_kc", "w_vc", "fused_qkv_a_proj_with_mqa", "weight_scale", "input_scale", "k_scale", "v_scale")


def compare(reply: dict[str, str], expected: Expected) -> tuple[list[str], list[str], list[str], list[str]]:
    """Server names that differ from the trainer's digest; checkpoint names the server does not hold (missing);
    server names the trainer sent nothing for (extra); and derived weights it cannot rebuild (uncovered)."""
    differing = sorted(n for n, sums in expected.checksums.items() if reply.get(n) not in sums)
    extra = [n for n in expected.uncovered if not any(d in n for d in DERIVED)]
    uncovered = [n for n in expected.uncovered if any(d in n for d in DERIVED)]
    return differing, sorted(expected.unused), extra, uncovered


def holds(reply: dict[str, str], named: list[tuple[str, torch.Tensor]], num_experts: Optional[int]) -> Optional[bool]:
    """Whether a server's per-tensor checksums show it holds these tensors (one bucket): every server tensor that
    the bucket alone rebuilds matches, under one dtype and hash. None when the bucket rebuilds none of them."""
    floats = {t.dtype for _, t in named if t.dtype.is_floating_point}
    for dtype in [*floats, *[d for d in DTYPES if d not in floats]]:
        for h in HASHES:
            b = DigestBuilder(reply, Flavor(dtype, h), num_experts)
            for name, t in named:
                b.add(name, t)
            got = b.finish().checksums
            if not got:
                return None
            if all(reply.get(n) in sums for n, sums in got.items()):
                return True
    return False
