"""Verification after a push: every server serves the sync's weights (logprob probe or /weights_checker).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional, Sequence

import torch

from mega_async.trainer.sync.common import SLACK_S, SyncError, from_rank0, rank

logger = logging.getLogger("mega_async.trainer.sync")


class Verification:
    """The verify half of WeightSync (mixed in): reads the sync's version, rollout side, loop and targets."""

    def verify(self, prompt_len: int = 6, new_tokens: int = 8) -> float:
        """Check that every server serves this sync's weights; raises SyncError.

        probe: every server's logprobs for a fixed prompt equal the trainer's own (`verify_tol`); returns the
        largest difference. checksum: every server's `/weights_checker` checksum changed since the last verify
        and servers of one layout agree (real SGLang in bf16, where logprobs differ from the trainer's); returns
        0. auto: probe when every server is an embedded one and the sync sends the trainer's dtype, else checksum."""
        method = self.verify_method
        if method == "auto":
            method = from_rank0(self._auto_method() if self.rollout is not None else None, self.group)
        if method == "checksum":
            verdict = from_rank0(self._verify_checksums() if self.rollout is not None else None, self.group)
            if verdict is not None:
                raise SyncError(f"verify_sync: {verdict}")
            return 0.0
        return self._verify_probe(prompt_len, new_tokens)

    def _verified(self) -> Optional[list[str]]:
        """Rank 0: the servers a verify checks: those of this push that are still up (None: every server)."""
        if not self._targets:
            return None
        now = set(self._targets_now())
        return [a for a in self._targets if a in now]

    def _auto_method(self) -> str:
        if self.fp8_block is not None:
            return "checksum"  # FP8 servers' logprobs differ from the trainer's by the quantization itself
        client = self.rollout.client
        try:
            releases = self._loop.run(client.learn_releases(self.timeout), self.timeout + SLACK_S,
                                      "asking the servers for their SGLang release")
        except Exception:  # noqa: BLE001 - the probe reports an unreachable server itself
            return "probe"
        return "probe" if all(r.embedded for r in releases if r is not None) else "checksum"

    def _verify_checksums(self) -> Optional[str]:
        """Rank 0: None when every server's weights changed with this sync and alike servers agree."""
        client = self.rollout.client
        addresses = self._verified()
        if addresses == []:
            return "no server of this sync is up to be verified"
        try:
            replies = self._loop.run(client.weights_checksums(self.timeout, addresses), self.timeout + SLACK_S,
                                     "/weights_checker")
            infos = self._loop.run(client.model_info(addresses, timeout=self.timeout), self.timeout + SLACK_S,
                                   "/model_info")
        except Exception as e:  # noqa: BLE001
            return f"/weights_checker failed: {type(e).__name__}: {e}"
        layouts: dict[str, list[tuple[str, str]]] = {}
        for address, reply, info in zip(addresses or client.addresses, replies, infos):
            if str(info.get("weight_version")) != str(self.version.value):
                return (f"server {address} reports weight_version {info.get('weight_version')!r}, "
                        f"expected {self.version.value}")
            checksum = reply.get("per_engine_checksum") if isinstance(reply, dict) else None
            if not isinstance(checksum, str):
                return f"server {address}'s /weights_checker gave no per_engine_checksum: {reply!r}"[:300]
            if self.expects_new_weights and self._checksums.get(address) == checksum:
                return (f"server {address}'s weights did not change with the sync to version {self.version.value} "
                        f"(checksum {checksum[:16]})")
            layouts.setdefault(_layout_key(reply), []).append((address, checksum))
        for same in layouts.values():
            if len({c for _, c in same}) > 1:
                return ("servers of one layout serve different weights at version "
                        f"{self.version.value}: " + ", ".join(f"{a} {c[:16]}" for a, c in same))
        self._checksums = {a: c for same in layouts.values() for a, c in same}
        return None

    def _verify_probe(self, prompt_len: int, new_tokens: int) -> float:
        probes: Any = None
        if self.rollout is not None:
            client = self.rollout.client
            prompt = [1 + (7 * i) % 97 for i in range(prompt_len)]
            payload = {"input_ids": prompt, "return_logprob": True,
                       "sampling_params": {"max_new_tokens": new_tokens, "temperature": self.temperature,
                                           "ignore_eos": True}}

            chosen = set(self._verified() or client.addresses)
            index = [i for i, a in enumerate(client.addresses) if a in chosen]

            async def all_servers() -> list:
                return list(await asyncio.gather(*(client.generate_on(i, payload, timeout=self.timeout)
                                                   for i in index)))

            try:
                outs = self._loop.run(all_servers(), self.timeout + SLACK_S, "the verification probe")
                probes = [(prompt, o["output_ids"], [x[0] for x in o["meta_info"]["output_token_logprobs"]],
                           o["meta_info"].get("weight_version")) for o in outs]
            except Exception as e:  # noqa: BLE001
                probes = f"probe failed: {type(e).__name__}: {e}"
        probes = from_rank0(probes, self.group)
        if isinstance(probes, str):
            raise SyncError(f"verify_sync: {probes}")
        from megatron.core import parallel_state as mpu

        # pipeline schedules need at least 2 x PP micro-batches: repeat the probes to fill them
        rows = max(len(probes), 4 * mpu.get_pipeline_model_parallel_world_size())
        batch = _probe_batch([probes[i % len(probes)] for i in range(rows)])
        mine = self._verify_fn(batch)  # collective on every rank
        verdict: Any = None
        if rank() == 0:  # rank 0 decides for all (DP replicas may differ in the last bits on GPU)
            worst, verdict = 0.0, None
            for i, (prompt, out, lps, version) in enumerate(probes):
                if str(version) != str(self.version.value):
                    verdict = f"server {i} reports weight_version {version!r}, expected {self.version.value}"
                    break
                want = mine[i, len(prompt):len(prompt) + len(out)]
                got = torch.tensor([float("-inf") if x is None else float(x) for x in lps])
                worst = max(worst, float((got - want).abs().max()) if len(out) else 0.0)
            if verdict is None and worst > self.verify_tol:
                verdict = (f"server logprobs differ from the trainer's by {worst:.3g} (> {self.verify_tol:g}) "
                           f"at version {self.version.value}")
            verdict = verdict or worst
        verdict = from_rank0(verdict, self.group)
        if isinstance(verdict, str):
            raise SyncError(f"verify_sync: {verdict}")
        return float(verdict)


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
    L = max(len(p) + len(o) for p, o, _, _ in probes)
    b = {"input_ids": torch.zeros(n, L, dtype=torch.long), "attention_mask": torch.zeros(n, L, dtype=torch.long),
         "loss_mask": torch.zeros(n, L, dtype=torch.long), "logprobs": torch.zeros(n, L),
         "versions": torch.full((n, L), -1, dtype=torch.long), "advantages": torch.zeros(n)}
    for i, (p, o, _, _) in enumerate(probes):
        ids = list(p) + list(o)
        b["input_ids"][i, :len(ids)] = torch.tensor(ids)
        b["attention_mask"][i, :len(ids)] = 1
        b["loss_mask"][i, len(p):len(ids)] = 1
    return b
