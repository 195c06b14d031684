"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": ...}`, optionally after `<|python_tag|>`."""
from __future__ import annotations

import json
import re

from rlfactory_megatron.envs.tool_manager.calls import ParsedTurn, ToolCall, decode_calls

PYTHON_TAG = "<|python_tag|>"
_END_MARKERS = ("<|eom_id|>", "<|eot_id|>")
# Where a second call may start after a broken one: a ';' or newline before '{'.
_NEXT_CALL = re.compile(r"[;\n]\s*(?=[{\[])")


class Llama3JsonToolParser:
    """Llama 3.1+ writes a tool call as the whole message (a JSON object, or several separated
    by ';'), with `<|python_tag|>` in front when the template asks for it. Text that neither
    starts with JSON nor carries the tag is a plain answer.
    """

    def __init__(self, tool_names: list[str] | None = None):
        self.known_tools = frozenset(tool_names) if tool_names is not None else None

    def parse(self, text: str) -> ParsedTurn:
        for marker in _END_MARKERS:
            text = text.replace(marker, "")
        if PYTHON_TAG in text:
            content, call_text = text.split(PYTHON_TAG, 1)
        elif text.lstrip().startswith(("{", "[")):
            content, call_text = "", text
        else:
            return ParsedTurn(content=text.strip())
        errors: list[str] = []
        calls: list[ToolCall] = []
        for payload in _split_payloads(call_text):
            calls += decode_calls(payload, errors, self.known_tools, ("parameters", "arguments"))
        if not calls and not errors:
            errors.append(f"{PYTHON_TAG} is followed by no JSON tool call")
        return ParsedTurn(content=content.strip(), tool_calls=calls, errors=errors)


def _split_payloads(text: str) -> list[str]:
    """Cut `text` into the JSON texts of consecutive calls; a broken one becomes its own payload."""
    decoder = json.JSONDecoder()
    payloads, pos = [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in ";,"):
            pos += 1
        if pos >= len(text):
            return payloads
        try:
            _, end = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            following = _NEXT_CALL.search(text, pos + 1)
            end = following.start() if following else len(text)
        payloads.append(text[pos:end])
        pos = end
