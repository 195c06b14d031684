"""The tool interface: `BaseTool` (schema + async execute), `ToolResult`, and `BaseToolset` for servers exposing many tools."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import jsonschema


@dataclass
class ToolResult:
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)
    is_error: bool = False


class BaseTool(abc.ABC):
    """A named tool with a JSON-schema for its arguments. Subclasses set `name`, `description`
    and `parameters` and implement `execute`; callers use `run`, which validates first and turns
    any failure into an error result the model can read."""

    name: str
    description: str
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    # Whether equal arguments always give an equal result, so the tool pool may answer from the
    # artifact cache; tools with side effects or nondeterminism set it False. YAML: `cacheable:`.
    cacheable: bool = True

    @abc.abstractmethod
    async def execute(self, args: dict[str, Any]) -> ToolResult: ...

    def schema(self) -> dict[str, Any]:
        """OpenAI-style function schema, the form chat templates expect in `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def validation_error(self, args: Any) -> str | None:
        # One validator per tool: jsonschema.validate() re-checks the schema on every call.
        validator = self.__dict__.get("_validator")
        if validator is None:
            validator = self._validator = jsonschema.validators.validator_for(self.parameters)(self.parameters)
        try:
            validator.validate(args)
        except jsonschema.ValidationError as exc:
            where = "/".join(str(p) for p in exc.absolute_path) or "arguments"
            return f"invalid arguments for tool '{self.name}' at {where}: {exc.message}"
        return None

    async def run(self, args: dict[str, Any]) -> ToolResult:
        problem = self.validation_error(args)
        if problem is not None:
            return ToolResult(problem, {"error_kind": "invalid_arguments"}, is_error=True)
        try:
            return await self.execute(args)
        except Exception as exc:  # a tool bug must reach the model as an observation, not kill the rollout
            return ToolResult(f"tool '{self.name}' failed: {type(exc).__name__}: {exc}", {"error_kind": "exception"}, True)


class BaseToolset(abc.ABC):
    """Something that yields several tools once opened (e.g. an MCP server)."""

    @abc.abstractmethod
    async def open(self) -> list[BaseTool]: ...

    async def close(self) -> None:
        return None
