"""The tool pool with the artifact cache: a hit answers without executing, errors are never cached,
per-tool opt-out (class default and YAML `cacheable:`), the pool switch, and hit/miss metrics."""
import asyncio

import pytest

from rlfactory_megatron.envs.storage import ToolArtifactCache, single_process
from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig
from rlfactory_megatron.envs.tools import ToolBox, parse_tool_specs

# The same counting tool twice: once cacheable (the BaseTool default), once opted out in the YAML way.
SPECS = parse_tool_specs([
    {"class": "rlf_fault_tools.CountingTool"},
    {"class": "rlf_fault_tools.CountingTool", "params": {"name": "counts_fresh"}, "cacheable": False},
])


def pool_config(**overrides):
    return ToolPoolConfig(SPECS, num_actors=1, num_cpus_per_actor=0, max_concurrency=8, call_timeout_s=10, **overrides)


def test_hits_are_answered_from_the_cache_without_executing(ray_session, tmp_path):
    cache = ToolArtifactCache(tmp_path / "artifacts", topology=single_process())

    async def go():
        pool = ToolPool(pool_config(), cache)
        await pool.start()
        try:
            first = await pool.call("counts", {"x": "a"})
            again = await pool.call("counts", {"x": "a"})
            other = await pool.call("counts", {"x": "b"})
            failed = [await pool.call("counts", {"x": "c", "fail": True}) for _ in range(2)]
            fresh = [await pool.call("counts_fresh", {"x": "a"}) for _ in range(2)]
            cache.sync()  # step boundary: the entry is now read back from the shard on disk
            after_sync = await pool.call("counts", {"x": "a"})
            return first, again, other, failed, fresh, after_sync, pool.metrics()
        finally:
            await pool.close()

    first, again, other, failed, fresh, after_sync, metrics = asyncio.run(go())
    cache.close()
    assert (first.text, first.metadata) == ("a#1", {"execution": 1})
    # The repeat ran nothing: the next execution of the tool is only its second.
    assert (again.text, again.metadata, again.is_error) == ("a#1", {"execution": 1, "cache_hit": True}, False)
    assert other.text == "b#2"
    assert [r.text for r in failed] == ["c#3", "c#4"] and all(r.is_error for r in failed)
    assert [r.text for r in fresh] == ["a#1", "a#2"]
    assert after_sync.text == "a#1" and after_sync.metadata["cache_hit"]
    assert {k: metrics["counts"][k] for k in ("calls", "errors", "cache_hits", "cache_misses")} == {
        "calls": 4, "errors": 2, "cache_hits": 2, "cache_misses": 4}
    assert {k: metrics["counts_fresh"][k] for k in ("calls", "cache_hits", "cache_misses")} == {
        "calls": 2, "cache_hits": 0, "cache_misses": 0}


def test_use_cache_false_turns_the_cache_off(ray_session, tmp_path):
    cache = ToolArtifactCache(tmp_path / "artifacts", topology=single_process())

    async def go():
        pool = ToolPool(pool_config(use_cache=False), cache)
        await pool.start()
        try:
            return [(await pool.call("counts", {"x": "a"})).text for _ in range(2)], pool.metrics()
        finally:
            await pool.close()

    texts, metrics = asyncio.run(go())
    cache.close()
    assert texts == ["a#1", "a#2"] and metrics["counts"]["cache_hits"] == metrics["counts"]["cache_misses"] == 0
    assert cache.stats()["entries"] == 0


def test_cacheable_defaults_and_yaml_override(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Paris is the capital of France.\n")
    specs = parse_tool_specs([
        {"class": "calculator"}, {"class": "python"}, {"class": "search", "params": {"corpus": str(corpus)}},
        {"class": "sleep", "cacheable": False},
    ])
    box = asyncio.run(ToolBox.build(specs))
    assert box.cacheable_tools() == ["calculator", "search"]
    with pytest.raises(ValueError, match=r"tools\[0\].cacheable must be true or false"):
        parse_tool_specs([{"class": "calculator", "cacheable": "no"}])
    with pytest.raises(ValueError, match=r"tools\[0\]: unknown keys \['cache'\]"):
        parse_tool_specs([{"class": "calculator", "cache": False}])
