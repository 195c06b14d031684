"""Multi-turn agent loop, one coroutine per sample: generate -> parse -> run tool calls concurrently ->
append observation tokens (loss_mask 0) -> generate, until an answer, `max_turns` or the token budget.

Each sample takes its next turn as soon as its own tool results are back, so one sample's tool
latency overlaps the others' generation. A `TurnBarrier` shared by a batch's loops instead holds
the turns in lock-step (every sample generates turn k, then all run their tools, then turn k + 1:
how RL-Factory and other batch-synchronous agent loops run), for comparison (`tools.turn_schedule`)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

import numpy as np

from rlfactory_megatron.envs.tool_manager import ToolManager, truncate_observation
from rlfactory_megatron.envs.tools import ToolResult
from rlfactory_megatron.registry import Registry

if TYPE_CHECKING:
    from rlfactory_megatron.rollout.engines import SamplingConfig

RunTool = Callable[[str, dict[str, Any]], Awaitable[ToolResult]]


class Completion(tuple):
    """One request's answer: unpacks as `(token_ids, log_probs)`. An engine recording its routes
    (routing replay R3) also gives `routes` ([positions, layers, top-k]: the experts each position of
    the prompt and of the sampled tokens but the last took, -1 where unknown), by attribute only, as
    `os.stat_result` keeps fields beyond its tuple: every caller that unpacks a pair still does."""

    routes: np.ndarray | None

    def __new__(cls, token_ids: list[int], log_probs: list[float], routes: np.ndarray | None = None) -> "Completion":
        done = super().__new__(cls, (list(token_ids), list(log_probs)))
        done.routes = routes
        return done

    def __reduce__(self):  # crosses processes (a Ray-hosted engine's stream) with its routes
        return Completion, (*self, self.routes)


def merge_routes(known: np.ndarray | None, new: np.ndarray | None) -> np.ndarray | None:
    """The routes of one conversation over its engine calls: each position keeps those of the first
    call that computed it (whose forward sampled the token after it), later calls add the positions
    they computed beyond (a turn's own tokens, the observation before it)."""
    if known is None or new is None:
        return new if known is None else known
    merged = np.full((max(len(known), len(new)), *known.shape[1:]), -1, dtype=known.dtype)
    merged[: len(new)] = new
    computed = (known >= 0).all(axis=(1, 2))
    merged[: len(known)][computed] = known[computed]
    return merged


class Front(Protocol):
    """Per-request generation: an engine's asyncio front (`rlfactory_megatron.rollout.fronts.serving`),
    the router's session that picks the engine, or anything else that answers one request."""

    async def generate(self, prompt_token_ids: list[int], sampling: "SamplingConfig") -> Completion: ...


@dataclass
class AgentLoopConfig:
    max_turns: int = 5
    max_response_tokens: int = 4096  # everything after the prompt: generated and observation tokens
    tool_response_max_tokens: int = 512


@dataclass
class ToolCallRecord:
    name: str
    arguments: dict[str, Any]
    observation: str  # what the model saw (after truncation)
    is_error: bool
    metadata: dict[str, Any]
    latency_s: float


@dataclass
class TurnRecord:
    text: str
    num_tokens: int
    content: str
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    observation_tokens: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]  # 1 on generated tokens, 0 on observation tokens
    logprobs: list[float]  # rollout log-probs of generated tokens; 0.0 on observation tokens
    turns: list[TurnRecord]
    stop_reason: str  # "answer" | "max_turns" | "token_budget"
    # The engine's routes of every position but the last (routing replay R3; merge_routes), else None.
    routes: np.ndarray | None = None

    @property
    def final_content(self) -> str:
        return self.turns[-1].content if self.turns else ""


class TurnBarrier:
    """Lock-step turns across the loops of a batch: a loop waits at each phase boundary (its turn
    generated; its tool results back) until every loop still running has reached it. A loop that
    ends leaves, so the others never wait for it."""

    def __init__(self, parties: int):
        self.parties = parties
        self.arrived = 0
        self.released = asyncio.Event()

    async def wait(self) -> None:
        self.arrived += 1
        released = self.released
        if self.arrived >= self.parties:
            self._release()
        else:
            await released.wait()

    def leave(self) -> None:
        self.parties -= 1
        if self.parties > 0 and self.arrived >= self.parties:
            self._release()

    def _release(self) -> None:
        self.released.set()
        self.released, self.arrived = asyncio.Event(), 0


