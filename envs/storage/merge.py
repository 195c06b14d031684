"""Merge many shards of one kind into a single shard file (live rows only), in source order.

The sizes of every source's live rows are known before anything is written, so each source has a fixed
place in the output. With more than one MPI process and h5py built with MPI (parallel HDF5), every rank
copies its share of the sources into its places at once, through MPI-IO; otherwise one process copies them
all, into the same places.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import h5py
import numpy as np

from .schemas import SCHEMAS
from .shard import COPY_ROWS, Shard, ShardError, ShardSchema, create_shard, open_reader


@dataclass(frozen=True)
class _Share:
    """One source's live rows of one table: how many, and how many values each ragged column holds."""

    rows: int
    values: dict[str, int]


def merge_shards(paths: Sequence[Path], out: Path, comm=None) -> dict[str, int]:
    """Write `out` holding every live row of `paths`; returns rows written per table.

    `comm`: an mpi4py communicator whose ranks all call this with the same arguments (None: this process
    alone). Its ranks copy in parallel when h5py is built with MPI; else rank 0 copies and the others wait
    for its outcome (its error is raised on every rank, so none is left waiting).
    """
    if not paths:
        raise ShardError(f"{out}: nothing to merge (no shard files given)")
    if comm is None or comm.Get_size() == 1:
        return _merge(paths, out, None)
    if h5py.get_config().mpi:
        written = _merge(paths, out, comm)
        comm.Barrier()  # no rank returns before rank 0 put the file in place
        return written
    outcome: dict[str, int] | Exception | None = None
    if comm.Get_rank() == 0:
        try:
            outcome = _merge(paths, out, None)
        except Exception as exc:
            outcome = exc
    outcome = comm.bcast(outcome, root=0)
    if isinstance(outcome, Exception):
        raise outcome
    return outcome


def _merge(paths: Sequence[Path], out: Path, comm) -> dict[str, int]:
    """The merge by this process alone (comm None), or by every rank of `comm` through MPI-IO."""
    rank, world = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    sources = [open_reader(path, SCHEMAS) for path in paths]
    try:
        kinds = {source.schema.kind for source in sources}
        if len(kinds) != 1:
            raise ShardError(f"{out}: cannot merge shards of different kinds {sorted(kinds)}")
        schema = sources[0].schema
        mine = range(rank, len(sources), world)
        keep = {(i, table.name): _live_rows(schema, sources[i], table.name) for i in mine for table in schema.tables}
        shares = {key: _share(sources[key[0]], key[1], rows) for key, rows in keep.items()}
        if comm is not None:  # every rank sized its own sources: gather the whole plan
            shares = {key: share for part in comm.allgather(shares) for key, share in part.items()}
        _copy(sources, schema, tmp, keep, shares, comm)
    finally:
        for source in sources:
            source.close()
    if rank == 0:
        os.replace(tmp, out)
    return {table.name: sum(shares[i, table.name].rows for i in range(len(sources))) for table in schema.tables}


def _copy(sources: list[Shard], schema: ShardSchema, tmp: Path, keep: dict, shares: dict, comm) -> None:
    """Create `tmp` at its final size and copy this process's sources into their places."""
    target = create_shard(tmp, schema, comm)
    try:
        for table in schema.tables:
            first, starts = 0, {column.name: 0 for column in table.columns if column.ragged}
            places = {}
            for i in range(len(sources)):
                places[i] = (first, dict(starts))
                share = shares[i, table.name]
                first += share.rows
                starts = {name: start + share.values[name] for name, start in starts.items()}
            target.reserve(table.name, first, starts)  # collective under MPI-IO: every rank, same sizes
            for i in sorted(i for i, name in keep if name == table.name):
                row, values = places[i]
                rows = keep[i, table.name]
                for begin in range(0, len(rows), COPY_ROWS):
                    block = rows[begin : begin + COPY_ROWS]
                    values = target.write_at(table.name, row, values, sources[i].read_rows(table.name, block))
                    row += len(block)
        if comm is not None:
            comm.Barrier()  # every rank's data is written before any counter says it is there
        for table in schema.tables:
            target.commit(table.name, sum(shares[i, table.name].rows for i in range(len(sources))))
        if comm is None:
            target.flush_to_disk()
    finally:
        target.close()


def _live_rows(schema: ShardSchema, source: Shard, table: str) -> np.ndarray:
    if schema.live_rows is None:
        return np.arange(source.rows(table))
    return np.asarray(schema.live_rows(source, table), dtype=np.int64)


def _share(source: Shard, table: str, rows: np.ndarray) -> _Share:
    values = {}
    for column in source.schema.table(table).columns:
        if column.ragged:
            lengths = np.diff(source.ends(table, column.name), prepend=0)
            values[column.name] = int(lengths[rows].sum())
    return _Share(len(rows), values)
