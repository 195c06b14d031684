"""Misbehaving and instrumented tools for the tool-pool tests. Ray workers import this module by
name, so the session Ray fixture puts this folder on their PYTHONPATH."""
import asyncio
import os
import time

from rlfactory_megatron.envs.tools import BaseTool, ToolResult


class RaisingTool(BaseTool):
    name = "raises"
    description = "always raises"

    async def execute(self, args):
        raise RuntimeError("boom")


class HangingTool(BaseTool):
    name = "hangs"
    description = "never returns"

    async def execute(self, args):
        await asyncio.sleep(3600)


class BlockingTool(BaseTool):
    name = "blocks"
    description = "blocks its actor's event loop (a tool written wrongly, with sync sleep)"

    async def execute(self, args):
        time.sleep(4)
        return ToolResult("woke")


class HugeOutputTool(BaseTool):
    name = "huge"
    description = "returns 1 MB of text"

    async def execute(self, args):
        return ToolResult("x" * (1 << 20))


class SlowTool(BaseTool):
    name = "slow"
    description = "sleeps the given seconds and reports when it ran"
    parameters = {"type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}

    async def execute(self, args):
        start = time.time()
        await asyncio.sleep(args["seconds"])
        return ToolResult("done", {"start": start, "end": time.time(), "pid": os.getpid()})


class CrashingTool(BaseTool):
    name = "crashes"
    description = "kills its own worker process"

    async def execute(self, args):
        os._exit(1)


class CountingTool(BaseTool):
    name = "counts"
    description = "echoes its argument with how many times this instance has executed"
    parameters = {
        "type": "object", "properties": {"x": {"type": "string"}, "fail": {"type": "boolean"}}, "required": ["x"],
    }

    def __init__(self, name: str = "counts"):
        self.name, self.executions = name, 0

    async def execute(self, args):
        self.executions += 1
        return ToolResult(f"{args['x']}#{self.executions}", {"execution": self.executions}, args.get("fail", False))