# `tools.turn_schedule`: what a batch of `parties` loops shares to schedule its turns.
# per_sample: nothing, each trajectory takes its next turn as soon as its tool results are back;
# lockstep: a TurnBarrier.
TURN_SCHEDULES: Registry[Callable[[int], TurnBarrier | None]] = Registry("turn schedule")
TURN_SCHEDULES.register("per_sample", lambda parties: None)
TURN_SCHEDULES.register("lockstep", TurnBarrier)


async def run_agent_loop(
    prompt_ids: list[int],
    front: Front,
    manager: ToolManager,
    run_tool: RunTool,
    sampling: "SamplingConfig",
    config: AgentLoopConfig,
    barrier: TurnBarrier | None = None,
) -> Trajectory:
    """Roll out one sample. `run_tool` is `ToolPool.call` (Ray) or `ToolBox.run` (in process);
    `barrier` (shared by the batch's loops) holds the turns in lock-step."""
    try:
        return await _roll_out(prompt_ids, front, manager, run_tool, sampling, config, barrier)
    finally:
        if barrier is not None:
            barrier.leave()


async def _roll_out(prompt_ids, front, manager, run_tool, sampling, config, barrier) -> Trajectory:
    traj = Trajectory(list(prompt_ids), [], [], [], [], stop_reason="max_turns")
    for turn_index in range(config.max_turns):
        budget = config.max_response_tokens - len(traj.response_ids)
        if budget <= 0:
            traj.stop_reason = "token_budget"
            break
        # Same sampling every turn; only the length cap follows the remaining budget, and a seed
        # moves on per turn (a sample is then a function of its seed, whatever else is in flight).
        turn_sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, budget),
                                            seed=None if sampling.seed is None else sampling.seed + turn_index)
        start = time.perf_counter()
        done = await front.generate(traj.prompt_ids + traj.response_ids, turn_sampling)
        traj.routes = merge_routes(traj.routes, getattr(done, "routes", None))
        ids, logprobs = done
        ids, logprobs = ids[:budget], list(logprobs[:budget])
        _append(traj, ids, logprobs, trainable=True)
        text = manager.tokenizer.decode(ids)
        parsed = manager.parse(text)
        turn = TurnRecord(text, len(ids), parsed.content, parse_errors=parsed.errors,
                          generate_s=time.perf_counter() - start)
        traj.turns.append(turn)
        if not parsed.tool_calls and not parsed.errors:
            traj.stop_reason = "answer"
            break
        if turn_index == config.max_turns - 1:
            break  # no turn left to read the results in
        if len(traj.response_ids) >= config.max_response_tokens:
            traj.stop_reason = "token_budget"
            break
        if barrier is not None:
            await barrier.wait()  # every running sample has generated this turn
        turn.tool_calls, turn.tools_s = await _run_calls(parsed.tool_calls, run_tool, manager, config)
        if barrier is not None:
            await barrier.wait()  # every running sample has its tool results
        observations = [c.observation for c in turn.tool_calls] + [f"error: {e}" for e in parsed.errors]
        obs_ids = manager.render_observation(observations)
        if not manager.ends_turn(text):
            # The model stopped without closing its turn (stop string or length): close it for it.
            obs_ids = manager.tokenizer.encode(manager.turn_end_of(calls_tools=True), add_special_tokens=False) + obs_ids
        if len(traj.response_ids) + len(obs_ids) >= config.max_response_tokens:
            traj.stop_reason = "token_budget"
            break
        _append(traj, obs_ids, [0.0] * len(obs_ids), trainable=False)
        turn.observation_tokens = len(obs_ids)
    return traj


async def _run_calls(calls: list, run_tool: RunTool, manager: ToolManager, config: AgentLoopConfig) -> tuple[list[ToolCallRecord], float]:
    async def one(call) -> ToolCallRecord:
        start = time.perf_counter()
        result = await run_tool(call.name, call.arguments)
        observation = truncate_observation(result.text, config.tool_response_max_tokens, manager.tokenizer)
        return ToolCallRecord(call.name, call.arguments, observation, result.is_error, result.metadata,
                              time.perf_counter() - start)

    start = time.perf_counter()
    records = await asyncio.gather(*(one(c) for c in calls))
    return list(records), time.perf_counter() - start


def _append(traj: Trajectory, ids: list[int], logprobs: list[float], trainable: bool) -> None:
    traj.response_ids += ids
    traj.loss_mask += [int(trainable)] * len(ids)
    traj.logprobs += logprobs
