"""Tool registry and YAML tool declarations: `class` (registered name or dotted path) + `params`."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from rlfactory_megatron.registry import Registry

TOOL_REGISTRY: Registry[type] = Registry("tool")


def register_tool(name: str) -> Callable[[type], type]:
    return TOOL_REGISTRY.register(name)


@dataclass
class ToolSpec:
    cls: str
    params: dict[str, Any] = field(default_factory=dict)
    cacheable: bool | None = None  # None: the tool class's own default
    description: str | None = None  # None: the tool class's own; else what the model is shown


def resolve_tool_class(ref: str) -> type:
    """A registered name (`calculator`) or a dotted path (`pkg.module.Class` / `pkg.module:Class`)."""
    _import_builtins()
    if ref in TOOL_REGISTRY:
        return TOOL_REGISTRY.get(ref)
    module_name, sep, attr = ref.replace(":", ".").rpartition(".")
    if not sep:
        raise ValueError(f"unknown tool class '{ref}'; use a registered name ({', '.join(sorted(TOOL_REGISTRY))}) or a dotted path")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tool class '{ref}' cannot be imported: {exc}") from exc


def parse_tool_specs(config: Any) -> list[ToolSpec]:
    """Accept `{"tools": [...]}` or a bare list; each entry `{class: ..., params: {...}, cacheable: bool,
    description: str}` (`cacheable` optional: overrides whether the tool pool may answer the tool from
    the artifact cache; `description` optional: replaces the description in the tool's schema)."""
    entries = config.get("tools") if isinstance(config, dict) else config
    if not isinstance(entries, list):
        raise ValueError("tool config must be a list under 'tools:', each entry with 'class' and optional 'params'")
    specs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class"), str):
            raise ValueError(f"tools[{i}]: needs a 'class' (registered tool name or dotted class path), got {entry!r}")
        params = entry.get("params") or {}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].params must be a mapping, got {type(params).__name__}")
        unknown = set(entry) - {"class", "params", "cacheable", "description"}
        if unknown:
            raise ValueError(f"tools[{i}]: unknown keys {sorted(unknown)}; valid: class, params, cacheable, description")
        description = entry.get("description")
        if description is not None and not isinstance(description, str):
            raise ValueError(f"tools[{i}].description must be a string, got {description!r}")
        cacheable = entry.get("cacheable")
        if cacheable is not None and not isinstance(cacheable, bool):
            raise ValueError(f"tools[{i}].cacheable must be true or false, got {cacheable!r}")
        specs.append(ToolSpec(entry["class"], dict(params), cacheable, description))
    return specs


def load_tool_specs(path: str | Path) -> list[ToolSpec]:
    with open(path) as f:
        return parse_tool_specs(yaml.safe_load(f))


def check_tool_specs(specs: list[ToolSpec]) -> None:
    """Every declared tool class exists and takes its params (nothing is built): a typo fails at
    load, not after the model and the engines have started."""
    import inspect

    for i, spec in enumerate(specs):
        try:
            cls = resolve_tool_class(spec.cls)
        except ValueError as exc:
            raise ValueError(f"tools[{i}]: {exc}") from None
        try:
            inspect.signature(cls).bind(**spec.params)
        except TypeError as exc:
            raise ValueError(f"tools[{i}] ({spec.cls}).params: {exc}; {cls.__name__} takes "
                             f"{inspect.signature(cls)}") from None


def _import_builtins() -> None:
    # Importing the built-in modules runs their @register_tool decorators.
    from rlfactory_megatron.envs.tools import calculator, diagnostic, mcp_adapter, python_sandbox, search  # noqa: F401
