"""The Ray tool pool: results, failures (raise, hang, huge output, dead actor), backpressure, metrics,
how calls are grouped into frames, and the actor's call channel (token, cancel on disconnect, TCP)."""
import asyncio
import os
import time

import pytest

from rlfactory_megatron.envs import tool_pool
from rlfactory_megatron.envs.tool_manager import truncate_observation
from rlfactory_megatron.envs.tool_pool import ToolActor, ToolPool, ToolPoolConfig
from rlfactory_megatron.envs.tools import BaseTool, ToolResult, ToolSpec

# Bounds on wall time: run alone, after the parallel part of the suite (scripts/test.sh).
pytestmark = pytest.mark.serial

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
        queued = len(pool._queue)
        blocked = sum(not c.done() for c in calls)
        return queued, blocked, await asyncio.gather(*calls)

    queued, blocked, results = with_pool(config, body)
    assert queued == 3 and blocked == 8  # 2 running, 3 queued, 3 callers waiting for room in the queue
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


class FragileTool(BaseTool):
    """Builds only while the file `marker` does not exist: a tool its restarted actor cannot rebuild.
    (Ray workers import it from this module by name, like the tools of rlf_fault_tools.)"""

    name = "fragile"
    description = "answers 'ok'"

    def __init__(self, marker: str):
        if os.path.exists(marker):
            raise RuntimeError("fragile tool cannot be built")

    async def execute(self, args):
        return ToolResult("ok")


def test_calls_an_actor_cannot_start_come_back_as_errors(ray_session, tmp_path):
    marker = tmp_path / "broken"
    spec = ToolSpec("test_tool_pool.FragileTool", {"marker": str(marker)})
    config = ToolPoolConfig([spec], num_actors=1, num_cpus_per_actor=0, call_timeout_s=30)

    async def body(pool):
        before = await pool.call("fragile", {})
        marker.touch()
        actor = pool.actors[0]
        old_pid = await actor.pid.remote()
        ray_session.kill(actor, no_restart=False)
        while await actor.pid.options(max_task_retries=5).remote() == old_pid:  # the kill takes a moment
            await asyncio.sleep(0.05)
        return before, await pool.call("fragile", {}), await pool.call("fragile", {})

    before, after, again = with_pool(config, body)
    assert before.text == "ok"
    for result in (after, again):  # an error result at once, not a hang until the watchdog
        assert result.is_error and "could not start" in result.text and "cannot be built" in result.text


def test_calls_made_together_share_one_frame(ray_session):
    config = ToolPoolConfig(FAULTS, num_actors=1, num_cpus_per_actor=0, max_concurrency=64, call_timeout_s=10)

    async def body(pool):
        sizes = []
        submit = pool._submit

        def counting_submit(lane, batch):
            sizes.append(len(batch))
            submit(lane, batch)

        pool._submit = counting_submit
        together = await asyncio.gather(*(pool.call("slow", {"seconds": 0.05}) for _ in range(64)))
        burst, sizes[:] = sizes[:], []
        trickle = []
        for _ in range(10):  # one call per event-loop turn
            trickle.append(asyncio.ensure_future(pool.call("slow", {"seconds": 0.05})))
            await asyncio.sleep(0)
        return burst, sizes, together + await asyncio.gather(*trickle)

    burst, trickled, results = with_pool(config, body)
    assert all(r.text == "done" and not r.is_error for r in results)
    assert burst == [64]  # callers woken in one turn share one frame
    assert sum(trickled) == 10


def test_the_tcp_channel_serves_calls_too(ray_session):
    config = ToolPoolConfig(FAULTS, num_actors=2, num_cpus_per_actor=0, max_concurrency=8, call_timeout_s=10,
                            channel="tcp")

    async def body(pool):
        results = await asyncio.gather(*(pool.call("slow", {"seconds": 0.01}) for _ in range(20)))
        return results, [lane.writer.get_extra_info("peername") for lane in pool.lanes]

    results, peers = with_pool(config, body)
    assert all(r.text == "done" for r in results)
    assert all(isinstance(peer, tuple) and len(peer) == 2 for peer in peers)  # (host, port): TCP
    with pytest.raises(ValueError, match="channel"):
        ToolPoolConfig(FAULTS, channel="carrier-pigeon")


