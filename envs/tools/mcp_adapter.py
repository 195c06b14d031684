"""MCP adapter: the tools of a stdio MCP server, exposed as `BaseTool`s over one long-lived session."""
from __future__ import annotations

import asyncio
from typing import Any

from rlfactory_megatron.envs.tools.base import BaseTool, BaseToolset, ToolResult
from rlfactory_megatron.envs.tools.registry import register_tool


class MCPTool(BaseTool):
    cacheable = False  # a remote tool may have side effects; opt in per server with `cacheable: true`

    def __init__(self, toolset: "MCPToolset", remote_name: str, name: str, description: str, parameters: dict[str, Any]):
        self.toolset, self.remote_name = toolset, remote_name
        self.name, self.description = name, description
        self.parameters = parameters or {"type": "object", "properties": {}}

    async def execute(self, args: dict[str, Any]) -> ToolResult:
        result = await self.toolset.call(self.remote_name, args)
        texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
        others = [block.type for block in result.content if getattr(block, "type", None) != "text"]
        metadata: dict[str, Any] = {"server": self.toolset.command}
        if result.structured_content is not None:
            metadata["structured"] = result.structured_content
        if others:
            metadata["dropped_content_types"] = others
        return ToolResult("\n".join(texts), metadata, is_error=bool(result.is_error))


@register_tool("mcp")
class MCPToolset(BaseToolset):
    """Starts `command args...` as an MCP server over stdio and lists its tools.

    The mcp client's context managers must be entered and left in one task, so a holder task
    owns the session for the toolset's lifetime and calls go through it.
    """

    def __init__(
        self,
        command: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        name_prefix: str = "",
        call_timeout_s: float = 60.0,
    ):
        self.command, self.args, self.env, self.cwd = command, list(args or []), env, cwd
        self.name_prefix, self.call_timeout_s = name_prefix, call_timeout_s
        self._client: Any = None
        self._holder: asyncio.Task | None = None
        self._closing = asyncio.Event()

    async def open(self) -> list[BaseTool]:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._holder = asyncio.create_task(self._hold_session(ready))
        await ready
        listing = await self._client.list_tools()
        return [
            MCPTool(self, t.name, self.name_prefix + t.name, t.description or "", dict(t.input_schema or {}))
            for t in listing.tools
        ]

    async def _hold_session(self, ready: asyncio.Future) -> None:
        from mcp import Client, StdioServerParameters

        params = StdioServerParameters(command=self.command, args=self.args, env=self.env, cwd=self.cwd)
        try:
            async with Client(params, read_timeout_seconds=self.call_timeout_s) as client:
                self._client = client
                ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(RuntimeError(f"MCP server '{self.command} {' '.join(self.args)}' failed to start: {exc!r}"))
            else:
                raise

    async def call(self, name: str, args: dict[str, Any]) -> Any:
        return await self._client.call_tool(name, args)

    async def close(self) -> None:
        if self._holder is not None:
            self._closing.set()
            await self._holder
            self._holder = None
