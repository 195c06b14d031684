"""One shard file: append-only columnar tables in HDF5 (flat arrays + int64 end offsets, no variable-length
types), written in flushed batches under SWMR so other processes read it live, and recovered to its last
committed batch when the writer died mid-write."""
from __future__ import annotations

import ctypes
import functools
import operator
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import h5py
import numpy as np

SCHEMA_VERSION = 1
ROWS = "_rows"  # per table: committed row count, written only after the batch's data is flushed
OFFSETS = ".offsets"  # suffix of a ragged column's end-offset dataset
COPY_ROWS = 4096
_READER_CACHE = dict(rdcc_nbytes=8 << 20, rdcc_nslots=10007)  # lookups revisit the same chunks
# Appenders cache no chunks: each is written once, and caching it costs an extra copy (measured ~1.7x slower).
_WRITER_CACHE = dict(rdcc_nbytes=0)
WRITE_BEHIND_BYTES = 1 << 20


class WriteBehind:
    """Start the kernel writing a file's dirty pages back, without waiting, each time the file grew by
    `every` bytes (Linux sync_file_range, as RocksDB's bytes_per_sync). Disk writes then overlap the
    writer's own work: a later fsync finds little left to do, and dirty pages do not pile up until the
    kernel flushes them all at once. The call runs on a helper thread because submitting the writeback
    costs CPU (~0.6 ms per MB-scale batch here) that the writer would otherwise pay; it touches only the
    file descriptor, never HDF5. Where sync_file_range is missing or refused, nothing happens."""

    _WRITE = 2  # SYNC_FILE_RANGE_WRITE: start writeback of dirty pages, do not wait for it

    def __init__(self, fd: int, every: int = WRITE_BEHIND_BYTES):
        self._fd, self._every, self._started_at = fd, every, os.fstat(fd).st_size
        self._call = _sync_file_range()
        self._wake = threading.Condition()
        self._pending = self._closed = False
        self._thread: threading.Thread | None = None

    def wrote(self) -> None:
        """Call after data was handed to the OS (written and flushed)."""
        if self._call is None:
            return
        size = os.fstat(self._fd).st_size
        if size - self._started_at < self._every:
            return
        self._started_at = size
        with self._wake:
            if self._closed:
                return
            self._pending = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rlf-write-behind", daemon=True)
                self._thread.start()
            self._wake.notify()

    def close(self) -> None:
        """Wait for a writeback call in flight; call before the descriptor is closed."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                self._pending = False
            if self._call(self._fd, 0, 0, self._WRITE) != 0:  # 0, 0: the whole file
                self._call = None  # e.g. a file system without it: plain page-cache writes, as before
                return


@functools.cache
def _sync_file_range():
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range  # glibc/musl on Linux only
    except (AttributeError, OSError):
        return None
    call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return call


class ShardError(RuntimeError):
    """A shard is corrupt, of another schema, or cannot be opened; the message names the file."""


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str
    ragged: bool = False  # per-row 1-D cells of varying length: stored flat, plus int64 end offsets
    width: int = 0  # fixed columns: 0 = one scalar per row, else a vector of `width` elements
    json: bool = False  # ragged uint8 holding UTF-8 JSON (verify decodes it)
    refers_to: str | None = None  # values are row numbers of that table (verify checks the range)
    # Added after shards were written without it: such a shard reads it as empty cells (ragged) or
    # zeros, and is rewritten with it when opened for appending.
    added_later: bool = False


@dataclass(frozen=True)
class Ragged:
    """A batch's cells of one ragged column, already back to back: cell i is the next lengths[i] values.
    Saves the per-cell arrays when a caller has the data flat (e.g. encoded JSON)."""

    values: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    chunk_bytes: int = 1 << 20


@dataclass(frozen=True)
class ShardSchema:
    kind: str
    tables: tuple[Table, ...]
    # Rows worth keeping when the shard is compacted or merged; None keeps every committed row.
    live_rows: Callable[["Shard", str], np.ndarray] | None = None

    def table(self, name: str) -> Table:
        return next(t for t in self.tables if t.name == name)


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.h5"


def list_shards(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("shard-*-of-*.h5"))


class Shard:
    """An open shard: the writer's SWMR handle or a live reader's. Reads see committed rows only."""

    def __init__(self, path: Path, schema: ShardSchema, file: h5py.File, writable: bool):
        self.path, self.schema, self.writable = Path(path), schema, writable
        self._file = file
        self._inode = os.stat(self.path).st_ino
        self._columns = {(t.name, c.name): c for t in schema.tables for c in t.columns}
        self._ds = {(t.name, name): file[t.name][name] for t in schema.tables for name in file[t.name]}
        self._ends: dict[tuple[str, str], list[np.ndarray]] = {}  # end offsets in pieces, loaded on first use
        # Writer: each ragged column's end offset at the committed row count, so an append need not read
        # it back from the file (an h5py read per column and batch).
        self._tails: dict[tuple[str, str], int] = {}
        self._rows = {t.name: int(self._ds[t.name, ROWS][()]) for t in schema.tables}
        # Only a POSIX file has a descriptor to write back (under MPI-IO, the handle is MPI's).
        self._write_behind = WriteBehind(file.id.get_vfd_handle()) if writable and file.driver == "sec2" else None
        if not writable:
            self.refresh()  # opening checked the datasets: their cached headers may predate the counters

    def rows(self, table: str) -> int:
        return self._rows[table]

    def replaced(self) -> bool:
        """True when the path now names another file (the owner compacted it)."""
        try:
            return os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            return True

    def refresh(self) -> None:
        """Reader: see the batches the writer committed since the last refresh."""
        for t in self.schema.tables:
            counter = self._ds[t.name, ROWS]
            counter.refresh()
            self._rows[t.name] = int(counter[()])
        # The writer flushes data before counters, so datasets refreshed after them hold every counted row.
        for data in self._ds.values():
            data.refresh()

    def append(self, table: str, batch: Mapping[str, Sequence]) -> range:
        """Write one batch of rows (column name -> per-row values, or Ragged) and commit it."""
        spec = self.schema.table(table)
        counts = {len(batch[c.name]) for c in spec.columns}
        if len(counts) != 1:
            raise ValueError(f"{self.path}: batch for table {table!r} has columns of different lengths {counts}")
        count, first = counts.pop(), self._rows[table]
        tails: dict[tuple[str, str], int] = {}
        try:
            for column in spec.columns:
                tail = self._append_column(table, column, first, batch[column.name], count)
                if tail is not None:
                    tails[table, column.name] = tail
        except BaseException:
            # Nothing is committed, but cached offsets may now run past the committed rows: reload when needed.
            for column in spec.columns:
                self._ends.pop((table, column.name), None)
            raise
        self.commit(table, first + count)
        self._tails.update(tails)
        if self._write_behind is not None:
            self._write_behind.wrote()
        return range(first, first + count)

    def commit(self, table: str, rows: int) -> None:
        """Make the first `rows` rows of `table` visible: data flushed first, then the counter (under
        MPI-IO every rank calls this, with the same value: flushing is collective there)."""
        self._file.flush()
        self._ds[table, ROWS].id.write(h5py.h5s.ALL, h5py.h5s.ALL, np.array(rows, dtype=np.int64))
        self._file.flush()  # the commit point: a crash before it leaves an uncommitted tail, cut on reopen
        self._rows[table] = rows

    def reserve(self, table: str, rows: int, values: Mapping[str, int]) -> None:
        """Size `table` for `rows` rows and each ragged column for `values[column]` values, to be filled
        with write_at and made visible with commit (a merge knows every size up front; under MPI-IO every
        rank makes this same call, as resizing is collective there)."""
        for column in self.schema.table(table).columns:
            self._tails.pop((table, column.name), None)
            self._ends.pop((table, column.name), None)
            data = self._ds[table, column.name]
            if column.ragged:
                data.id.set_extent((values[column.name],))
                self._ds[table, column.name + OFFSETS].id.set_extent((rows,))
            else:
                data.id.set_extent((rows, *data.shape[1:]))

    def write_at(self, table: str, first: int, starts: Mapping[str, int],
                 batch: Mapping[str, Sequence]) -> dict[str, int]:
        """Write a batch into reserved space, not committed: its rows from row `first` on, each ragged
        column's values from `starts[column]` on. Returns where each ragged column's next values start."""
        nexts = {}
        for column in self.schema.table(table).columns:
            values, count = batch[column.name], len(batch[column.name])
            if not column.ragged:
                _write(self._ds[table, column.name], first, _fixed_rows(column, values, count))
                continue
            flat, lengths = self._cells(table, column, values, count)
            ends = starts[column.name] + np.cumsum(lengths, dtype=np.int64)
            _write(self._ds[table, column.name], starts[column.name], flat)
            _write(self._ds[table, column.name + OFFSETS], first, ends)
            nexts[column.name] = int(ends[-1]) if count else starts[column.name]
        return nexts

    def read(self, table: str, column: str, start: int, stop: int) -> np.ndarray | list[np.ndarray]:
        """Rows [start, stop) of a column: an array for fixed columns, a list of arrays for ragged ones."""
        stop = min(stop, self._rows[table])
        spec = self._columns[table, column]
        if not self.holds(table, column):  # an added_later column this shard predates
            count = max(stop - start, 0)
            if spec.ragged:
                return [np.empty(0, spec.dtype) for _ in range(count)]
            return np.zeros((count, spec.width) if spec.width else (count,), spec.dtype)
        if not spec.ragged:
            return self._ds[table, column][start:stop]
        ends = self.ends(table, column)[start:stop]
        if not len(ends):
            return []
        begin = int(self.ends(table, column)[start - 1]) if start > 0 else 0
        flat = self._ds[table, column][begin : int(ends[-1])]
        return np.split(flat, ends[:-1] - begin)

    def read_rows(self, table: str, rows: np.ndarray) -> dict[str, list]:
        """Selected rows of every column, read as one span per column."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return {c.name: [] for c in self.schema.table(table).columns}
        lo, hi = int(rows.min()), int(rows.max()) + 1
        picked = {}
        for column in self.schema.table(table).columns:
            span = self.read(table, column.name, lo, hi)
            picked[column.name] = [span[i - lo] for i in rows]
        return picked

    def cell(self, table: str, column: str, row: int) -> np.ndarray:
        """One row of one column: the cheapest read, for lookups."""
        if not self._columns[table, column].ragged:
            return self._ds[table, column][row]
        ends = self.ends(table, column)
        return self._ds[table, column][int(ends[row - 1]) if row > 0 else 0 : int(ends[row])]

    def ends(self, table: str, column: str) -> np.ndarray:
        """End offsets of a ragged column for every committed row (kept in memory, extended as rows arrive)."""
        if not self.holds(table, column):  # an added_later column this shard predates: empty cells
            return np.zeros(self._rows[table], np.int64)
        parts = self._ends.setdefault((table, column), [])
        have = sum(len(p) for p in parts)
        if have < self._rows[table]:
            parts.append(self._ds[table, column + OFFSETS][have : self._rows[table]])
        if len(parts) != 1:  # appends only add pieces; join them when someone reads
            parts[:] = [np.concatenate(parts) if parts else np.empty(0, np.int64)]
        return parts[0]

    def holds(self, table: str, column: str) -> bool:
        """Whether the file has the column (not so for an added_later one it predates)."""
        return (table, column) in self._ds

    def dataset(self, table: str, name: str) -> h5py.Dataset:
        return self._ds[table, name]

    def flush_to_disk(self) -> None:
        self._file.flush()
        os.fsync(self._file.id.get_vfd_handle())

    def close(self) -> None:
        if self._write_behind is not None:
            self._write_behind.close()
        if self._file.id.valid:
            self._file.close()

    def _append_column(self, table: str, column: Column, first: int, values: Sequence, count: int) -> int | None:
        """Write one column of a batch (not yet committed); a ragged column returns its new end offset."""
        data = self._ds[table, column.name]
        if not column.ragged:
            _extend(data, first, _fixed_rows(column, values, count))
            return None
        flat, lengths = self._cells(table, column, values, count)
        offsets = self._ds[table, column.name + OFFSETS]
        start = self._tails.get((table, column.name))
        if start is None:
            start = int(offsets[first - 1]) if first > 0 else 0
        ends = start + np.cumsum(lengths, dtype=np.int64)
        _extend(data, start, flat)
        _extend(offsets, first, ends)
        if (table, column.name) in self._ends:
            self._ends[table, column.name].append(ends)
        return int(ends[-1]) if count else start

    def _cells(self, table: str, column: Column, values: Sequence, count: int) -> tuple[np.ndarray, np.ndarray]:
        """A batch's cells of a ragged column as (values back to back, length of each cell)."""
        if isinstance(values, Ragged):
            flat, lengths = values.values.astype(column.dtype, casting="same_kind", copy=False), values.lengths
            if int(np.sum(lengths)) != len(flat):
                raise ValueError(f"{self.path}: /{table}/{column.name}: cell lengths do not add up to the values")
            return flat, lengths
        lengths = np.fromiter(map(len, values), np.int64, count)
        return _concatenate_cells(values, np.dtype(column.dtype), int(lengths.sum())), lengths


