"""A set of built tools by name: built from specs, run by name, closed together."""
from __future__ import annotations

import asyncio
from typing import Any

from rlfactory_megatron.envs.tools.base import BaseTool, BaseToolset, ToolResult
from rlfactory_megatron.envs.tools.registry import ToolSpec, resolve_tool_class


class ToolBox:
    def __init__(self, tools: dict[str, BaseTool], toolsets: list[BaseToolset]):
        self.tools = tools
        self._toolsets = toolsets

    @classmethod
    async def build(cls, specs: list[ToolSpec]) -> "ToolBox":
        tools: dict[str, BaseTool] = {}
        toolsets: list[BaseToolset] = []
        for i, spec in enumerate(specs):
            try:
                obj = resolve_tool_class(spec.cls, spec.module_dirs)(**spec.params)
            except TypeError as exc:
                raise ValueError(f"tools[{i}] ({spec.cls}): bad params {sorted(spec.params)}: {exc}") from exc
            if isinstance(obj, BaseToolset):
                toolsets.append(obj)
                built = await obj.open()
            else:
                built = [obj]
            for tool in built:
                if tool.name in tools:
                    raise ValueError(f"tools[{i}] ({spec.cls}): tool name '{tool.name}' is declared twice")
                if spec.cacheable is not None:
                    tool.cacheable = spec.cacheable
                if spec.description is not None:
                    tool.description = spec.description
                tools[tool.name] = tool
        return cls(tools, toolsets)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    def cacheable_tools(self) -> list[str]:
        return [name for name, tool in self.tools.items() if tool.cacheable]

    async def run(self, name: str, args: dict[str, Any]) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(
                f"unknown tool '{name}'; available tools: {', '.join(sorted(self.tools))}", {"error_kind": "unknown_tool"}, True
            )
        return await tool.run(args)

    async def close(self) -> None:
        for toolset in self._toolsets:
            await toolset.close()


def tool_schemas(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """The schemas a tool pool built from `specs` shows the model, from the tools built here
    (no Ray) and closed again: what load-time checks render prompts with."""

    async def built() -> list[dict[str, Any]]:
        box = await ToolBox.build(specs)
        try:
            return box.schemas()
        finally:
            await box.close()

    return asyncio.run(built())
