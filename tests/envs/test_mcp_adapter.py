"""The MCP adapter against a tiny stdio MCP server (mcp_echo_server.py in this folder)."""
import asyncio
import sys
from pathlib import Path

from rlfactory_megatron.envs.tools import ToolBox, parse_tool_specs

SERVER = str(Path(__file__).with_name("mcp_echo_server.py"))


def test_mcp_server_tools_behave_like_local_tools():
    async def go():
        specs = parse_tool_specs([
            {"class": "mcp", "params": {"command": sys.executable, "args": [SERVER], "name_prefix": "m_"}},
            {"class": "calculator"},
        ])
        box = await ToolBox.build(specs)
        try:
            schemas = {s["function"]["name"]: s["function"] for s in box.schemas()}
            results = await asyncio.gather(
                box.run("m_add", {"a": 2, "b": 40}),
                box.run("m_shout", {"text": "grüße"}),
                box.run("m_add", {"a": "two", "b": 40}),
                box.run("m_fail", {"reason": "disk on fire"}),
                *(box.run("m_add", {"a": i, "b": 1}) for i in range(8)),
            )
        finally:
            await box.close()
        return schemas, results

    schemas, results = asyncio.run(go())
    assert set(schemas) == {"m_add", "m_shout", "m_fail", "calculator"}
    assert schemas["m_add"]["description"] == "Add two integers."
    assert schemas["m_add"]["parameters"]["required"] == ["a", "b"]
    added, shouted, invalid, failed, *many = results
    assert (added.text, added.is_error) == ("42", False)
    assert shouted.text == "GRÜSSE"
    assert invalid.is_error and invalid.metadata["error_kind"] == "invalid_arguments"
    assert failed.is_error and "disk on fire" in failed.text
    assert [r.text for r in many] == [str(i + 1) for i in range(8)]


def test_mcp_server_that_cannot_start_is_reported():
    async def go():
        await ToolBox.build(parse_tool_specs([{"class": "mcp", "params": {"command": "/nonexistent/mcp-server"}}]))

    try:
        asyncio.run(go())
    except RuntimeError as exc:
        assert "failed to start" in str(exc)
    else:
        raise AssertionError("a missing MCP server must fail at build time")