def create_shard(path: Path, schema: ShardSchema, comm=None) -> Shard:
    """A new, empty shard opened for writing (not yet in SWMR mode: objects can still be added). With an
    MPI communicator (h5py built with MPI only), every rank of it opens the same file through MPI-IO."""
    parallel = dict(driver="mpio", comm=comm) if comm is not None else {}
    file = h5py.File(path, "w", libver="latest", **parallel, **_WRITER_CACHE)
    file.attrs["schema_version"] = SCHEMA_VERSION
    file.attrs["kind"] = schema.kind
    for table in schema.tables:
        group = file.create_group(table.name)
        group.create_dataset(ROWS, shape=(), dtype="int64", data=0)
        for column in table.columns:
            _create_column(group, table, column)
    return Shard(path, schema, file, writable=True)


def open_writer(path: Path, schema: ShardSchema) -> Shard:
    """This rank's shard for appending (SWMR): created if new, recovered if its last writer died."""
    path = Path(path)
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        create_shard(tmp, schema).close()
        os.replace(tmp, path)  # a crash during creation leaves no half-made shard under the real name
    try:
        file = _open_swmr_writer(path)
    except OSError as exc:
        if "h5clear" not in str(exc):
            raise ShardError(f"{path}: cannot open for writing ({exc})") from exc
        # The consistency flags are still set: a writer died without closing. Keep its committed rows.
        rewrite(path, schema, keep=lambda shard, table: np.arange(shard.rows(table)))
        file = _open_swmr_writer(path)
    try:
        _check(file, path, schema)
        if _predated_columns(file, schema):  # datasets cannot be added in SWMR mode: a copy with them
            file.close()
            rewrite(path, schema, keep=lambda shard, table: np.arange(shard.rows(table)))
            file = _open_swmr_writer(path)
        _truncate_uncommitted(file, schema)
        return Shard(path, schema, file, writable=True)
    except BaseException:
        file.close()
        raise


