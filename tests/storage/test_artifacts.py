"""Tool-artifact cache on one rank: keys, values, LRU eviction under the cap, TTL, restart, compaction."""
from __future__ import annotations

import math

import pytest

from rlfactory_megatron.envs.storage import ToolArtifactCache, artifact_key, owner_of
from rlfactory_megatron.envs.storage.topology import single_process


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cache(path, **kw) -> ToolArtifactCache:
    return ToolArtifactCache(path, topology=single_process(), **kw)


def test_key_ignores_argument_order_and_spacing():
    assert artifact_key("search", {"q": "x", "k": 3}) == artifact_key("search", {"k": 3, "q": "x"})
    assert artifact_key("search", {"q": "x"}) != artifact_key("browse", {"q": "x"})
    owners = [owner_of(artifact_key("t", {"i": i}), 4) for i in range(400)]
    assert {owners.count(r) for r in range(4)} <= set(range(70, 131))  # spread over all ranks


def test_bytes_and_json_values_with_metadata(tmp_path):
    with _cache(tmp_path) as cache:
        assert cache.get("search", {"q": 1}) is None
        cache.put("search", {"q": 1}, b"\x00raw\xff", {"latency_s": 0.25})
        cache.put("calc", {"expr": "1+1"}, {"result": 2, "steps": ["1+1", "2"]})
        for _ in range(2):  # before the step boundary (memory) and after it (the shard)
            hit = cache.get("search", {"q": 1})
            assert (hit.tool, hit.value, hit.metadata) == ("search", b"\x00raw\xff", {"latency_s": 0.25})
            assert hit.expires_at == math.inf
            assert cache.get("calc", {"expr": "1+1"}).value == {"result": 2, "steps": ["1+1", "2"]}
            cache.sync()
        with pytest.raises(TypeError):
            cache.put("bad", {}, object())


def test_restart_reads_entries_from_disk(tmp_path):
    with _cache(tmp_path) as cache:
        for i in range(20):
            cache.put("search", {"q": i}, f"result {i}".encode())
        cache.sync()
        cache.put("search", {"q": "never synced"}, b"lost")
    with _cache(tmp_path) as cache:
        assert all(cache.get("search", {"q": i}).value == f"result {i}".encode() for i in range(20))
        assert cache.get("search", {"q": "never synced"}) is None
        assert cache.stats()["owned_entries"] == 20


def test_lru_eviction_keeps_under_cap_and_drops_least_recent_first(tmp_path):
    value = b"v" * 1000
    with _cache(tmp_path, max_bytes=10_000) as cache:
        for i in range(8):
            cache.put("t", {"i": i}, value)
        cache.sync()
        assert cache.stats()["owned_entries"] == 8
        assert cache.get("t", {"i": 0}) is not None and cache.get("t", {"i": 2}) is not None  # now most recent
        for i in range(8, 12):  # 12 entries of ~1.1 kB: 3 must go
            cache.put("t", {"i": i}, value)
        cache.sync()
        assert cache.stats()["owned_bytes"] <= cache.shard_cap
        alive = [i for i in range(12) if cache.get("t", {"i": i}) is not None]
        assert alive == [0, 2, 5, 6, 7, 8, 9, 10, 11]  # 1, 3, 4: the least recently used
    with _cache(tmp_path, max_bytes=10_000) as cache:  # evictions are on disk
        assert [i for i in range(12) if cache.get("t", {"i": i}) is not None] == alive


def test_reopening_over_the_cap_evicts_the_oldest_first(tmp_path):
    # Also what a writer killed between appending rows and recording their evictions leaves behind.
    with _cache(tmp_path, max_bytes=20_000) as cache:
        for i in range(12):
            cache.put("t", {"i": i}, b"v" * 1000)
        cache.sync()
        assert cache.stats()["owned_entries"] == 12
    with _cache(tmp_path, max_bytes=5_000) as cache:
        assert cache.stats()["owned_bytes"] <= cache.shard_cap
        alive = [i for i in range(12) if cache.get("t", {"i": i}) is not None]
        assert alive == [8, 9, 10, 11]  # ~1.1 kB each: the four written last
    with _cache(tmp_path, max_bytes=20_000) as cache:  # the evictions were recorded on disk
        assert [i for i in range(12) if cache.get("t", {"i": i}) is not None] == alive


def test_eviction_rewrites_the_shard_so_the_file_stays_bounded(tmp_path):
    shard = tmp_path / "shard-00000-of-00001.h5"
    with _cache(tmp_path, max_bytes=200_000) as cache:
        for step in range(40):  # 4 MB through a 200 kB cache
            for i in range(10):
                cache.put("t", {"step": step, "i": i}, bytes([step]) * 10_000)
            cache.sync()
            assert cache.stats()["owned_bytes"] <= cache.shard_cap
            assert shard.stat().st_size < 1_000_000, f"file grows without bound at step {step}"
        assert cache.get("t", {"step": 39, "i": 9}).value == bytes([39]) * 10_000
        assert cache.get("t", {"step": 0, "i": 0}) is None
    with _cache(tmp_path, max_bytes=200_000) as cache:  # what survived the rewrites reads back
        assert cache.get("t", {"step": 39, "i": 5}).value == bytes([39]) * 10_000


def test_entry_larger_than_the_cap_is_not_kept(tmp_path):
    with _cache(tmp_path, max_bytes=1000) as cache:
        cache.put("t", {}, b"x" * 5000)
        cache.sync()
        assert cache.get("t", {}) is None and cache.stats()["owned_entries"] == 0


def test_ttl_expiry(tmp_path):
    clock = Clock()
    with _cache(tmp_path, ttl_s=60, clock=clock) as cache:
        cache.put("t", {"i": "default"}, b"a")
        cache.put("t", {"i": "short"}, b"b", ttl_s=5)
        cache.put("t", {"i": "forever"}, b"c", ttl_s=math.inf)
        cache.sync()
        clock.now += 10
        assert cache.get("t", {"i": "short"}) is None
        assert cache.get("t", {"i": "default"}).expires_at == 1060
        clock.now += 60
        assert cache.get("t", {"i": "default"}) is None
        cache.sync()  # expired entries leave the shard at the step boundary
        assert cache.stats()["owned_entries"] == 1
        cache.put("t", {"i": "short"}, b"again", ttl_s=5)  # an expired key can be cached anew
        cache.sync()
        assert cache.get("t", {"i": "short"}).value == b"again"
    with _cache(tmp_path, clock=clock) as cache:
        assert cache.get("t", {"i": "forever"}).value == b"c"
        assert cache.get("t", {"i": "default"}) is None


def test_hit_and_miss_counters(tmp_path):
    with _cache(tmp_path) as cache:
        cache.get("t", {})
        cache.put("t", {}, b"x")
        cache.get("t", {})
        assert (cache.stats()["hits"], cache.stats()["misses"]) == (1, 1)
