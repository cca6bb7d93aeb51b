"""Incremental detokenization: the text of a growing token list, each token decoded a bounded number of times.

SGLang's detokenizer (managers/detokenizer_manager.py) decodes a surrogate window, `ids[surr:read]` (tokens
already turned into text, kept as context so a tokenizer that strips a leading space or joins pieces decodes
the new tokens as it would in the whole text) and `ids[surr:]`; the new text is the difference. While that
difference ends in U+FFFD (an incomplete UTF-8 sequence: a character split over tokens) nothing is committed
and the next token is decoded with it.

SGLang waits for as long as the text ends in U+FFFD. Bytes that never complete (a model that emits stray
continuation bytes) would grow the window without bound and make every step decode it again, so past
`max_pending` tokens the window is cut where the decode splits exactly (`decode(a) + decode(b) == decode(a + b)`,
UTF-8 being self-synchronising, such a point is a character boundary that no later byte moves) and what lies
before is committed. Deltas therefore concatenate to the whole decode for byte-level BPE tokenizers (GPT-2,
Qwen, Llama 3, DeepSeek): tests/unit/test_detokenize.py checks it on random token sequences with split
multi-byte characters. Only if no such cut exists within `max_pending` tokens (no tokenizer we know of) is the
window committed as it stands.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """The new text of `ids` at each `step(ids)` (ids only ever grows), as SGLang's DecodeStatus."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 max_pending: int = 8) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": skip_special_tokens,
                       "spaces_between_special_tokens": spaces_between_special_tokens}
        self.max_pending = max_pending
        self.surr = 0  # ids[surr:read] is decoded text kept as context
        self.read = 0  # ids[read:] is not committed yet

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), **self.kwargs) if ids else ""

    def _commit(self, upto: int) -> None:
        self.surr, self.read = self.read, upto

    def step(self, ids: Sequence[int], end: Optional[int] = None) -> str:
        """Text newly final in `ids[:end]` (may be "": an incomplete character waits for its next byte)."""
        end = len(ids) if end is None else end
        if end <= self.read:
            return ""
        surr_text = self._decode(ids[self.surr:self.read])
        full = self._decode(ids[self.surr:end])
        new = full[len(surr_text):]  # SGLang's difference, even where a tokenizer rewrites the context
        if new and not new.endswith(REPLACEMENT):
            self._commit(end)
            return new
        if end - self.read <= self.max_pending:
            return ""
        for cut in range(end - 1, end - 5, -1):  # a character is at most 4 bytes, a token at least 1
            if cut <= self.read:
                break
            head = self._decode(ids[self.surr:cut])
            if head.startswith(surr_text) and head + self._decode(ids[cut:end]) == full:
                self._commit(cut)
                return head[len(surr_text):]
        self._commit(end)  # no exact cut: keep the cost bounded, commit the window as decoded
        return new


class StreamedText:
    """One streamed choice's text: `delta` while it runs, `final` with the whole (trimmed) text at the end.

    The last (longest stop string - 1) characters are held back while running, and a whole stop string seen
    before the request is seen finished: either may be where the finished text is cut, so what was sent is
    always a prefix of the final text."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 stop: Sequence[str] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` sent
        self.stop = [s for s in stop if s]
        self.hold = max([len(s) - 1 for s in self.stop] + [0])

    def delta(self, ids: Sequence[int], end: Optional[int] = None) -> str:
        self.text += self.decoder.step(ids, end)
        upto = len(self.text) - self.hold
        for s in self.stop:  # none starts before `sent`: it would have been whole, and found, when that was sent
            at = self.text.find(s, self.sent)
            if at != -1:
                upto = min(upto, at)
        upto = max(self.sent, upto)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def final(self, text: str) -> str:
        """The rest of `text` (the non-streaming answer's text) after what was sent."""
        sent = self.text[:self.sent]
        if text.startswith(sent):
            return text[len(sent):]
        k = next((i for i, (a, b) in enumerate(zip(sent, text)) if a != b), min(len(sent), len(text)))
        return text[k:]  # only where a tokenizer decodes a part unlike the whole: the best that can still be sent


class StopMatcher:
    """The stop string a request's output has just come to contain, per token in bounded work: the output is
    decoded incrementally, and only the tail a new match can lie in is searched (the new text and the longest
    stop string - 1 characters before it; an earlier match would have stopped the request earlier)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=False)  # tokenizer.decode's default
        self.stops = [s for s in stops if s]
        self.keep = max([len(s) - 1 for s in self.stops] + [0])
        self.tail = ""

    def step(self, ids: Sequence[int]) -> Optional[str]:
        new = self.decoder.step(ids)
        if not new:
            return None
        text = self.tail + new
        self.tail = text[-self.keep:] if self.keep else ""
        return next((s for s in self.stops if s in text), None)
