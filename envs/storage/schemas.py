"""The two shard kinds of the cache (rollout records, tool artifacts): their tables and columns."""
from __future__ import annotations

import numpy as np

from .shard import Column, Shard, ShardSchema, Table

ROLLOUTS = ShardSchema(
    kind="rollouts",
    tables=(
        Table("rollouts", (
            Column("step", "int64"),
            Column("sample_id", "uint8", ragged=True),
            Column("prompt_ids", "int32", ragged=True),
            Column("response_ids", "int32", ragged=True),
            Column("loss_mask", "int8", ragged=True),
            Column("logprobs", "float32", ragged=True),
            Column("advantages", "float32", ragged=True),
            Column("reward", "float64"),
            Column("tool_traces", "uint8", ragged=True, json=True),
            Column("metadata", "uint8", ragged=True, json=True),
            # Routing replay R3: the engine's experts of each position but the last, flat, and their
            # [layers, top-k] shape ([0, 0]: none recorded).
            Column("routes", "int16", ragged=True, added_later=True),
            Column("routes_shape", "int32", width=2, added_later=True),
        )),
    ),
)


def _unevicted_artifacts(shard: Shard, table: str) -> np.ndarray:
    if table == "evictions":  # a compacted or merged shard starts with nothing evicted
        return np.empty(0, np.int64)
    evicted = np.asarray(shard.read("evictions", "row", 0, shard.rows("evictions")), dtype=np.int64)
    return np.setdiff1d(np.arange(shard.rows(table)), evicted)


ARTIFACTS = ShardSchema(
    kind="artifacts",
    tables=(
        Table("artifacts", (
            Column("key", "uint8", width=32),
            Column("tool", "uint8", ragged=True),
            Column("value", "uint8", ragged=True),
            Column("encoding", "int8"),  # 0: raw bytes, 1: UTF-8 JSON
            Column("metadata", "uint8", ragged=True, json=True),
            Column("created_at", "float64"),
            Column("expires_at", "float64"),  # inf: no TTL
        ), chunk_bytes=64 << 10),
        Table("evictions", (Column("row", "int64", refers_to="artifacts"),), chunk_bytes=64 << 10),
    ),
    live_rows=_unevicted_artifacts,
)

SCHEMAS = {schema.kind: schema for schema in (ROLLOUTS, ARTIFACTS)}
