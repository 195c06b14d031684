"""Tools the agent can call: the `BaseTool` interface, the registry of built-ins and YAML tool declarations."""
from rlfactory_megatron.envs.tools.base import BaseTool, BaseToolset, ToolResult
from rlfactory_megatron.envs.tools.registry import (
    TOOL_REGISTRY,
    ToolSpec,
    load_tool_specs,
    parse_tool_specs,
    register_tool,
    resolve_tool_class,
)
from rlfactory_megatron.envs.tools.toolbox import ToolBox

__all__ = [
    "TOOL_REGISTRY",
    "BaseTool",
    "BaseToolset",
    "ToolBox",
    "ToolResult",
    "ToolSpec",
    "load_tool_specs",
    "parse_tool_specs",
    "register_tool",
    "resolve_tool_class",
]
