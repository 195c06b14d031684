"""The agent loop against a deterministic scripted engine (no model): token bookkeeping, loss mask,
concurrency, errors and limits. The vLLM end-to-end run lives with the rollout engine's tests."""
import asyncio
import json
import time
from dataclasses import replace

import pytest

from rlfactory_megatron.envs.agent_loop import AgentLoopConfig, TurnBarrier, run_agent_loop
from rlfactory_megatron.envs.tool_manager import get_tool_manager
from rlfactory_megatron.envs.tools import BaseTool, ToolBox, ToolResult, parse_tool_specs
from rlfactory_megatron.rollout.engines import SamplingConfig

# Bounds on wall time: run alone, after the parallel part of the suite (scripts/test.sh).
pytestmark = pytest.mark.serial

SAMPLING = SamplingConfig(temperature=1.0, top_p=0.9, max_tokens=200)


class ScriptedEngine:
    """Replies with a fixed list of texts, in order, and records every request it got."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, list(replies)
        self.requests = []

    async def generate(self, prompt_token_ids, sampling):
        self.requests.append((list(prompt_token_ids), sampling))
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)[: sampling.max_tokens]
        return ids, [-0.5] * len(ids)


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


class HugeTool(BaseTool):
    name, description = "huge", "1 MB of output"

    async def execute(self, args):
        return ToolResult("z" * (1 << 20))


def toolbox(*extra_specs, extra_tools=()):
    box = asyncio.run(ToolBox.build(parse_tool_specs([{"class": "calculator"}, *extra_specs])))
    for tool in extra_tools:
        box.tools[tool.name] = tool
    return box


def rollout(tokenizer, replies, box, config=AgentLoopConfig(), user="What is 12 times 7?"):
    manager = get_tool_manager("qwen3", tokenizer, tool_names=list(box.tools))
    messages = [{"role": "user", "content": user}]
    prompt = manager.render_prompt(messages, box.schemas())
    engine = ScriptedEngine(tokenizer, replies)
    traj = asyncio.run(run_agent_loop(prompt, engine, manager, box.run, SAMPLING, config))
    return traj, engine, manager, messages


def test_observation_tokens_and_only_they_have_loss_mask_zero(qwen_tokenizer):
    box = toolbox()
    turn1, turn2 = call("calculator", expression="12*7") + "<|im_end|>", "The answer is 84.<|im_end|>"
    traj, engine, manager, messages = rollout(qwen_tokenizer, [turn1, turn2], box)

    ids1 = qwen_tokenizer.encode(turn1, add_special_tokens=False)
    ids2 = qwen_tokenizer.encode(turn2, add_special_tokens=False)
    obs = manager.render_observation(["84"])
    assert traj.stop_reason == "answer" and traj.final_content == "The answer is 84."
    assert traj.response_ids == ids1 + obs + ids2
    assert traj.loss_mask == [1] * len(ids1) + [0] * len(obs) + [1] * len(ids2)
    assert traj.logprobs == [-0.5] * len(ids1) + [0.0] * len(obs) + [-0.5] * len(ids2)
    assert engine.requests[1][0] == traj.prompt_ids + ids1 + obs
    full = qwen_tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": turn1[: -len("<|im_end|>")]}, {"role": "tool", "content": "84"},
                    {"role": "assistant", "content": "The answer is 84."}],
        tools=box.schemas(), tokenize=False,
    )
    assert full == qwen_tokenizer.decode(traj.prompt_ids + traj.response_ids) + "\n"  # the template's newline after a turn
    # Sampling stays the same across turns; only the length cap follows the remaining budget.
    (_, first), (_, second) = engine.requests
    assert replace(first, max_tokens=0) == replace(second, max_tokens=0)
    record = traj.turns[0].tool_calls[0]
    assert (record.name, record.arguments, record.observation, record.is_error) == ("calculator", {"expression": "12*7"}, "84", False)


def test_calls_of_one_turn_run_concurrently_and_errors_reach_the_model(qwen_tokenizer):
    box = toolbox({"class": "sleep", "params": {"latency_s": 0.3}})
    turn1 = call("sleep", text="a") + call("sleep", text="b") + "<tool_call>{broken</tool_call>" + call("calculator", expression="1/0")
    traj, engine, _, _ = rollout(qwen_tokenizer, [turn1 + "<|im_end|>", "done<|im_end|>"], box)
    turn = traj.turns[0]
    assert turn.tools_s < 0.55  # two 0.3 s calls side by side, not one after the other
    assert [r.observation for r in turn.tool_calls][:2] == ["a", "b"] and turn.tool_calls[2].is_error
    seen = qwen_tokenizer.decode(engine.requests[1][0])
    assert "error: tool call is not valid JSON" in seen and "division by zero" in seen


def test_huge_tool_output_is_truncated_with_a_marker(qwen_tokenizer):
    box = toolbox(extra_tools=[HugeTool()])
    config = AgentLoopConfig(tool_response_max_tokens=64)
    traj, _, manager, _ = rollout(qwen_tokenizer, [call("huge") + "<|im_end|>", "ok<|im_end|>"], box, config)
    observation = traj.turns[0].tool_calls[0].observation
    assert observation.endswith("more characters not shown]") and len(observation) < 2000
    wrapper_and_marker = len(manager.render_observation(["\n...[truncated: 1048512 more characters not shown]"]))
    assert traj.turns[0].observation_tokens <= 64 + wrapper_and_marker


def test_stops_at_max_turns_and_at_the_token_budget(qwen_tokenizer):
    box = toolbox()
    again = call("calculator", expression="1+1") + "<|im_end|>"
    traj, engine, _, _ = rollout(qwen_tokenizer, [again] * 3, box, AgentLoopConfig(max_turns=3))
    assert traj.stop_reason == "max_turns" and len(traj.turns) == 3 and len(engine.requests) == 3
    assert traj.loss_mask[-1] == 1  # no observation after the last turn

    traj, _, _, _ = rollout(qwen_tokenizer, [again] * 5, box, AgentLoopConfig(max_turns=5, max_response_tokens=60))
    assert traj.stop_reason == "token_budget" and len(traj.response_ids) <= 60


def test_turn_cut_by_length_is_closed_before_the_observation(qwen_tokenizer):
    box = toolbox()
    # A turn that stops right after </tool_call> (e.g. a stop string) carries no <|im_end|>.
    traj, engine, manager, _ = rollout(qwen_tokenizer, [call("calculator", expression="2*3"), "6<|im_end|>"], box)
    second_prompt = qwen_tokenizer.decode(engine.requests[1][0])
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response>" in second_prompt
    end = qwen_tokenizer.encode("<|im_end|>", add_special_tokens=False)
    first_len = traj.turns[0].num_tokens
    assert traj.response_ids[first_len:first_len + len(end)] == end and traj.loss_mask[first_len] == 0


def test_a_slow_tool_delays_only_its_own_sample(qwen_tokenizer):
    box = toolbox({"class": "sleep", "params": {"latency_s": 1.0}})
    manager = get_tool_manager("qwen3", qwen_tokenizer)
    prompt = manager.render_prompt([{"role": "user", "content": "hi"}], box.schemas())

    async def sample(replies):
        engine = ScriptedEngine(qwen_tokenizer, replies)
        traj = await run_agent_loop(prompt, engine, manager, box.run, SAMPLING, AgentLoopConfig())
        return traj, time.perf_counter()

    async def batch():
        start = time.perf_counter()
        slow = sample([call("sleep", text="x") + "<|im_end|>", "late<|im_end|>"])
        fast = [sample([f"answer {i}<|im_end|>"]) for i in range(4)]
        results = await asyncio.gather(slow, *fast)
        return [(t, end - start) for t, end in results]

    (slow_traj, slow_s), *fast = asyncio.run(batch())
    assert slow_s >= 1.0 and slow_traj.final_content == "late"
    assert all(s < 0.5 and t.stop_reason == "answer" for t, s in fast)


def _logged_batch(tokenizer, scripts, lockstep):
    """Run one loop per script (a list of (generation delay, reply) per turn) with a shared event log:
    ("generate", sample, turn) when a turn's request reaches the engine, ("generated", ...) when it is
    answered, ("tool", sample, turn) when its tool call starts."""
    log = []
    manager = get_tool_manager("qwen3", tokenizer)

    class LoggingTool(BaseTool):
        name, description = "note", "Record a call."

        async def execute(self, args):
            log.append(("tool", args["sample"], args["turn"]))
            await asyncio.sleep(0.01)
            return ToolResult("ok")

    box = toolbox(extra_tools=[LoggingTool()])
    prompt = manager.render_prompt([{"role": "user", "content": "hi"}], box.schemas())

    class DelayedEngine:
        def __init__(self, index, script):
            self.index, self.script, self.turn = index, list(script), 0

        async def generate(self, prompt_token_ids, sampling):
            log.append(("generate", self.index, self.turn))
            delay, reply = self.script.pop(0)
            self.turn += 1
            await asyncio.sleep(delay)
            log.append(("generated", self.index, self.turn - 1))
            ids = tokenizer.encode(reply, add_special_tokens=False)
            return ids, [-0.5] * len(ids)

    async def batch():
        barrier = TurnBarrier(len(scripts)) if lockstep else None
        return await asyncio.gather(*(run_agent_loop(prompt, DelayedEngine(i, script), manager, box.run, SAMPLING,
                                                     AgentLoopConfig(max_turns=5), barrier)
                                      for i, script in enumerate(scripts)), return_exceptions=True)

    return asyncio.run(asyncio.wait_for(batch(), 30)), log


def _tool_turns(sample, delays):
    """A script of one tool-calling turn per delay, then an answer."""
    return [(d, call("note", sample=sample, turn=t) + "<|im_end|>") for t, d in enumerate(delays)] + [(0.0, "done<|im_end|>")]


def test_lockstep_turns_wait_for_every_running_sample_and_per_sample_turns_do_not(qwen_tokenizer):
    # Sample 0 is slow to generate; sample 1 is quick and takes 3 tool turns; sample 2 answers at once.
    scripts = [_tool_turns(0, [0.3]), _tool_turns(1, [0.0, 0.0, 0.0]), [(0.0, "done<|im_end|>")]]
    results, log = _logged_batch(qwen_tokenizer, scripts, lockstep=True)
    assert [t.stop_reason for t in results] == ["answer"] * 3
    assert [len(t.turns) for t in results] == [2, 4, 1]
    position = {event: i for i, event in enumerate(log)}
    for turn in range(3):
        running = [i for i in (0, 1) if ("tool", i, turn) in position]
        # every running sample's turn was generated before any of them ran its tool ...
        assert max(position[("generated", i, turn)] for i in running) < min(position[("tool", i, turn)] for i in running)
        # ... and every tool call of the turn started before the next turn's first request
        later = [position[("generate", i, turn + 1)] for i in running]
        assert max(position[("tool", i, turn)] for i in running) < min(later)
    # Per sample: the quick sample is done with its three tool turns while the slow one still generates its first.
    results, log = _logged_batch(qwen_tokenizer, scripts, lockstep=False)
    assert [len(t.turns) for t in results] == [2, 4, 1]
    assert log.index(("generate", 1, 3)) < log.index(("tool", 0, 0))


def test_lockstep_survives_a_sample_that_fails(qwen_tokenizer):
    class Broken(Exception):
        pass

    scripts = [_tool_turns(0, [0.0, 0.0]), [(0.0, "done<|im_end|>")], _tool_turns(2, [0.1])]
    manager = get_tool_manager("qwen3", qwen_tokenizer)
    box = toolbox()
    prompt = manager.render_prompt([{"role": "user", "content": "hi"}], box.schemas())

    class FailingEngine:
        async def generate(self, prompt_token_ids, sampling):
            await asyncio.sleep(0.05)
            raise Broken("engine lost")

    class Engine:
        def __init__(self, replies):
            self.replies = list(replies)

        async def generate(self, prompt_token_ids, sampling):
            await asyncio.sleep(0.01)
            ids = qwen_tokenizer.encode(self.replies.pop(0), add_special_tokens=False)
            return ids, [-0.5] * len(ids)

    async def batch():
        barrier = TurnBarrier(3)
        engines = [Engine([call("calculator", expression="1+1") + "<|im_end|>"] * 2 + ["done<|im_end|>"]),
                   FailingEngine(), Engine(["done<|im_end|>"])]
        return await asyncio.gather(*(run_agent_loop(prompt, e, manager, box.run, SAMPLING, AgentLoopConfig(), barrier)
                                      for e in engines), return_exceptions=True)

    first, failed, last = asyncio.run(asyncio.wait_for(batch(), 30))  # no hang: the failed loop left the barrier
    assert isinstance(failed, Broken)
    assert len(first.turns) == 3 and first.stop_reason == "answer" and last.stop_reason == "answer"


def test_loop_through_the_ray_pool_survives_a_hung_tool(qwen_tokenizer, ray_session):
    from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig

    config = ToolPoolConfig(parse_tool_specs([{"class": "calculator"}, {"class": "rlf_fault_tools.HangingTool"}]),
                            num_actors=1, num_cpus_per_actor=0, max_concurrency=8, call_timeout_s=1.0)
    manager = get_tool_manager("qwen3", qwen_tokenizer)

    async def go():
        pool = ToolPool(config)
        schemas = await pool.start()
        try:
            prompt = manager.render_prompt([{"role": "user", "content": "hi"}], schemas)
            engine = ScriptedEngine(qwen_tokenizer, [call("hangs") + call("calculator", expression="6*7") + "<|im_end|>", "42<|im_end|>"])
            traj = await run_agent_loop(prompt, engine, manager, pool.call, SAMPLING, AgentLoopConfig())
            return traj, engine, pool.metrics()
        finally:
            await pool.close()

    traj, engine, metrics = asyncio.run(go())
    hung, calc = traj.turns[0].tool_calls
    assert hung.is_error and "timed out" in hung.observation and calc.observation == "42"
    assert traj.stop_reason == "answer" and "timed out after 1s" in qwen_tokenizer.decode(engine.requests[1][0])
    assert metrics["hangs"]["timeouts"] == 1 and metrics["calculator"]["calls"] == 1


class OddTextTool(BaseTool):
    name, description = "odd", "text with lone surrogates, as surrogateescape-decoded bytes give"

    async def execute(self, args):
        return ToolResult(b"caf\xe9 \xff ok".decode("utf-8", "surrogateescape") + "\ud800")


def test_a_tool_result_with_lone_surrogates_reaches_the_model_replaced(qwen_tokenizer):
    box = toolbox(extra_tools=[OddTextTool()])
    traj, _, _, _ = rollout(qwen_tokenizer, [call("odd") + "<|im_end|>", "ok<|im_end|>"], box)
    observation = traj.turns[0].tool_calls[0].observation
    assert observation == "caf\ufffd \ufffd ok\ufffd"
    assert traj.stop_reason == "answer" and traj.turns[0].observation_tokens > 0
    observation.encode("utf-8")  # stored and logged as UTF-8 from here on
