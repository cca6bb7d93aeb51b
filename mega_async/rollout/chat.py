"""Chat-template turns as token ids, so multi-turn episodes never re-tokenize what the model generated.

The model card's chat template renders a new turn after fixed base messages; the text it adds is the
turn (verl's delta trick). What the template puts after an assistant message's content (e.g.
"<|im_end|>\\n") closes a generated turn; a stop token the model already emitted is not repeated.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
_SENTINEL = "\u2063MEGA_ASYNC_SENTINEL\u2063"


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of template text (special tokens in it are parsed, none added)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool, **template_kw: Any) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: add chat_template.jinja to the model card")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kw)


def prompt_ids(tokenizer: Any, messages: Sequence[dict], **template_kw: Any) -> list[int]:
    """The first prompt of a conversation, with the generation prompt."""
    return encode(tokenizer, render(tokenizer, messages, True, **template_kw))


def turn_ids(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = True,
             **template_kw: Any) -> list[int]:
    """Token ids of `messages` (user / tool turns) rendered after earlier turns, plus the generation prompt."""
    base = render(tokenizer, _BASE, False, **template_kw)
    full = render(tokenizer, _BASE + list(messages), add_generation_prompt, **template_kw)
    if not full.startswith(base):
        raise ValueError("the chat template does not render turns incrementally (earlier turns change when one is "
                         "added); multi-turn token ids cannot be built from it")
    return encode(tokenizer, full[len(base):])


def assistant_close_text(tokenizer: Any, **template_kw: Any) -> str:
    """What the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""
    text = render(tokenizer, _BASE + [{"role": "assistant", "content": _SENTINEL}], False, **template_kw)
    return text[text.index(_SENTINEL) + len(_SENTINEL):]


def close_ids(tokenizer: Any, output_ids: Sequence[int], **template_kw: Any) -> list[int]:
    """Token ids that close a generated assistant turn: the template's closing text, less a stop token that the
    model already produced (its last output token)."""
    close = assistant_close_text(tokenizer, **template_kw)
    tail = tokenizer.decode(list(output_ids[-1:]), skip_special_tokens=False) if output_ids else ""
    if tail and close.startswith(tail):
        close = close[len(tail):]
    return encode(tokenizer, close) if close else []


def end_of_turn_id(tokenizer: Any) -> Optional[int]:
    """The template's end-of-turn token (e.g. <|im_end|>) when it is a single token, else None."""
    ids = encode(tokenizer, assistant_close_text(tokenizer).strip())
    return ids[0] if len(ids) == 1 else None