def test_actor_channel_checks_the_token_and_cancels_calls_of_a_dropped_driver():
    async def go():
        actor = ToolActor(FAULTS)
        incarnation, address, token = await actor.open_channel(None, "unix")
        frame = (10.0, [(i, "slow", {"seconds": 0.05}) for i in range(20)] + [(99, "hangs", {})])

        # A wrong token: the connection is closed and nothing it sent runs.
        reader, writer = await tool_pool._open_connection(address)
        writer.write(bytes(len(token)))
        tool_pool._write_frame(writer, frame)
        refused = await reader.read()

        reader, writer = await tool_pool._open_connection(address)
        writer.write(token)
        tool_pool._write_frame(writer, frame)
        results = []
        while len(results) < 20:
            results += await tool_pool._read_frame(reader)
        running = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "ToolBox.run"]
        writer.close()  # the driver goes away while "hangs" runs
        for _ in range(100):
            await asyncio.sleep(0.01)
            if all(t.done() for t in running):
                break
        return incarnation, refused, results, running

    incarnation, refused, results, running = asyncio.run(go())
    assert incarnation and refused == b""
    assert sorted(rid for rid, *_ in results) == list(range(20))
    assert all(text == "done" and not is_error for _, text, _, is_error in results)
    assert running and all(t.cancelled() for t in running)  # the hung call was cancelled with its driver


def test_start_names_the_error_when_no_channel_can_be_reached(ray_session, monkeypatch):
    async def unreachable(address):
        raise ConnectionRefusedError(f"nothing listens at {address}")

    monkeypatch.setattr(tool_pool, "_open_connection", unreachable)
    monkeypatch.setattr(tool_pool, "_START_TIMEOUT_S", 1.0)
    config = ToolPoolConfig(FAULTS, num_actors=1, num_cpus_per_actor=0, channel="tcp")
    with pytest.raises(RuntimeError, match="tool actor 0: no connection .*ConnectionRefusedError: nothing listens"):
        with_pool(config, lambda pool: asyncio.sleep(0))


def test_item5_a_tool_module_beside_its_tools_file_runs_in_the_tool_actors(ray_session, tmp_path, monkeypatch):
    """Issue 61 item 5: docs/tools.md's own tool, in a module beside the tools YAML (not on any
    path: `No module named 'my_tools'` before), is found at load and in the Ray tool actors."""
    from rlfactory_megatron.envs.tools.registry import check_tool_specs, load_tool_specs

    folder = tmp_path / "my_project"
    folder.mkdir()
    (folder / "rlf_item5_tools.py").write_text(
        "from rlfactory_megatron.envs.tools.base import BaseTool, ToolResult\n\n"
        "class WordCount(BaseTool):\n"
        "    name = 'word_count'\n"
        "    description = 'Count the words of a text.'\n"
        "    parameters = {'type': 'object', 'properties': {'text': {'type': 'string'}}, 'required': ['text']}\n\n"
        "    async def execute(self, arguments: dict) -> ToolResult:\n"
        "        return ToolResult(text=str(len(arguments['text'].split())))\n")
    (folder / "tools.yaml").write_text("tools:\n  - class: rlf_item5_tools:WordCount\n")
    monkeypatch.chdir(tmp_path)  # the working directory is not the module's folder
    specs = load_tool_specs(folder / "tools.yaml")
    check_tool_specs(specs)
    config = ToolPoolConfig(specs, num_actors=1, num_cpus_per_actor=0, call_timeout_s=30)

    async def body(pool):
        return await pool.call("word_count", {"text": "one two three"})

    result = with_pool(config, body)
    assert not result.is_error and result.text == "3", result
