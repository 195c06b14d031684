"""`sleep`: a tool with a fixed latency, for benchmarks and pool tests."""
from __future__ import annotations

import asyncio
from typing import Any

from rlfactory_megatron.envs.tools.base import BaseTool, ToolResult
from rlfactory_megatron.envs.tools.registry import register_tool


@register_tool("sleep")
class SleepTool(BaseTool):
    name = "sleep"
    description = "Wait a fixed time, then echo the text it was given."
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

    def __init__(self, latency_s: float = 0.05):
        self.latency_s = latency_s

    async def execute(self, args: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(self.latency_s)
        return ToolResult(args.get("text", ""))
