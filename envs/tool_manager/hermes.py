"""Hermes-style tool calls (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks."""
from __future__ import annotations

from rlfactory_megatron.envs.tool_manager.calls import ParsedTurn, ToolCall, decode_calls

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class HermesToolParser:
    """Parses every `<tool_call>` block of a turn that lies outside the model's reasoning.

    Calls written inside `<think>...</think>` are drafts, not requests (Qwen3's template drops
    reasoning from history), so only blocks after the last `</think>` run. A `</think>` without
    `<think>` counts too: some templates open the reasoning block inside the prompt.
    """

    def __init__(self, tool_names: list[str] | None = None):
        self.known_tools = frozenset(tool_names) if tool_names is not None else None

    def parse(self, text: str) -> ParsedTurn:
        errors: list[str] = []
        start, end = _answer_span(text)
        if end < len(text) and OPEN in text[end:]:
            errors.append(f"a {OPEN} inside an unclosed {THINK_OPEN} block was not run; close it with {THINK_CLOSE} first")
        calls: list[ToolCall] = []
        kept: list[str] = []
        kept_from = 0
        search = start
        while True:
            open_at = text.find(OPEN, search, end)
            stray_close = text.find(CLOSE, search, open_at if open_at >= 0 else end)
            if stray_close >= 0:
                errors.append(f"{CLOSE} at character {stray_close} has no matching {OPEN}")
            if open_at < 0:
                break
            body_start = open_at + len(OPEN)
            close_at = text.find(CLOSE, body_start, end)
            next_open = text.find(OPEN, body_start, end)
            if close_at < 0 or 0 <= next_open < close_at:
                # The unclosed block stays in the content as plain text.
                errors.append(f"unclosed {OPEN} block at character {open_at}: it needs a {CLOSE}")
                if next_open < 0:
                    break
                search = next_open
                continue
            kept.append(text[kept_from:open_at])
            calls += decode_calls(text[body_start:close_at], errors, self.known_tools, ("arguments", "parameters"))
            kept_from = search = close_at + len(CLOSE)
        kept.append(text[kept_from:])
        return ParsedTurn(content="".join(kept).strip(), tool_calls=calls, errors=errors)


def _answer_span(text: str) -> tuple[int, int]:
    """[start, end) of the text where calls count: after the reasoning block, if any."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return close + len(THINK_CLOSE), len(text)
    opened = text.find(THINK_OPEN)
    if opened >= 0:
        return 0, opened
    return 0, len(text)
