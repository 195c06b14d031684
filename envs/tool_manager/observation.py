"""Cutting tool output to a token budget before the model sees it."""
from __future__ import annotations

import re
from typing import Any

TRUNCATION_MARKER = "\n...[truncated: {dropped} more characters not shown]"
# No token spans more characters than this, so a prefix this long holds the whole budget.
_MAX_CHARS_PER_TOKEN = 16
# Not encodable as UTF-8, so no tokenizer takes them (surrogate pairs are already one code point).
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def safe_text(text: Any) -> str:
    """`text` as a string a tokenizer accepts: lone surrogates (text decoded with
    `surrogateescape`, as some tools and MCP servers produce) become U+FFFD, a non-string is
    its str()."""
    if not isinstance(text, str):
        text = text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else str(text)
    return _LONE_SURROGATE.sub("\ufffd", text)


def truncate_observation(text: str, max_tokens: int, tokenizer: Any | None = None) -> str:
    """Keep the head of `text` within `max_tokens` tokens (characters without a tokenizer) and
    append a marker saying how much was dropped, so the model knows the output is incomplete.
    The text is made safe first (`safe_text`): nothing a tool returns may crash the tokenizer."""
    text = safe_text(text)
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