def open_reader(path: Path, schemas: Mapping[str, ShardSchema]) -> Shard:
    """A live (SWMR) read-only view of a shard whose kind is one of `schemas`."""
    path = Path(path)
    try:
        # No file lock: SWMR readers need none, and a held lock would stop the owner from reopening the file.
        file = h5py.File(path, "r", libver="latest", swmr=True, locking=False, **_READER_CACHE)
    except OSError as exc:
        raise ShardError(f"{path}: not a readable HDF5 shard ({exc})") from exc
    try:
        kind = _attr(file, "kind")
        if kind not in schemas:
            raise ShardError(f"{path}: holds {kind!r} data, expected one of {sorted(schemas)}")
        _check(file, path, schemas[kind])
        return Shard(path, schemas[kind], file, writable=False)
    except BaseException:
        file.close()
        raise


def copy_rows(src: Shard, dst: Shard, table: str, rows: np.ndarray) -> None:
    """Append the given rows of `src` to `dst`, a few thousand at a time."""
    for begin in range(0, len(rows), COPY_ROWS):
        dst.append(table, src.read_rows(table, rows[begin : begin + COPY_ROWS]))


def rewrite(path: Path, schema: ShardSchema, keep: Callable[[Shard, str], np.ndarray]) -> None:
    """Replace a closed shard by a fresh file holding only the rows `keep` selects per table.

    Readers that still hold the old file keep reading it (POSIX rename); they reopen when they see the swap.
    """
    tmp = path.with_name(path.name + ".tmp")
    src = open_reader(path, {schema.kind: schema})
    try:
        dst = create_shard(tmp, schema)
        try:
            for table in schema.tables:
                copy_rows(src, dst, table.name, keep(src, table.name))
            dst.flush_to_disk()
        finally:
            dst.close()
    finally:
        src.close()
    os.replace(tmp, path)


