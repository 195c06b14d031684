"""Lenient JSON decoding for model output: strict JSON first, then the common slips models make."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_JSON_WORDS = {"true": "True", "false": "False", "null": "None"}


def loads_lenient(text: str) -> Any | None:
    """Decode `text` as JSON, tolerating code fences, trailing text, single quotes,
    Python literals and trailing commas. Returns None when nothing sensible decodes.

    Truncated JSON (missing closing brackets) is deliberately not repaired: guessing
    where cut-off arguments end would run a call the model never finished.
    """
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1)
    if not text:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        value, _ = json.JSONDecoder().raw_decode(text)
        return value
    except (ValueError, RecursionError):
        pass
    try:
        value = ast.literal_eval(_pythonize_words(text))
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
        return None
    return value if _is_json_like(value) else None


def _pythonize_words(text: str) -> str:
    """Map bare true/false/null to Python literals, leaving string contents untouched."""
    out, word, quote, escaped = [], [], None, False
    for ch in text + " ":
        if quote:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
            continue
        if ch.isalpha():
            word.append(ch)
            continue
        if word:
            w = "".join(word)
            out.append(_JSON_WORDS.get(w, w))
            word = []
        if ch in "\"'":
            quote = ch
        out.append(ch)
    return "".join(out)[:-1]


def _is_json_like(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_like(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_is_json_like(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))
