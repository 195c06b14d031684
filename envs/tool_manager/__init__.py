"""Chat formats for tool calling: one registry of tool-call parsers and tool managers by format name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from rlfactory_megatron.envs.tool_manager.calls import ParsedTurn, ToolCall
from rlfactory_megatron.envs.tool_manager.hermes import HermesToolParser
from rlfactory_megatron.envs.tool_manager.llama3 import Llama3JsonToolParser
from rlfactory_megatron.envs.tool_manager.manager import ToolCallParser, ToolManager
from rlfactory_megatron.envs.tool_manager.observation import truncate_observation

from rlfactory_megatron.registry import Registry


@dataclass(frozen=True)
class ToolFormat:
    """A chat format's tool calling: its parser, the markers that end an assistant turn (the
    first is the one its chat template writes), the one that ends a turn calling tools when it
    differs, and extra chat-template arguments."""

    parser: Callable[..., ToolCallParser]
    end_of_turn: tuple[str, ...]
    call_turn_end: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


TOOL_FORMATS: Registry[ToolFormat] = Registry("tool format")
TOOL_FORMATS.register("qwen3", ToolFormat(HermesToolParser, ("<|im_end|>",)))
TOOL_FORMATS.register("qwen2_5", ToolFormat(HermesToolParser, ("<|im_end|>",)))
# Llama 3: <|eom_id|> ends a message that calls a tool (the conversation goes on with its result).
TOOL_FORMATS.register("llama3", ToolFormat(Llama3JsonToolParser, ("<|eot_id|>", "<|eom_id|>"), "<|eom_id|>"))


def _format(name: str) -> ToolFormat:
    try:
        return TOOL_FORMATS.get(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def get_tool_parser(name: str, tool_names: list[str] | None = None) -> ToolCallParser:
    """Parser for chat format `name`; with `tool_names`, calls to other tools become errors."""
    return _format(name).parser(tool_names)


def get_tool_manager(name: str, tokenizer: Any, tool_names: list[str] | None = None) -> ToolManager:
    fmt = _format(name)
    return ToolManager(fmt.parser(tool_names), tokenizer, fmt.end_of_turn, dict(fmt.template_kwargs),
                       fmt.call_turn_end)


__all__ = [
    "TOOL_FORMATS",
    "ParsedTurn",
    "ToolCall",
    "ToolCallParser",
    "ToolManager",
    "get_tool_manager",
    "get_tool_parser",
    "truncate_observation",
]