def _open_swmr_writer(path: Path) -> h5py.File:
    """Open straight into SWMR-write mode, so no reader ever finds the file opened for plain writing."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_cache(0, 0, _WRITER_CACHE["rdcc_nbytes"], 0.75)
    return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE, fapl=fapl))


def _create_column(group: h5py.Group, table: Table, column: Column) -> None:
    # Offsets and fixed columns are small next to the flat data: their chunks hold 1/8 of chunk_bytes.
    itemsize = np.dtype(column.dtype).itemsize
    if column.ragged:
        group.create_dataset(column.name, shape=(0,), maxshape=(None,), dtype=column.dtype,
                             chunks=(max(1, table.chunk_bytes // itemsize),))
        group.create_dataset(column.name + OFFSETS, shape=(0,), maxshape=(None,), dtype="int64",
                             chunks=(max(1, table.chunk_bytes // 64),))
    else:
        width = (column.width,) if column.width else ()
        rows_per_chunk = max(1, table.chunk_bytes // (8 * itemsize * max(1, column.width)))
        group.create_dataset(column.name, shape=(0, *width), maxshape=(None, *width), dtype=column.dtype,
                             chunks=(rows_per_chunk, *width))


def _fixed_rows(column: Column, values: Sequence, count: int) -> np.ndarray:
    """A batch's values of a fixed column as an array of its row shape."""
    shape = (count, column.width) if column.width else (count,)
    return np.asarray(values, dtype=column.dtype).reshape(shape)


