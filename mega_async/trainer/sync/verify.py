"""Verification after a push: every server serves the sync's weights (the trainer's exact digest against each
server's /weights_checker, or a logprob probe). A component the sync holds (`Verifier`), with explicit inputs.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from mega_async.trainer.sync.common import SyncError
from mega_async.utils.comm import from_rank0, rank
from mega_async.bridge.mtp import is_mtp_hf_name
from mega_async.trainer.sync.digest import DigestBuilder, compare, learn_flavor

logger = logging.getLogger("mega_async.trainer.sync")


class Verifier:
    """Verification after a push, every trainer rank: every server serves the sync's weights. Its inputs are explicit:
    the trainer's models (the digest and the probe's logprobs are theirs), rank 0's `ServerCalls` (None on the other
    ranks, which hear rank 0's verdicts), the ranks' agreement group, and per check the version, the servers the push
    went to and the FP8 block the weights went out in. What it keeps between checks: each server's last checksum
    (whether it changed with a sync), how each server holds its weights (dtype and hash, learned once), and what it
    last warned of."""

    def __init__(self, models: Sequence[torch.nn.Module], servers: Any, *, group: Any = None, method: str = "auto",
                 tol: float = 1e-4, temperature: float = 1.0,
                 logprobs: Optional[Callable[[dict], torch.Tensor]] = None):
        if method not in METHODS:
            raise ValueError(f"verify_method={method!r}: use auto, probe or checksum")
        self.models = list(models)
        self.servers = servers  # rank 0: ServerCalls; None elsewhere
        self.group = group
        self.method = method
        self.tol = tol
        self.temperature = temperature
        self.logprobs = logprobs  # the trainer's logprobs of a batch (collective); None: no verification
        self._checksums: dict[str, str] = {}  # each server's /weights_checker checksum at the last check
        self._flavors: dict = {}  # how each server holds its weights (dtype, hash), learned once
        self._warned_skip: list[str] = []  # the servers last said not to be compared with the trainer's digest
        self._last_missed: Optional[list] = None  # the experts the probe last never selected

    @property
    def enabled(self) -> bool:
        return self.logprobs is not None

    def check(self, version: int, pushed: Sequence[str] = (), *, expect_change: bool = True,
              fp8_block: Optional[tuple[int, int]] = None) -> dict[str, float]:
        """Check that every server of the push (`pushed`, rank 0's; those still up) serves version `version`'s
        weights; raises SyncError naming the server and what differs. Returns the check's figures
        (`sync/verify_max_abs_diff`, and the probe's rounds and uncovered experts).

        probe: every server's logprobs for a crafted probe set equal the trainer's own (`tol`), the probe grown
        until the trainer's own routing selected every routed expert of every MoE layer (or the experts it never
        selected named); the difference is the largest one. checksum: every server's `/weights_checker` per-tensor
        checksums equal the trainer's digest of its own weights (`digest.py`), the server reports the sync's
        version, and (for what the digest cannot rebuild) its checksum changed with the sync and servers of one
        layout agree (`expect_change`: the sync sent weights that differ from the last); the difference is 0.
        auto: checksum wherever the servers can hash their weights (the embedded server, SGLang 0.5.18+), else
        probe (`_auto_method`)."""
        method = self.method
        if method == "auto":
            method = self._from_rank0(self._auto_method)
        if method == "checksum":
            replies: list = []  # rank 0's: the servers' per-tensor checksums stay there (only verdicts travel)
            unchanged: list = []
            verdict = None
            if self.servers is not None:
                replies, unchanged, verdict = self._verify_checksums(version, self.servers.still_up(pushed))
            verdict = from_rank0(verdict, self.group)
            # the trainer's digest first: it names the server and the tensors, where "unchanged" or "servers
            # disagree" does not say which tensors (or, between two servers, which of them is wrong)
            digested: set[str] = set()
            verdict = self._against_trainer(version, replies, fp8_block, digested) or verdict
            if verdict is None and expect_change:  # a server the digest judged equal to the trainer is right even
                # if a step left the weights as they were (zero advantages); only the others must have changed
                verdict = self._from_rank0(_unchanged_verdict, version, unchanged, digested)
            if verdict is not None:
                raise SyncError(f"verify_sync: {verdict}")
            return {"sync/verify_max_abs_diff": 0.0}
        return self._verify_probe(version, pushed)

    @contextlib.contextmanager
    def keeping_checksums(self) -> Iterator[None]:
        """A check of some servers only (a catch-up): the others' last checksums stay for the next push's check."""
        kept = dict(self._checksums)
        try:
            yield
        finally:
            self._checksums = {**kept, **self._checksums}

    def _from_rank0(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One decision: rank 0 computes it from the servers' answers, every rank gets it."""
        return from_rank0(fn(*args) if self.servers is not None else None, self.group)

    @property
    def _bridge(self) -> Any:
        """The trainer's model bridge (None: no model, e.g. a control-plane-only sync)."""
        if not self.models:
            return None
        from mega_async.bridge import bridge_for

        return bridge_for(self.models)

    @property
    def num_experts(self) -> Optional[int]:
        """Routed experts per MoE layer of the trainer's model (None: dense, or no model)."""
        return num_experts_of(self.models)

    @property
    def vocab_size(self) -> int:
        return int(self._bridge.hf_config.vocab_size) if self.models else 100

    @property
    def _mtp_from(self) -> Optional[int]:
        """The first HF layer index of the trainer's MTP layers (None: it has none)."""
        b = self._bridge
        return b.num_layers if b is not None and b.mtp_layers else None

    def _without_untrained_mtp(self, checksums: dict[str, str]) -> dict[str, str]:
        """A server's checksums less its MTP layers' when the trainer built none (trainer.mtp=off, or a checkpoint
        without them): a draft the run neither trains nor sends is not the trainer's to compare."""
        b = self._bridge
        if b is None or b.mtp_layers or not b.mtp_asked:
            return checksums
        return {n: c for n, c in checksums.items() if not is_mtp_hf_name(n, b.num_layers)}

    def _auto_method(self) -> str:
        """Rank 0: checksum (the trainer's exact digest) wherever the servers can hash what they hold: the embedded
        server and every tested SGLang release (0.5.18+: /weights_checker). The probe's tolerance cannot tell a
        stale bucket from a training step at real learning rates (lr 1e-5 moves a logprob by ~1e-5, below any
        tolerance that bf16 servers pass), so it is used only when asked for (trainer.verify_sync_method=probe)
        or where a server cannot hash its weights."""
        try:
            releases = self.servers.releases()
        except Exception:  # noqa: BLE001 - the checksum call reports an unreachable server itself
            return "checksum"
        return "checksum" if all(r is None or r.embedded or _hashes(r) for r in releases) else "probe"

    def _verify_checksums(self, version: int, addresses: Optional[list[str]]) -> tuple[list, list, Optional[str]]:
        """Rank 0: (the replies of the servers at `version`, to compare with the trainer's digest; the servers whose
        checksum did not change since the last check; None when every server reports `version` and alike servers
        agree, else what is wrong)."""
        if addresses == []:
            return [], [], "no server of this sync is up to be verified"
        try:
            replies, infos = self.servers.checksums(addresses)
        except Exception as e:  # noqa: BLE001
            return [], [], f"/weights_checker failed: {type(e).__name__}: {e}"
        at_version: list = []
        unchanged: list[tuple[str, str]] = []
        layouts: dict[str, list[tuple[str, str]]] = {}
        for address, reply, info in zip(addresses or self.servers.client.addresses, replies, infos):
            if str(info.get("weight_version")) != str(version):
                return at_version, unchanged, (f"server {address} reports weight_version "
                                               f"{info.get('weight_version')!r}, expected {version}")
            if isinstance(reply, dict):
                at_version.append((address, reply))  # compared with the trainer's digest next
            checksum = reply.get("per_engine_checksum") if isinstance(reply, dict) else None
            if not isinstance(checksum, str):
                return at_version, unchanged, f"server {address}'s /weights_checker gave no per_engine_checksum: " \
                                              f"{reply!r}"[:300]
            if self._checksums.get(address) == checksum:
                unchanged.append((address, checksum))
            layouts.setdefault(_layout_key(reply), []).append((address, checksum))
        for same in layouts.values():
            if len({c for _, c in same}) > 1:
                return at_version, unchanged, ("servers of one layout serve different weights at version "
                                               f"{version}: " + ", ".join(f"{a} {c[:16]}" for a, c in same))
        self._checksums = {a: c for same in layouts.values() for a, c in same}
        return at_version, unchanged, None

    def _against_trainer(self, version: int, replies: list, fp8_block: Optional[tuple[int, int]],
                         digested: set[str]) -> Optional[str]:
        """Every rank (the export is collective): rank 0 compares each server's per-tensor checksums with the
        trainer's digest of its own weights, which equal those the sync sent (nothing trains between the push and
        its check); the servers found equal go into `digested`. Returns rank 0's verdict on every rank."""
        from mega_async.trainer.weights import export_hf_weights

        plan = self._digest_plan(replies, fp8_block) if self.servers is not None else None
        if not from_rank0(plan is not None and bool(plan.servers), self.group):
            return None
        try:
            for name, t in self._as_servers_hold(export_hf_weights(self.models), fp8_block):
                if plan is not None:
                    plan.add(name, t)
            verdict = plan.verdict(version) if plan is not None else None
            if plan is not None and verdict is None:
                digested.update(a for a, _ in plan.servers)  # each holds exactly the trainer's weights
        except Exception as e:  # noqa: BLE001 - only rank 0 computes; the verdict is shared below
            verdict = f"computing the trainer's digest failed: {type(e).__name__}: {e}"
        return from_rank0(verdict, self.group)

    def _as_servers_hold(self, named: Any, fp8_block: Optional[tuple[int, int]]) -> Any:
        """The trainer's tensors as a server holds them after this sync: an FP8 sync's weights went out quantized
        (the same blocks and formula as `_fp8_bucket` and the disk export), and a server started on an FP8
        checkpoint dequantizes each weight with its scale (`server.weights.updates_dequantized`), so the digest
        is of dequant(quant(w)), bit for bit what it holds."""
        if fp8_block is None:
            return named
        from mega_async.bridge import fp8

        skip = fp8.skipped_modules(self._bridge.hf_config)
        return fp8.dequantize_named(fp8.quantize_named(named, fp8_block, skip), fp8_block)

    def _digest_plan(self, replies: list, fp8_block: Optional[tuple[int, int]]) -> Optional["DigestPlan"]:
        """Rank 0: the servers (and ranks) whose checksums can be compared with a digest the trainer rebuilds."""
        if not replies:
            return None
        skipped: list[str] = []
        try:
            infos = self.servers.server_info([a for a, _ in replies])
        except Exception as e:  # noqa: BLE001
            raise SyncError(f"verify_sync: /server_info failed: {type(e).__name__}: {e}") from e
        plan = DigestPlan(self.num_experts, self._flavors, self._mtp_from)
        for (address, reply), info in zip(replies, infos):
            why = _not_rebuilt(reply, info, fp8_block is not None)
            if why:
                skipped.append(f"{address} ({why})")
                continue
            for r in reply.get("ranks") or []:
                plan.expect(address, self._without_untrained_mtp(r.get("checksums") or {}))
        if skipped and self._warned_skip != skipped:
            self._warned_skip = skipped
            logger.warning("verify_sync: not compared with the trainer's digest, only across servers and steps: %s",
                           "; ".join(skipped))
        return plan

    def _verify_probe(self, version: int, pushed: Sequence[str]) -> dict[str, float]:
        """The crafted probe set (`probe_prompts`): each round's prompts to every server, the trainer's logprobs of
        what each server generated compared with the server's, and the trainer's own routing of those sequences
        recorded; rounds grow until every routed expert of every MoE layer was selected at least once (at most
        PROBE_ROUNDS), else the experts never selected are named in a warning and in `sync/verify_uncovered`."""
        worst, coverage = 0.0, None
        for round_ in range(PROBE_ROUNDS):
            probes = self._from_rank0(self._probe_servers, probe_prompts(round_, self.vocab_size), pushed)
            if isinstance(probes, str):
                raise SyncError(f"verify_sync: {probes}")
            from megatron.core import parallel_state as mpu

            # pipeline schedules need at least 2 x PP micro-batches: repeat the probes to fill them
            rows = max(len(probes), 4 * mpu.get_pipeline_model_parallel_world_size())
            batch = _probe_batch([probes[i % len(probes)] for i in range(rows)])
            with ExpertCoverage(self.models, self.num_experts) as seen:
                mine = self.logprobs(batch)  # collective on every rank
            seen = seen.reduced(self.group)
            before = None if coverage is None else int(coverage.sum())
            coverage = seen if coverage is None else coverage | seen
            verdict: Any = None
            if rank() == 0:  # rank 0 decides for all (DP replicas may differ in the last bits on GPU)
                verdict, worst = self._probe_verdict(version, probes, mine, worst)
            verdict = from_rank0(verdict, self.group)
            if isinstance(verdict, str):
                raise SyncError(f"verify_sync: {verdict}")
            if coverage is None or bool(coverage.all()):
                break
            if before is not None and int(coverage.sum()) == before:
                break  # a round twice as large found no new expert: the routers never pick the rest (a collapsed
                # router), so more rounds only cost time; the rest is named below
        out = {"sync/verify_max_abs_diff": worst, "sync/verify_probe_rounds": float(round_ + 1),
               "sync/verify_uncovered": 0.0}
        if coverage is not None and not bool(coverage.all()):
            missed = [(layer, e) for layer, e in (~coverage).nonzero().tolist()]
            out["sync/verify_uncovered"] = float(len(missed))
            if rank() == 0:  # a warning when the set changes, not every step of a run whose routers collapsed
                say = logger.warning if missed != self._last_missed else logger.debug
                say("verify_sync: the probe never selected %d routed expert(s), whose weights it did not check: %s",
                    len(missed), ", ".join(f"layer {layer} expert {e}" for layer, e in missed[:12]))
            self._last_missed = missed
        return out

    def _probe_servers(self, prompts: list[list[int]], pushed: Sequence[str]) -> Any:
        """Rank 0: every prompt on every server of this sync: [(prompt, output, logprobs, version, address)], or
        the failure as a string."""
        addresses = self.servers.still_up(pushed) or self.servers.client.addresses
        payloads = [{"input_ids": p, "return_logprob": True,
                     "sampling_params": {"max_new_tokens": PROBE_NEW_TOKENS, "temperature": self.temperature,
                                         "ignore_eos": True}} for p in prompts]
        try:
            outs = self.servers.generate(payloads, addresses)
        except Exception as e:  # noqa: BLE001
            return f"probe failed: {type(e).__name__}: {e}"
        return [(prompts[j % len(prompts)], o["output_ids"], [x[0] for x in o["meta_info"]["output_token_logprobs"]],
                 o["meta_info"].get("weight_version"), a) for j, (a, o) in enumerate(outs)]

    def _probe_verdict(self, version: int, probes: list, mine: torch.Tensor,
                       worst: float) -> tuple[Optional[str], float]:
        by_server: dict[str, float] = {}
        for i, (prompt, out, lps, got_version, address) in enumerate(probes):
            if str(got_version) != str(version):
                return f"server {address} reports weight_version {got_version!r}, expected {version}", worst
            want = mine[i, len(prompt):len(prompt) + len(out)]
            got = torch.tensor([float("-inf") if x is None else float(x) for x in lps])
            diff = float((got - want).abs().max()) if len(out) else 0.0
            by_server[address] = max(by_server.get(address, 0.0), diff)
        worst = max([worst, *by_server.values()])
        bad = {a: d for a, d in by_server.items() if not d <= self.tol}
        if bad:
            return ("server logprobs differ from the trainer's at version "
                    f"{version} (> {self.tol:g}): "
                    + ", ".join(f"server {a} by {d:.3g}" for a, d in bad.items())), worst
        return None, worst


METHODS = ("auto", "probe", "checksum")  # trainer.verify_sync_method


def num_experts_of(models: Sequence[torch.nn.Module]) -> Optional[int]:
    """Routed experts per MoE layer of the trainer's model (None: dense, or no model)."""
    if not models:
        return None
    from mega_async.bridge import bridge_for

    cfg = bridge_for(models).hf_config
    return next((int(v) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                 if (v := getattr(cfg, k, None))), None)


def _unchanged_verdict(version: int, unchanged: list[tuple[str, str]], digested: set[str]) -> Optional[str]:
    """A server whose checksum did not change with this sync, and that the trainer's digest did not find equal to
    the trainer's weights (its checksums could not be rebuilt), may have missed the sync."""
    for address, checksum in unchanged:
        if address not in digested:
            return (f"server {address}'s weights did not change with the sync to version {version} "
                    f"(checksum {checksum[:16]}) and cannot be compared with the trainer's digest")
    return None


# the crafted probe: round r has 4 * 2**r prompts of PROBE_PROMPT_LEN tokens drawn with seed r from the vocabulary,
# each generating PROBE_NEW_TOKENS; rounds are added until the trainer's routing of the probe covered every expert
PROBE_ROUNDS = 4
PROBE_PROMPT_LEN = 8
PROBE_NEW_TOKENS = 8


def probe_prompts(round_: int, vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(round_)
    n = 4 * 2 ** round_
    return torch.randint(1, max(2, vocab_size), (n, PROBE_PROMPT_LEN), generator=g).tolist()


class ExpertCoverage:
    """Which routed experts the trainer's routers selected during one forward ([layers, experts] bool, by global
    layer number; dense layers all True). A forward hook on every Megatron TopKRouter ORs its routing map over the tokens."""

    def __init__(self, models: Sequence[torch.nn.Module], num_experts: Optional[int]):
        self.models, self.num_experts = list(models), num_experts
        self._hooks: list = []
        self.layers: list[int] = []
        self.seen: Optional[torch.Tensor] = None

    def __enter__(self) -> "ExpertCoverage":
        if not self.num_experts or not self.models:
            return self
        from megatron.core.transformer.moe.router import TopKRouter

        from mega_async.trainer.routing import moe_layers

        cfg = self.models[0].config
        self.layers = moe_layers(cfg, cfg.num_layers)
        self.seen = torch.zeros(cfg.num_layers, self.num_experts, dtype=torch.int32)
        for m in self.models:
            for r in m.modules():
                if isinstance(r, TopKRouter):
                    self._hooks.append(r.register_forward_hook(self._hook))
        return self

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        routing_map = out[1]
        self.seen[module.layer_number - 1] |= routing_map.detach().any(0).to("cpu", torch.int32)

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()

    def reduced(self, group: Any = None) -> Optional[torch.Tensor]:
        """Over every rank (each saw its own tokens, layers and micro-batches): [layers, experts] bool."""
        if self.seen is None:
            return None
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(self.seen, op=dist.ReduceOp.MAX, group=group)
        out = torch.ones_like(self.seen, dtype=torch.bool)  # dense layers have no routed expert to cover
        out[self.layers] = self.seen[self.layers].bool()
        return out


def aligned_order(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The order in which to flatten a bucket so that every tensor starts at a multiple of its element size
    (largest elements first; stable): SGLang 0.5.23 refuses an unaligned flattened bucket before receiving it,
    older releases fail viewing it after."""
    return sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())


def _layout_key(reply: dict) -> str:
    """What must match for two servers' checksums to be comparable: each rank's placement (tp/pp/dp sizes and
    ranks; SGLang 0.5.21+ lists one entry per role, 0.5.18-0.5.20 gives one)."""
    ranks = reply.get("ranks") or []
    out = []
    for r in ranks:
        pis = r.get("parallelism_info") if isinstance(r, dict) else None
        for pi in pis if isinstance(pis, list) else [pis]:
            if isinstance(pi, dict):
                out.append(tuple(pi.get(k) for k in ("role", "tp_rank", "tp_size", "pp_rank", "pp_size", "dp_size")))
    return repr(sorted(out, key=repr))


def _probe_batch(probes: list) -> dict[str, torch.Tensor]:
    n = len(probes)
    L = max(len(p[0]) + len(p[1]) for p in probes)
    b = {"input_ids": torch.zeros(n, L, dtype=torch.long), "attention_mask": torch.zeros(n, L, dtype=torch.long),
         "loss_mask": torch.zeros(n, L, dtype=torch.long), "logprobs": torch.zeros(n, L),
         "versions": torch.full((n, L), -1, dtype=torch.long), "advantages": torch.zeros(n)}
    for i, (p, o, *_) in enumerate(probes):
        ids = list(p) + list(o)
        b["input_ids"][i, :len(ids)] = torch.tensor(ids)
        b["attention_mask"][i, :len(ids)] = 1
        b["loss_mask"][i, len(p):len(ids)] = 1
    return b


def _not_rebuilt(reply: dict, info: dict, fp8_sync: bool = False) -> Optional[str]:
    """Why a server's checksums cannot be rebuilt by the trainer (None: they can): each rank must hold the whole
    model (tp, pp, ep, attention-DP of 1), as the embedded server and a one-GPU SGLang server do; after an FP8
    sync it must hold the weights dequantized (the embedded server does; SGLang's FP8 engine keeps the FP8 bytes
    and re-lays its scales for its kernels, which the digest does not rebuild)."""
    if fp8_sync and any(n.endswith("_scale_inv") for r in reply.get("ranks") or []
                        for n in (r.get("checksums") or {})):
        return "it holds FP8 weights and their scales as its kernels lay them out: not rebuilt"
    for r in reply.get("ranks") or []:
        pis = r.get("parallelism_info")
        for pi in pis if isinstance(pis, list) else [pis]:
            if isinstance(pi, dict) and (pi.get("tp_size", 1) > 1 or pi.get("pp_size", 1) > 1):
                return f"tp_size={pi.get('tp_size')}, pp_size={pi.get('pp_size')}: shards are not rebuilt"
    for k in ("tp_size", "pp_size", "ep_size", "moe_ep_size"):
        if isinstance(info.get(k), int) and info[k] > 1:
            return f"{k}={info[k]}: shards are not rebuilt"
    if info.get("enable_dp_attention"):
        return "DP attention: shards are not rebuilt"
    return None


class DigestPlan:
    """Rank 0, one verify: the trainer's digest for every server rank to compare, fed the trainer's tensors once.
    Ranks that report the same tensor names and hold them alike (dtype, hash) share one digest."""

    def __init__(self, num_experts: Optional[int], flavors: dict, mtp_from: Optional[int] = None):
        self.num_experts = num_experts
        self.mtp_from = mtp_from  # the trainer's MTP layers start at this HF layer: a server without them skips them
        self.flavors = flavors  # address -> Flavor, kept across verifies
        self.servers: list[tuple[str, dict[str, str]]] = []
        self._builders: dict[tuple, DigestBuilder] = {}
        self._early: list[tuple[str, torch.Tensor]] = []  # tensors that came before every flavor was learned
        self._tries: dict[str, int] = {}
        self.unlearned: set[str] = set()  # servers none of whose tensors equals the trainer's

    def expect(self, address: str, checksums: dict[str, str]) -> None:
        self.servers.append((address, checksums))

    def _key(self, address: str, checksums: dict[str, str]) -> tuple:
        f = self.flavors[address]
        return (f.dtype, f.hash, frozenset(checksums))

    def add(self, name: str, t: torch.Tensor) -> None:
        for a, c in self.servers:
            if a in self.flavors or a in self.unlearned or name not in c:
                continue
            if (f := learn_flavor(c, [(name, t)])) is not None:
                self.flavors[a] = f
            elif t.dtype.is_floating_point and not name.endswith(("embed_tokens.weight", "lm_head.weight")):
                self._tries[a] = self._tries.get(a, 0) + 1
                if self._tries[a] >= 8:  # eight of its plain tensors differ in every dtype and hash
                    self.unlearned.add(a)
        self._early.append((name, t))
        if any(a not in self.flavors and a not in self.unlearned for a, _ in self.servers):
            return  # held until every server's flavor is known (usually only the embedding comes first)
        for a, c in self.servers:
            if a in self.flavors and self._key(a, c) not in self._builders:
                self._builders[self._key(a, c)] = DigestBuilder(c, self.flavors[a], self.num_experts,
                                                                self._skip_mtp(c))
        for early in self._early:
            for builder in self._builders.values():
                builder.add(*early)
        self._early = []

    def _skip_mtp(self, checksums: dict[str, str]) -> Optional[int]:
        """A server that holds none of the MTP layers' tensors (a target model without its draft) is not sent them:
        the first MTP layer, whose tensors its digest leaves out (None: none left out)."""
        if self.mtp_from is None or any(is_mtp_hf_name(n, self.mtp_from) for n in checksums):
            return None
        return self.mtp_from

    def verdict(self, version: int) -> Optional[str]:
        """None when every compared server holds exactly the trainer's tensors; else the first server's problem."""
        unlearned = [a for a, _ in self.servers if a not in self.flavors]  # (also: fewer than 8 plain tensors)
        if unlearned:
            return (f"server {unlearned[0]}: none of its tensors equals the trainer's at version {version} in any "
                    f"dtype (float32, bfloat16, float16) or hash (sha256, SGLang's GPU hash): its weights are not the "
                    "trainer's")
        for builder in self._builders.values():  # a model too small to have learned every flavor before its end
            for early in self._early:
                builder.add(*early)
        done = {k: b.finish() for k, b in self._builders.items()}
        for a, c in self.servers:
            differing, missing, extra, uncovered = compare(c, done[self._key(a, c)])
            if differing or missing or extra:
                parts = [f"{len(v)} {what}: {', '.join(v[:6])}{' ...' if len(v) > 6 else ''}"
                         for what, v in (("differ", differing), ("missing on the server", missing),
                                         ("on the server but not sent by the trainer", extra)) if v]
                return (f"server {a} does not serve the trainer's weights at version {version} "
                        f"(checksums against the trainer's digest): {'; '.join(parts)}")
            if uncovered:
                logger.info("verify_sync: %s: %d derived tensors not rebuilt by the digest (%s)", a, len(uncovered),
                            ", ".join(uncovered[:4]))
        return None


def _hashes(release: Any) -> bool:
    """Whether a server of this SGLang release answers /weights_checker's checksum (0.5.18+)."""
    from mega_async.api.sglang_releases import parse_version

    v = parse_version(getattr(release, "version", None))
    return v is not None and v >= (0, 5, 18)
