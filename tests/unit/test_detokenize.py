"""Incremental detokenization (OpenAI streaming, stop strings): deltas concatenate to exactly the whole decode,
split multi-byte characters included, and each token is decoded a bounded number of times (the old stream
decoded the whole output at every step: n^2 / 2 tokens)."""
import random

import pytest

from mega_async.server.detokenize import IncrementalDecoder, StreamedText
from mega_async.bridge.model_cards import TINY_MOE


class Counting:
    """The real tokenizer, counting what it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.calls, self.tokens = tok, 0, 0

    def decode(self, ids, **kw):
        self.calls += 1
        self.tokens += len(ids)
        return self.tok.decode(ids, **kw)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_MOE)


_PARTIAL = {}


def partial_ids(tok):
    """Tokens that are a piece of a UTF-8 sequence (a lead or continuation byte on its own)."""
    if id(tok) not in _PARTIAL:
        _PARTIAL[id(tok)] = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    return _PARTIAL[id(tok)]


def random_ids(tok, rng, n):
    """Words, multi-byte text (split into byte tokens by the tiny vocabulary), stray bytes, special tokens."""
    partial = partial_ids(tok)
    texts = ["中文", "😀", "é", "ß∂ƒ", " the", " cat", "\n", "١٢٣", "👩‍👩‍👧"]
    ids = []
    while len(ids) < n:
        r = rng.random()
        if r < 0.4:
            ids += tok(rng.choice(texts), add_special_tokens=False)["input_ids"]
        elif r < 0.6:
            ids.append(rng.choice(partial))  # a lead or continuation byte on its own
        elif r < 0.65:
            ids.append(rng.choice(tok.all_special_ids))
        else:
            ids.append(rng.randrange(3, len(tok)))
    return ids[:n]


@pytest.mark.parametrize("skip_special", [True, False])
def test_deltas_concatenate_to_the_whole_decode(tok, skip_special):
    rng = random.Random(0)
    for trial in range(60):
        ids = random_ids(tok, rng, rng.randrange(1, 120))
        whole = tok.decode(ids, skip_special_tokens=skip_special)
        st = StreamedText(tok, skip_special_tokens=skip_special)
        got, k = "", 0
        while k < len(ids):
            k = min(len(ids), k + rng.choice([1, 1, 1, 2, 5]))  # one token a step, or a few (stream_interval)
            got += st.delta(ids, k)
            assert whole.startswith(got), (trial, ids[:k])  # what was sent is never taken back
        assert got + st.final(whole) == whole, trial


def test_stop_string_start_is_held_back(tok):
    """A stream with stop strings never sends what the finished text cuts: the start of a stop string waits."""
    ids = tok("hello world STOP tail", add_special_tokens=False)["input_ids"]
    stop_at = next(k for k in range(len(ids)) if "STOP" in tok.decode(ids[:k + 1])) + 1
    st = StreamedText(tok, stop=["STOP", "xy"])
    sent = "".join(st.delta(ids, k) for k in range(1, stop_at + 1))
    final = tok.decode(ids[:stop_at]).split("STOP")[0]  # output_text's trim
    assert final.startswith(sent) and sent + st.final(final) == final == "hello world "


@pytest.mark.parametrize("kind", ["text", "stray_bytes", "split_chars"])
def test_each_token_is_decoded_a_bounded_number_of_times(tok, kind):
    """4096 tokens streamed one at a time: the tokens decoded stay linear in the output (the old stream decoded
    the whole output each step, 8.4M tokens here), also for bytes that never complete a character."""
    rng = random.Random(1)
    n = 4096
    partial = partial_ids(tok)
    if kind == "text":
        ids = random_ids(tok, rng, n)
    elif kind == "stray_bytes":  # a continuation byte after a continuation byte, forever: U+FFFD at every step
        cont = [i for i in partial if tok.decode([163, i]) != "\ufffd\ufffd"][:1] or partial[:1]
        ids = [cont[0]] * n
    else:  # lead bytes and continuations interleaved at random
        ids = [rng.choice(partial) for _ in range(n)]
    counting = Counting(tok)
    dec = IncrementalDecoder(counting)
    text = "".join(dec.step(ids, k) for k in range(1, n + 1))
    st = StreamedText(tok)
    for k in range(1, n + 1):
        st.delta(ids, k)
    whole = tok.decode(ids, skip_special_tokens=True)
    assert whole.startswith(text) and whole.startswith(st.text)
    assert counting.tokens <= 48 * n, counting.tokens
    assert counting.calls <= 12 * n, counting.calls


def test_stop_matcher_finds_what_the_whole_decode_holds_in_bounded_work(tok):
    """The engine's stop check: the first token at which the decoded output contains a stop string (the old
    check's rule), found by searching only the tail; a 4000-character stop string costs no more per token."""
    from mega_async.server.detokenize import StopMatcher

    rng = random.Random(2)
    for trial in range(40):
        ids = random_ids(tok, rng, 80)
        text = tok.decode(ids)
        a = rng.randrange(0, max(1, len(text) - 3))
        stop = text[a:a + rng.randrange(1, 12)].replace("\ufffd", "")
        if not stop:
            continue
        m = StopMatcher(tok, ["never-there", stop])
        got = next((k for k in range(1, len(ids) + 1) if m.step(ids[:k]) is not None), None)
        want = next((k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k])), None)
        assert got == want, (trial, stop)
    ids = random_ids(tok, rng, 2000)
    counting = Counting(tok)
    m = StopMatcher(counting, ["q" * 4000])
    assert all(m.step(ids[:k]) is None for k in range(1, len(ids) + 1))
    assert counting.tokens <= 48 * len(ids) and len(m.tail) <= 3999  # the old check decoded 4001 tokens a step
