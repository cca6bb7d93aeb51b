"""Which SGLang releases the weight-sync protocol is tested against, and what each one expects. Pure, no I/O.

The trainer's client and the embedded server both read it (the server mirrors one release; the client
speaks each server's release). What changed between releases, from SGLang's own source:

- 0.5.21: `/update_weights_from_distributed` and `/update_weights_from_tensor` must run inside a
  weight-update session: `POST /begin_weight_update {"selector": "target"|"draft"|"all"}` opens it (a
  second begin is refused), `POST /end_weight_update {}` closes it and finalizes the load; an update outside
  a session answers 400 `{"success": false, "message": "<op> must run between begin_weight_update() and
  end_weight_update()"}`. Update requests gained `selector` and `torch_empty_cache`. A flush after an update
  that cannot run (requests still running) now fails the update call instead of asserting in the scheduler.
  `/get_weight_version` and `/weight_version` (deprecated since 0.5.1x) are gone: use `/model_info`.
- 0.5.23: a flattened bucket is allocated from its metadata before the broadcast (`FlattenedTensorBucket.empty`)
  and refused there, 400 "Failed to receive weights: Unaligned received tensor <name>: byte offset <n>, dtype
  <dtype>", when a tensor does not start at a multiple of its dtype's size (and for an empty bucket): the trainer
  orders each flattened bucket by element size, largest first, so every offset is aligned.
- 0.5.18 .. 0.5.23: `/weights_checker` (`action`: checksum | snapshot | compare | reset_tensors) answers
  per-rank sha256-based checksums of the served weights (0.5.23 merges draft runners under `draft.` keys and
  lists `parallelism_info` per role).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

OLDEST_TESTED = (0, 5, 18)
NEWEST_TESTED = (0, 5, 23)
SESSIONS_SINCE = (0, 5, 21)  # begin/end_weight_update required around distributed and tensor updates
ALIGNED_BUCKETS_SINCE = (0, 5, 23)  # a flattened bucket's tensors must start at multiples of their dtype's size
# `--attn-dp-size N` (0.5.23's server_args; `--dp-size N --enable-dp-attention` deprecated there, removal announced
# for after 2026-12-31); 0.5.20 knows only the old spelling. Releases between were not read: the old spelling.
ATTN_DP_SIZE_SINCE = (0, 5, 23)
MIRRORED_DEFAULT = "0.5.23"  # the release the embedded server mirrors unless told otherwise
TESTED_RANGE = f"{'.'.join(map(str, OLDEST_TESTED))}..{'.'.join(map(str, NEWEST_TESTED))}"
SELECTORS = ("target", "draft", "all")

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def parse_version(s: Any) -> Optional[tuple[int, int, int]]:
    """'0.5.23', '0.5.15.post1', 'v0.5.21rc0' -> (0, 5, 21); anything else (None, 'mega_async-embedded') -> None."""
    if not isinstance(s, str):
        return None
    m = _VERSION.match(s.strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def is_tested(version: tuple[int, int, int]) -> bool:
    return OLDEST_TESTED <= version <= NEWEST_TESTED


def untested_reason(version_string: Any) -> Optional[str]:
    """None when the release is in the tested range; else why not, in a few words."""
    v = parse_version(version_string)
    if v is None:
        return f"SGLang version {version_string!r} cannot be read"
    if not is_tested(v):
        return f"SGLang {version_string} is outside the tested range {TESTED_RANGE}"
    return None


@dataclass(frozen=True)
class Release:
    """The weight-sync protocol of one SGLang release (None: not known yet, learned from a 404 later)."""

    version: Optional[str]
    sessions: Optional[bool]  # needs begin/end_weight_update around distributed and tensor updates
    embedded: bool = False  # mega_async's embedded server mirroring this release (its logprobs are exact)
    draft: bool = False  # serves a NextN/EAGLE speculative draft (the model's MTP layers): `serves_draft`
    mtp_kept: bool = True  # embedded server: it keeps the model's MTP layers (/server_info's mtp_layers_kept)

    @staticmethod
    def of(version_string: Any, embedded: bool = False, draft: bool = False, mtp_kept: bool = True) -> "Release":
        v = parse_version(version_string)
        return Release(version_string if isinstance(version_string, str) else None,
                       None if v is None else v >= SESSIONS_SINCE, embedded, draft, mtp_kept)

    @property
    def keeps_mtp(self) -> bool:
        """Whether the weight sync sends it the model's MTP layers: SGLang serving them as its draft, or the embedded
        server holding them (it keeps every checkpoint weight by name; one started from a checkpoint without them
        serves the target model alone, as SGLang does)."""
        return self.draft or (self.embedded and self.mtp_kept)

    @property
    def pause_polls(self) -> bool:
        """Whether its abort-mode /pause_generation, finding requests in flight, waits a second: SGLang aborts, then
        while any request handler still holds its lock sleeps 1.0 s before looking again
        (tokenizer_manager.pause_generation); the embedded server answers once its aborted requests are answered.
        A client aborts first on such a server (`SGLangClient.abort_in_flight`)."""
        return not self.embedded

    @property
    def refuses_unaligned_buckets(self) -> bool:
        """0.5.23's FlattenedTensorBucket.empty refuses, before the broadcast, a tensor whose byte offset is not a
        multiple of its dtype's size (older releases fail at the view after receiving it)."""
        v = parse_version(self.version)
        return v is not None and v >= ALIGNED_BUCKETS_SINCE

    @property
    def has_weight_version_endpoint(self) -> bool:
        """GET /get_weight_version (and /weight_version): removed in 0.5.21."""
        return self.sessions is False


