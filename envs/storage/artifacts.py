"""Tool-call results shared by every rank: key = sha256(tool, canonical JSON args), stored in the owner rank's
shard (key mod world), found from any rank, bounded by a TTL and an LRU size cap. New entries reach every
rank at step boundaries through one collective, and survive restarts on disk."""
from __future__ import annotations

import hashlib
import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .schemas import ARTIFACTS
from .shard import Shard, list_shards, open_reader, open_writer, rewrite, shard_name
from .topology import Topology, detect_topology

_TABLE = "artifacts"
_BYTES, _JSON = 0, 1
_ROW_OVERHEAD = 32 + 3 * 8 + 2 * 8 + 1  # key, end offsets, timestamps, encoding: counted against the cap


def artifact_key(tool: str, args: Mapping[str, Any]) -> bytes:
    """sha256 of the tool name and its arguments as canonical JSON (key order and spacing do not matter)."""
    canonical = json.dumps(args, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(tool.encode() + b"\0" + canonical.encode()).digest()


def owner_of(key: bytes, world: int) -> int:
    """The rank whose shard stores `key`."""
    return int.from_bytes(key, "big") % world


@dataclass(frozen=True)
class CachedArtifact:
    tool: str
    value: Any  # bytes as stored, or the decoded JSON value
    metadata: dict[str, Any]
    created_at: float
    expires_at: float  # math.inf when it never expires


@dataclass(frozen=True)
class _Entry:
    """A new artifact as it travels through the collective to its owner."""

    key: bytes
    tool: str
    value: bytes
    encoding: int
    metadata: bytes
    created_at: float
    expires_at: float

    def nbytes(self) -> int:
        return len(self.value) + len(self.metadata) + len(self.tool.encode()) + _ROW_OVERHEAD

    def artifact(self) -> CachedArtifact:
        return CachedArtifact(self.tool, _decode(self.value, self.encoding), json.loads(self.metadata),
                              self.created_at, self.expires_at)


@dataclass(frozen=True)
class _Location:
    path: Path
    row: int
    encoding: int
    created_at: float
    expires_at: float


@dataclass(frozen=True)
class _Owned:
    """One live entry of this rank's own shard, as the LRU tracks it."""

    row: int
    nbytes: int
    expires_at: float


class ToolArtifactCache:
    """Look up a tool call's result from any rank (`get`), cache new ones (`put`), and call `sync()` on every
    rank at each step boundary. `max_bytes` is the whole cache's cap, split evenly over the ranks' shards.
    One instance per process, used from one thread."""

    def __init__(self, directory: str | Path, topology: Topology | None = None, max_bytes: int = 1 << 30,
                 ttl_s: float | None = None, clock: Callable[[], float] = time.time):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.topology = topology or detect_topology()
        self.shard_cap = max_bytes // self.topology.world
        self.ttl_s, self._clock = ttl_s, clock
        self.hits = self.misses = self.rewrites = 0
        self._writer = open_writer(self.directory / shard_name(self.topology.rank, self.topology.world), ARTIFACTS)
        self._shards: dict[Path, Shard] = {self._writer.path: self._writer}
        self._indexed: dict[Path, tuple[int, int]] = {}  # (artifact rows, eviction rows) already indexed
        self._index: dict[bytes, _Location] = {}
        self._fresh: dict[bytes, _Entry] = {}  # known to this rank but maybe not on disk yet
        self._pending: list[_Entry] = []  # this rank's puts since the last sync
        self._touched: dict[bytes, float] = {}  # keys this rank read since the last sync -> last read time
        self._lru: OrderedDict[bytes, _Owned] = OrderedDict()  # own shard, least recently used first
        self._live_bytes = self._dead_bytes = 0
        self._refresh_index()
        self._load_own_lru()
        # A writer killed between storing new rows and recording their evictions, or a smaller `max_bytes`
        # than the last run's, leaves the shard over its cap: evict (oldest first) before the first lookup.
        self._store_owned([], {})

    def get(self, tool: str, args: Mapping[str, Any]) -> CachedArtifact | None:
        key, now = artifact_key(tool, args), self._clock()
        entry = self._fresh.get(key)
        if entry is not None and entry.expires_at > now:
            artifact = entry.artifact()
        else:
            location = self._index.get(key)
            if location is None or location.expires_at <= now:
                self.misses += 1
                return None
            artifact = self._read(location, tool)
        self.hits += 1
        self._touched[key] = now
        return artifact

    def put(self, tool: str, args: Mapping[str, Any], value: bytes | Any,
            metadata: Mapping[str, Any] | None = None, ttl_s: float | None = None) -> None:
        """Cache a result (bytes, or anything JSON can encode). Other ranks see it after the next sync."""
        if isinstance(value, (bytes, bytearray, memoryview)):
            encoded, encoding = bytes(value), _BYTES
        else:
            encoded, encoding = json.dumps(value, separators=(",", ":")).encode(), _JSON
        now, ttl = self._clock(), self.ttl_s if ttl_s is None else ttl_s
        entry = _Entry(artifact_key(tool, args), tool, encoded, encoding,
                       json.dumps(dict(metadata or {}), separators=(",", ":")).encode(),
                       now, math.inf if ttl is None else now + ttl)
        self._pending.append(entry)
        self._fresh[entry.key] = entry

    def sync(self) -> None:
        """Step boundary, collective: publish every rank's puts and reads, store owned entries, evict."""
        gathered = self.topology.allgather((self._pending, self._touched))
        self._pending, self._touched = [], {}
        # Each owner wrote what the previous sync gathered before entering this collective, so the shards
        # now hold it; what this sync gathered is served from memory until the next one.
        self._refresh_index()
        self._fresh = {}
        owned: dict[bytes, _Entry] = {}
        touches: dict[bytes, float] = {}
        for entries, touched in gathered:
            for entry in entries:
                if owner_of(entry.key, self.topology.world) == self.topology.rank:
                    owned.setdefault(entry.key, entry)  # several ranks may have run the same call
                else:
                    self._fresh[entry.key] = entry
            for key, when in touched.items():
                touches[key] = max(when, touches.get(key, when))
        self._store_owned(list(owned.values()), touches)

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._index), "owned_entries": len(self._lru), "owned_bytes": self._live_bytes,
                "dead_bytes": self._dead_bytes, "shard_cap": self.shard_cap, "rewrites": self.rewrites,
                "hits": self.hits, "misses": self.misses}

    def close(self) -> None:
        for shard in self._shards.values():
            shard.close()

    def __enter__(self) -> ToolArtifactCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read(self, location: _Location, tool: str) -> CachedArtifact:
        shard = self._shards[location.path]
        value = shard.cell(_TABLE, "value", location.row).tobytes()
        metadata = json.loads(shard.cell(_TABLE, "metadata", location.row).tobytes())
        return CachedArtifact(tool, _decode(value, location.encoding), metadata,
                              location.created_at, location.expires_at)

    def _store_owned(self, entries: list[_Entry], touches: dict[bytes, float]) -> None:
        now = self._clock()
        for key, _ in sorted(touches.items(), key=lambda item: item[1]):
            if key in self._lru:
                self._lru.move_to_end(key)
        evicted: list[int] = []
        for key in [k for k, owned in self._lru.items() if owned.expires_at <= now]:
            evicted.append(self._drop(key))
        new = [e for e in entries if e.key not in self._lru and e.nbytes() <= self.shard_cap and e.expires_at > now]
        if new:
            rows = self._writer.append(_TABLE, _entry_columns(new))
            for entry, row in zip(new, rows):
                self._lru[entry.key] = _Owned(row, entry.nbytes(), entry.expires_at)
                self._live_bytes += entry.nbytes()
        while self._live_bytes > self.shard_cap:
            evicted.append(self._drop(next(iter(self._lru))))
        if evicted:
            self._writer.append("evictions", {"row": evicted})
        self._index_new_rows(self._writer)
        # Evicted rows stay in the file until it is rewritten; bound the file at about twice the cap.
        if self._dead_bytes > self.shard_cap:
            self._compact()

    def _drop(self, key: bytes) -> int:
        owned = self._lru.pop(key)
        self._live_bytes -= owned.nbytes
        self._dead_bytes += owned.nbytes
        return owned.row

    def _compact(self) -> None:
        path = self._writer.path
        self._writer.close()
        rewrite(path, ARTIFACTS, keep=ARTIFACTS.live_rows)
        self._writer = self._shards[path] = open_writer(path, ARTIFACTS)
        self._forget(path)
        self._index_new_rows(self._writer)
        self._lru = OrderedDict((key, _Owned(self._index[key].row, owned.nbytes, owned.expires_at))
                                for key, owned in self._lru.items())
        self._dead_bytes = 0
        self.rewrites += 1

    def _load_own_lru(self) -> None:
        """After a restart the LRU order is the write order: read times are not persisted."""
        writer, rows = self._writer, self._writer.rows(_TABLE)
        sizes = _row_sizes(writer, 0, rows)
        for key, location in self._index.items():
            if location.path == writer.path:
                self._lru[key] = _Owned(location.row, int(sizes[location.row]), location.expires_at)
        self._lru = OrderedDict(sorted(self._lru.items(), key=lambda item: item[1].row))
        self._live_bytes = sum(owned.nbytes for owned in self._lru.values())
        self._dead_bytes = int(sizes.sum()) - self._live_bytes

    def _refresh_index(self) -> None:
        for path in list_shards(self.directory):
            shard = self._shards.get(path)
            if shard is not None and not shard.writable and shard.replaced():
                shard.close()  # its owner compacted it: row numbers changed
                self._forget(path)
                shard = None
            if shard is None:
                shard = self._shards[path] = open_reader(path, {ARTIFACTS.kind: ARTIFACTS})
            elif not shard.writable:
                shard.refresh()
            self._index_new_rows(shard)

    def _forget(self, path: Path) -> None:
        self._index = {key: loc for key, loc in self._index.items() if loc.path != path}
        self._indexed.pop(path, None)

    def _index_new_rows(self, shard: Shard) -> None:
        start, evictions_start = self._indexed.get(shard.path, (0, 0))
        stop, evictions_stop = shard.rows(_TABLE), shard.rows("evictions")
        keys = shard.read(_TABLE, "key", start, stop)
        encodings = shard.read(_TABLE, "encoding", start, stop).tolist()
        created = shard.read(_TABLE, "created_at", start, stop).tolist()
        expires = shard.read(_TABLE, "expires_at", start, stop).tolist()
        for i, row in enumerate(range(start, stop)):
            self._index[keys[i].tobytes()] = _Location(shard.path, row, encodings[i], created[i], expires[i])
        for row in shard.read("evictions", "row", evictions_start, evictions_stop).tolist():
            key = shard.cell(_TABLE, "key", row).tobytes()
            location = self._index.get(key)
            if location is not None and location.path == shard.path and location.row == row:
                del self._index[key]
        self._indexed[shard.path] = (stop, evictions_stop)


def _decode(value: bytes, encoding: int) -> Any:
    return json.loads(value) if encoding == _JSON else value


def _entry_columns(entries: list[_Entry]) -> dict[str, list]:
    return {
        "key": [_u8(e.key) for e in entries],
        "tool": [_u8(e.tool.encode()) for e in entries],
        "value": [_u8(e.value) for e in entries],
        "encoding": [e.encoding for e in entries],
        "metadata": [_u8(e.metadata) for e in entries],
        "created_at": [e.created_at for e in entries],
        "expires_at": [e.expires_at for e in entries],
    }


def _u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _row_sizes(shard: Shard, start: int, stop: int) -> np.ndarray:
    """Bytes each row counts against the cap (same rule as _Entry.nbytes)."""
    sizes = np.full(stop - start, _ROW_OVERHEAD, dtype=np.int64)
    for column in ("tool", "value", "metadata"):
        ends = shard.ends(_TABLE, column)[start:stop]
        sizes += np.diff(ends, prepend=shard.ends(_TABLE, column)[start - 1] if start > 0 else 0)
    return sizes
