"""Chat formats for tool calling: one registry of tool-call parsers and tool managers by format name."""
from __future__ import annotations

from typing import Any, Callable

from rlfactory_megatron.envs.tool_manager.calls import ParsedTurn, ToolCall
from rlfactory_megatron.envs.tool_manager.hermes import HermesToolParser
from rlfactory_megatron.envs.tool_manager.llama3 import Llama3JsonToolParser
from rlfactory_megatron.envs.tool_manager.manager import ToolCallParser, ToolManager
from rlfactory_megatron.envs.tool_manager.observation import truncate_observation

# format name -> (parser class, end-of-turn markers of the assistant turn, chat-template kwargs)
TOOL_FORMATS: dict[str, tuple[Callable[..., ToolCallParser], tuple[str, ...], dict[str, Any]]] = {
    "qwen3": (HermesToolParser, ("<|im_end|>",), {}),
    "qwen2_5": (HermesToolParser, ("<|im_end|>",), {}),
    "llama3": (Llama3JsonToolParser, ("<|eot_id|>", "<|eom_id|>"), {}),
}


def _format(name: str) -> tuple[Callable[..., ToolCallParser], tuple[str, ...], dict[str, Any]]:
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format '{name}'; choose one of: {', '.join(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]


def get_tool_parser(name: str, tool_names: list[str] | None = None) -> ToolCallParser:
    """Parser for chat format `name`; with `tool_names`, calls to other tools become errors."""
    parser_cls, _, _ = _format(name)
    return parser_cls(tool_names)


def get_tool_manager(name: str, tokenizer: Any, tool_names: list[str] | None = None) -> ToolManager:
    parser_cls, end_of_turn, template_kwargs = _format(name)
    return ToolManager(parser_cls(tool_names), tokenizer, end_of_turn, dict(template_kwargs))


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
