"""The Ray tool pool: results, failures (raise, hang, huge output, dead actor), backpressure, metrics."""
import asyncio
import time

import pytest

from rlfactory_megatron.envs.tool_manager import truncate_observation
from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig
from rlfactory_megatron.envs.tools import ToolSpec

FAULTS = [ToolSpec(f"rlf_fault_tools.{cls}") for cls in ("RaisingTool", "HangingTool", "HugeOutputTool", "SlowTool", "CrashingTool")]


def with_pool(config, body):
    async def go():
        pool = ToolPool(config)
        await pool.start()
        try:
            return await body(pool)
        finally:
            await pool.close()

    return asyncio.run(go())


def test_failures_come_back_as_results_and_do_not_delay_other_calls(ray_session):
    config = ToolPoolConfig(FAULTS, num_actors=1, num_cpus_per_actor=0, max_concurrency=16, call_timeout_s=1.5)

    async def body(pool):
        start = time.monotonic()
        hang = asyncio.ensure_future(pool.call("hangs", {}))
        fast = await asyncio.gather(*(pool.call("slow", {"seconds": 0.05}) for _ in range(10)))
        fast_done = time.monotonic() - start
        raised, huge, unknown, invalid = await asyncio.gather(
            pool.call("raises", {}), pool.call("huge", {}), pool.call("nope", {}), pool.call("slow", {"seconds": "x"})
        )
        hung = await hang
        return fast, fast_done, hung, time.monotonic() - start, raised, huge, unknown, invalid, pool.metrics()

    fast, fast_done, hung, hang_done, raised, huge, unknown, invalid, metrics = with_pool(config, body)
    assert all(r.text == "done" and not r.is_error for r in fast)
    assert fast_done < 1.0  # not held back by the hung call on the same actor
    assert hung.is_error and hung.metadata["error_kind"] == "timeout" and 1.4 < hang_done < 3.5
    assert raised.is_error and "RuntimeError: boom" in raised.text
    assert len(huge.text) == 1 << 20 and not huge.is_error
    cut = truncate_observation(huge.text, 200)
    assert len(cut) < 300 and "truncated" in cut
    assert unknown.is_error and invalid.metadata["error_kind"] == "invalid_arguments"
    assert metrics["hangs"] == {**metrics["hangs"], "calls": 1, "errors": 1, "timeouts": 1}
    assert metrics["raises"]["errors"] == 1 and metrics["huge"]["errors"] == 0
    assert metrics["slow"]["calls"] == 11 and metrics["slow"]["errors"] == 1
    assert 0.05 <= metrics["slow"]["latency_p50_s"] <= metrics["slow"]["latency_p90_s"] <= metrics["slow"]["latency_p99_s"]


def test_killed_actor_is_restarted_and_the_call_rerun_once(ray_session):
    config = ToolPoolConfig(FAULTS, num_actors=2, num_cpus_per_actor=0, max_concurrency=4, call_timeout_s=30)

    async def body(pool):
        victim = pool.actors[0]
        old_pid = await victim.pid.remote()
        calls = [asyncio.ensure_future(pool.call("slow", {"seconds": 1.0})) for _ in range(4)]
        await asyncio.sleep(0.4)
        ray_session.kill(victim, no_restart=False)
        rerun = await asyncio.gather(*calls)
        new_pid = await victim.pid.options(max_task_retries=5).remote()
        crashed = await pool.call("crashes", {})
        after = await pool.call("slow", {"seconds": 0.0})
        return old_pid, new_pid, rerun, crashed, after, pool.metrics()

    old_pid, new_pid, rerun, crashed, after, metrics = with_pool(config, body)
    assert new_pid != old_pid
    assert all(r.text == "done" and not r.is_error for r in rerun)
    assert metrics["slow"]["actor_deaths"] >= 1  # the calls the kill interrupted ran again
    assert crashed.is_error and crashed.metadata["error_kind"] == "actor_died"
    assert metrics["crashes"]["calls"] == 1 and metrics["crashes"]["errors"] == 1
    assert metrics["crashes"]["actor_deaths"] >= 2  # ran, crashed, re-ran once, crashed again
    assert after.text == "done"


def test_bounded_queue_and_concurrency_limit(ray_session):
    config = ToolPoolConfig(FAULTS, num_actors=1, num_cpus_per_actor=0, max_concurrency=2, max_queue=3, call_timeout_s=10)

    async def body(pool):
        calls = [asyncio.ensure_future(pool.call("slow", {"seconds": 0.3})) for _ in range(8)]
        await asyncio.sleep(0.1)
        queued = pool._queue.qsize()
        blocked = sum(not c.done() for c in calls)
        return queued, blocked, await asyncio.gather(*calls)

    queued, blocked, results = with_pool(config, body)
    assert queued == 3 and blocked == 8  # 2 running, 1 held by the dispatcher, 3 queued, 2 callers waiting
    spans = sorted((r.metadata["start"], r.metadata["end"]) for r in results)
    overlapping = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert overlapping <= 2


def test_watchdog_times_out_a_call_whose_actor_stopped_answering(ray_session):
    config = ToolPoolConfig([ToolSpec("rlf_fault_tools.BlockingTool")], num_actors=1, num_cpus_per_actor=0, call_timeout_s=0.5)

    async def body(pool):
        start = time.monotonic()
        result = await pool.call("blocks", {})
        return result, time.monotonic() - start, pool.metrics()

    result, elapsed, metrics = with_pool(config, body)
    # The actor's own timer cannot fire while its loop is blocked; the driver's watchdog does.
    assert result.is_error and "stopped answering" in result.text and elapsed < 3.8
    assert metrics["blocks"]["timeouts"] == 1


def test_start_reports_bad_tool_config(ray_session):
    config = ToolPoolConfig([ToolSpec("no_such_tool")], num_actors=1, num_cpus_per_actor=0)
    with pytest.raises(ValueError, match="unknown tool class"):
        with_pool(config, lambda pool: asyncio.sleep(0))


def test_config_from_dict_rejects_unknown_keys(tmp_path):
    config = ToolPoolConfig.from_dict({"tools": [{"class": "calculator"}], "num_actors": 3})
    assert config.num_actors == 3 and config.tools[0].cls == "calculator"
    (tmp_path / "tools.yaml").write_text("tools:\n  - class: python\n    params: {cpu_time_s: 2}\n")
    from_yaml = ToolPoolConfig.from_dict({"tools": str(tmp_path / "tools.yaml")})
    assert from_yaml.tools[0].cls == "python" and from_yaml.tools[0].params == {"cpu_time_s": 2}
    with pytest.raises(ValueError, match="num_actor"):
        ToolPoolConfig.from_dict({"tools": [], "num_actor": 3})
