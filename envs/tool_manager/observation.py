"""Cutting tool output to a token budget before the model sees it."""
from __future__ import annotations

from typing import Any

TRUNCATION_MARKER = "\n...[truncated: {dropped} more characters not shown]"
# No token spans more characters than this, so a prefix this long holds the whole budget.
_MAX_CHARS_PER_TOKEN = 16


def truncate_observation(text: str, max_tokens: int, tokenizer: Any | None = None) -> str:
    """Keep the head of `text` within `max_tokens` tokens (characters without a tokenizer) and
    append a marker saying how much was dropped, so the model knows the output is incomplete."""
    if tokenizer is None:
        head = text[:max_tokens]
    else:
        # Tokenize only a bounded prefix: a 1 MB output would cost seconds for nothing.
        prefix = text[: max_tokens * _MAX_CHARS_PER_TOKEN]
        ids = tokenizer.encode(prefix, add_special_tokens=False)
        head = prefix if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])
    if len(head) >= len(text):
        return text
    return head + TRUNCATION_MARKER.format(dropped=len(text) - len(head))
