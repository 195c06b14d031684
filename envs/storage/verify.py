"""Deep check of shard files: everything a reader relies on (schema, row counts, offsets, JSON, row references)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

from .schemas import SCHEMAS
from .shard import OFFSETS, Column, Shard, ShardError, ShardSchema, list_shards, open_reader

_ROWS_PER_READ = 65536


def verify_shard(path: Path, schemas: Mapping[str, ShardSchema] = SCHEMAS) -> list[str]:
    """Problems found in one shard, each naming the file; empty when the shard is sound.

    A tail written after the last commit point is not a problem: the next writer cuts it.
    """
    try:
        shard = open_reader(path, schemas)
    except ShardError as exc:
        return [str(exc)]
    try:
        return [f"{path}: {problem}" for table in shard.schema.tables for column in table.columns
                if shard.holds(table.name, column.name) for problem in _column_problems(shard, table.name, column)]
    finally:
        shard.close()


def verify_directory(directory: Path) -> dict[Path, list[str]]:
    return {path: verify_shard(path) for path in list_shards(directory)}


def _column_problems(shard: Shard, table: str, column: Column) -> list[str]:
    rows, where = shard.rows(table), f"/{table}/{column.name}"
    if column.ragged:
        ends = shard.dataset(table, column.name + OFFSETS)[:rows]
        if len(ends) and (ends[0] < 0 or np.any(np.diff(ends) < 0)):
            return [f"{where}: offsets decrease"]
        if len(ends) and ends[-1] > shard.dataset(table, column.name).shape[0]:
            return [f"{where}: offsets point past the data ({ends[-1]} > {shard.dataset(table, column.name).shape[0]})"]
    problems = []
    for start in range(0, rows, _ROWS_PER_READ):
        values = shard.read(table, column.name, start, start + _ROWS_PER_READ)
        if column.json:
            for row, cell in enumerate(values, start):
                try:
                    json.loads(cell.tobytes())
                except ValueError as exc:
                    problems.append(f"{where} row {row}: not JSON ({exc})")
        if column.refers_to is not None and len(values):
            limit = shard.rows(column.refers_to)
            if values.min() < 0 or values.max() >= limit:
                problems.append(f"{where}: row numbers outside /{column.refers_to} (which has {limit} rows)")
    return problems