# SGLang's speculative algorithms whose draft is the model's own MTP layers (NEXTN is EAGLE over them; server_args
# rewrites it to EAGLE, so /server_info says EAGLE). Their draft loads `model.layers.{num_hidden_layers}.*` from an
# update and the target skips those names (deepseek_weight_loader's NextN config).
DRAFT_ALGORITHMS = ("EAGLE", "NEXTN")


def serves_draft(server_info: Any) -> bool:
    """Whether a /server_info answer says the server runs a draft made of the model's MTP layers."""
    return isinstance(server_info, dict) and str(server_info.get("speculative_algorithm") or "").upper() in \
        DRAFT_ALGORITHMS


def mtp_plan(servers: Sequence[tuple[str, Optional[Release]]]) -> tuple[bool, Optional[str]]:
    """Whether a distributed sync sends the MTP layers to these (address, release) servers, or why it cannot.

    Every server keeps them (`keeps_mtp`): sent, under selector "all" (0.5.21+ loads one received bucket into the
    target and the draft). None does: not sent (they get the target model only). A mix cannot share one broadcast
    stream. A draft on a release before 0.5.21 is refused: its update_weights_from_distributed loads the target
    only, which would leave the draft one version behind the policy (its update_weights_from_disk loads both)."""
    keep = [a for a, r in servers if r is not None and r.keeps_mtp]
    stale = [f"{a} (SGLang {r.version or '?'})" for a, r in servers
             if r is not None and r.draft and not r.embedded and r.sessions is False]
    if stale:
        return False, (f"server(s) {', '.join(stale)} serve an MTP draft that update_weights_from_distributed does not "
                       f"update before SGLang {'.'.join(map(str, SESSIONS_SINCE))}: upgrade SGLang, or use "
                       "trainer.weight_sync=disk (it reloads the draft too)")
    if keep and len(keep) < len(servers):
        rest = [a for a, _ in servers if a not in keep]
        return False, (f"server(s) {', '.join(keep)} serve an MTP draft and {', '.join(rest)} do not: one weight "
                       "broadcast cannot send the MTP layers to some only; start every server with or every one "
                       "without --speculative-algorithm")
    return bool(keep), None


def session_refusal(op: str) -> str:
    """SGLang 0.5.21+'s message for a distributed/tensor update outside a session (op: the request's name)."""
    return f"{op} must run between begin_weight_update() and end_weight_update()"


BEGIN_TWICE = "a weight-update session is already open; call end_weight_update() first"
END_WITHOUT_BEGIN = "no weight-update session is open; call begin_weight_update() first"


def dp_attention_args(release: Any, size: int) -> list[str]:
    """SGLang's flags for DP attention of `size` ranks, in the spelling of `release` (None: not known, the spelling
    every tested release accepts)."""
    v = parse_version(release)
    if v is not None and v >= ATTN_DP_SIZE_SINCE:
        return ["--attn-dp-size", str(size)]
    return ["--dp-size", str(size), "--enable-dp-attention"]
