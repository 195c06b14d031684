"""Tool registry and YAML tool declarations: `class` (registered name or dotted path) + `params`."""
from __future__ import annotations

import importlib
import os
import sys
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
    # Folders a tool's module is also found in (absolute, so that a tool actor on any node finds it):
    # the tools file's and the working directory the run started in.
    module_dirs: tuple[str, ...] = ()


def resolve_tool_class(ref: str, module_dirs: tuple[str, ...] = ()) -> type:
    """A registered name (`calculator`) or a dotted path (`pkg.module.Class` / `pkg.module:Class`),
    its module looked for on sys.path, then in `module_dirs`."""
    _import_builtins()
    if ref in TOOL_REGISTRY:
        return TOOL_REGISTRY.get(ref)
    module_name, sep, attr = ref.replace(":", ".").rpartition(".")
    if not sep:
        raise ValueError(f"unknown tool class '{ref}'; use a registered name ({', '.join(sorted(TOOL_REGISTRY))}) or a dotted path")
    for folder in module_dirs:
        if folder not in sys.path:
            sys.path.append(folder)  # after the installed packages: a tool module never shadows one
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        where = f" (looked for on sys.path and in {', '.join(module_dirs)})" if module_dirs else ""
        raise ValueError(f"tool class '{ref}' cannot be imported: {exc}{where}") from exc


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
    """A tools file's declarations; a tool module beside the file or in the working directory is found."""
    with open(path) as f:
        specs = parse_tool_specs(yaml.safe_load(f))
    folders = tuple(dict.fromkeys((str(Path(path).resolve().parent), os.getcwd())))
    for spec in specs:
        spec.module_dirs = folders
    return specs


def check_tool_specs(specs: list[ToolSpec]) -> None:
    """Every declared tool class exists and takes its params (nothing is built): a typo fails at
    load, not after the model and the engines have started."""
    import inspect

    for i, spec in enumerate(specs):
        try:
            cls = resolve_tool_class(spec.cls, spec.module_dirs)
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