def _concatenate_cells(cells: Sequence, dtype: np.dtype, total: int) -> np.ndarray:
    """A batch's cells of one ragged column (`total` values in all), back to back, in one copy."""
    try:
        if set(map(operator.attrgetter("dtype"), cells)) == {dtype}:
            # Cells already of the column's type: joining their buffers costs about 60% of np.concatenate.
            flat = np.frombuffer(b"".join(cells), dtype=dtype)
            if len(flat) == total:  # else some cell is not 1-D
                return flat
    except (AttributeError, BufferError, TypeError):  # not arrays, or not contiguous ones
        pass
    # One cast-and-copy for the whole batch; same_kind refuses e.g. floats into a token column (an empty
    # list would read as float64 and be refused too: it holds no values to cast).
    cells = [cell if len(cell) else np.empty(0, dtype) for cell in cells]
    return np.concatenate(cells, dtype=dtype, casting="same_kind") if cells else np.empty(0, dtype)


def _extend(data: h5py.Dataset, start: int, values: np.ndarray) -> None:
    """Set the row count to start + len(values) and write values there.

    Low-level h5py calls: the high-level resize + slice assignment costs ~190 us per call against ~50 us,
    and an append makes about twenty of them per batch.
    """
    data.id.set_extent((start + len(values), *values.shape[1:]))  # values has the row shape: no file query
    _write(data, start, values)


def _write(data: h5py.Dataset, start: int, values: np.ndarray) -> None:
    """Write values from row `start` on, inside the dataset's current extent."""
    if len(values):
        file_space = data.id.get_space()
        file_space.select_hyperslab((start,) + (0,) * (values.ndim - 1), values.shape)
        data.id.write(h5py.h5s.create_simple(values.shape), file_space, np.ascontiguousarray(values))


def _attr(file: h5py.File, name: str):
    value = file.attrs.get(name)
    return value.decode() if isinstance(value, bytes) else value


def _predated_columns(file: h5py.File, schema: ShardSchema) -> list[str]:
    """The added_later columns a shard was written without."""
    return [f"/{t.name}/{c.name}" for t in schema.tables for c in t.columns
            if c.added_later and c.name not in file[t.name]]


def _check(file: h5py.File, path: Path, schema: ShardSchema) -> None:
    version = _attr(file, "schema_version")
    if version != SCHEMA_VERSION:
        raise ShardError(f"{path}: schema version {version}, this build reads version {SCHEMA_VERSION}; "
                         "read it with the rlf-cache that wrote it, or use a new cache directory")
    if _attr(file, "kind") != schema.kind:
        raise ShardError(f"{path}: holds {_attr(file, 'kind')!r} data, expected {schema.kind!r}")
    for table in schema.tables:
        if table.name not in file or ROWS not in file[table.name]:
            raise ShardError(f"{path}: table /{table.name} or its row counter is missing")
        committed = int(file[table.name][ROWS][()])
        for column in table.columns:
            if column.added_later and column.name not in file[table.name]:
                continue
            names = [column.name, column.name + OFFSETS] if column.ragged else [column.name]
            for name in names:
                data = file[table.name].get(name)
                want = "int64" if name.endswith(OFFSETS) else column.dtype
                if not isinstance(data, h5py.Dataset) or data.dtype != np.dtype(want):
                    raise ShardError(f"{path}: dataset /{table.name}/{name} is missing or not {want}")
                if data.shape[0] < committed and not (column.ragged and name == column.name):
                    raise ShardError(f"{path}: /{table.name}/{name} has {data.shape[0]} rows, "
                                     f"but {committed} are committed")


def _truncate_uncommitted(file: h5py.File, schema: ShardSchema) -> None:
    """Cut rows a dead writer wrote after its last commit point."""
    for table in schema.tables:
        group = file[table.name]
        committed = int(group[ROWS][()])
        for column in table.columns:
            if column.ragged:
                offsets = group[column.name + OFFSETS]
                end = int(offsets[committed - 1]) if committed else 0
                if group[column.name].shape[0] < end:
                    raise ShardError(f"{file.filename}: /{table.name}/{column.name} is shorter than its offsets")
                offsets.resize(committed, axis=0)
                group[column.name].resize(end, axis=0)
            else:
                group[column.name].resize(committed, axis=0)
