"""Merge many shards of one kind into a single shard file, serially, shard after shard (live rows only)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from .schemas import SCHEMAS
from .shard import Shard, ShardError, copy_rows, create_shard, open_reader


def merge_shards(paths: Sequence[Path], out: Path) -> dict[str, int]:
    """Write `out` holding every live row of `paths`; returns rows written per table."""
    if not paths:
        raise ShardError(f"{out}: nothing to merge (no shard files given)")
    sources = [open_reader(path, SCHEMAS) for path in paths]
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    try:
        kinds = {source.schema.kind for source in sources}
        if len(kinds) != 1:
            raise ShardError(f"{out}: cannot merge shards of different kinds {sorted(kinds)}")
        schema = sources[0].schema
        keep = schema.live_rows or _all_rows
        target = create_shard(tmp, schema)
        try:
            for source in sources:
                for table in schema.tables:
                    copy_rows(source, target, table.name, keep(source, table.name))
            target.flush_to_disk()
            written = {table.name: target.rows(table.name) for table in schema.tables}
        finally:
            target.close()
    finally:
        for source in sources:
            source.close()
    os.replace(tmp, out)
    return written


def _all_rows(shard: Shard, table: str) -> np.ndarray:
    return np.arange(shard.rows(table))
