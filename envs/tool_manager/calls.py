"""Records a tool-call parser produces, and the shared decoding of one call object into a ToolCall."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlfactory_megatron.envs.tool_manager.lenient_json import loads_lenient


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def snippet(text: str, limit: int = 80) -> str:
    """Short, single-line excerpt of model output for error messages."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def decode_calls(
    payload: str,
    errors: list[str],
    known_tools: frozenset[str] | None,
    argument_keys: tuple[str, ...],
) -> list[ToolCall]:
    """Turn the JSON text of one call block (an object or a list of objects) into ToolCalls.

    Every problem becomes a message in `errors`; nothing raises, so the agent loop can show
    the model what was wrong with its call.
    """
    value = loads_lenient(payload)
    if value is None:
        errors.append(f"tool call is not valid JSON: {snippet(payload)!r}")
        return []
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        call = _decode_one(item, errors, known_tools, argument_keys)
        if call is not None:
            calls.append(call)
    return calls


def _decode_one(
    item: Any, errors: list[str], known_tools: frozenset[str] | None, argument_keys: tuple[str, ...]
) -> ToolCall | None:
    if not isinstance(item, dict):
        errors.append(f"tool call must be a JSON object, got {type(item).__name__}: {snippet(json.dumps(item))!r}")
        return None
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        errors.append(f"tool call has no \"name\": {snippet(json.dumps(item, ensure_ascii=False))!r}")
        return None
    name = name.strip()
    arguments = next((item[k] for k in argument_keys if k in item), {})
    if isinstance(arguments, str):
        arguments = _decode_string_arguments(name, arguments, errors, argument_keys[0])
        if arguments is None:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        errors.append(f"tool '{name}': \"{argument_keys[0]}\" must be a JSON object, got {type(arguments).__name__}")
        return None
    if known_tools is not None and name not in known_tools:
        errors.append(f"unknown tool '{name}'; available tools: {', '.join(sorted(known_tools)) or '(none)'}")
        return None
    return ToolCall(name=name, arguments=arguments)


def _decode_string_arguments(name: str, text: str, errors: list[str], key: str) -> dict | None:
    # OpenAI-style APIs send arguments as a JSON-encoded string; accept it when it holds an object.
    if not text.strip():
        return {}
    value = loads_lenient(text)
    if isinstance(value, dict):
        return value
    errors.append(f"tool '{name}': \"{key}\" is a string that does not hold a JSON object: {snippet(text)!r}")
    return None
