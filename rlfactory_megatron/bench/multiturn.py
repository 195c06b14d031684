"""The multi-turn tool workload of `rlf-bench e2e --workload tools`: the tiny model taught to write
a few words, call a calculator whose every call takes 50 ms, read its result, and call again or
answer, with long-tailed turn lengths.

Each taught trajectory: filler words of a geometric length (mean `turn_mean` tokens), then a
Hermes-style `<tool_call>` of the prompt's expression and end of turn; the tool's result (not
trained); with chance `again`, another such turn (at most `max_calls` calls); then filler and the
`#### <answer>` line. Lengths are memoryless, as in the longtail workload, so the model learns a
constant stop chance per token and a constant chance to call again.

Both sides use one calculator: ours as a tool class of the Ray tool pool (`SlowCalculator`, not
cacheable, so every call waits), TRL's as the async function `calculator` its GRPOTrainer is given;
`tool_prompt_check` makes sure both render the same prompt.
"""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

from rlfactory_megatron.bench.longtail import filler_ids, geometric_length, teach
from rlfactory_megatron.envs.tools.base import ToolResult
from rlfactory_megatron.envs.tools.calculator import CalculatorTool, evaluate, format_number

TOOL_LATENCY_S = 0.05
TOOL_DESCRIPTION = "Evaluate an arithmetic expression."  # the built-in task's, so the prompts match the default run's


class SlowCalculator(CalculatorTool):
    """The calculator, `latency_s` slower per call (a remote service's round trip)."""

    def __init__(self, latency_s: float = TOOL_LATENCY_S):
        self.latency_s = latency_s

    async def execute(self, args: dict[str, Any]) -> ToolResult:
        await asyncio.sleep(self.latency_s)
        return await super().execute(args)


async def calculator(expression: str):  # no return annotation: it would add "return" to the schema ours has not
    """
    Evaluate an arithmetic expression.

    Args:
        expression: e.g. (3 + 4) * 2 / sqrt(16)
    """
    await asyncio.sleep(TOOL_LATENCY_S)
    try:
        return format_number(evaluate(expression))
    except (ValueError, ArithmeticError, TypeError) as exc:
        return f"error: {exc}"


def tool_config(path: Path, latency_s: float = TOOL_LATENCY_S) -> Path:
    """Our side's tools file (tools.config_path): the slow calculator under the calculator's name."""
    path.write_text(json.dumps({"tools": [{
        "class": f"{__name__}:SlowCalculator", "params": {"latency_s": latency_s},
        "cacheable": False, "description": TOOL_DESCRIPTION}]}))
    return path


def our_tool_schemas() -> list[dict]:
    """The schemas our tool pool shows the model for `tool_config`'s tools."""
    from rlfactory_megatron.envs.tools import ToolBox, ToolSpec

    spec = ToolSpec(f"{__name__}:SlowCalculator", {"latency_s": 0.0}, cacheable=False, description=TOOL_DESCRIPTION)
    return asyncio.run(ToolBox.build([spec])).schemas()


def tool_prompt_check(tokenizer, messages: list[dict]) -> None:
    """Both sides must show the model the same prompt: ours renders our tool pool's schema, TRL
    renders the schema transformers derives from `calculator`'s signature and docstring."""
    ours = tokenizer.apply_chat_template(messages, tools=our_tool_schemas(), add_generation_prompt=True, tokenize=False)
    trl = tokenizer.apply_chat_template(messages, tools=[calculator], add_generation_prompt=True, tokenize=False)
    if ours != trl:
        raise RuntimeError(f"the tools workload's prompts differ between the sides:\nours: {ours!r}\nTRL:  {trl!r}")


def _examples(tokenizer, records, count: int, turn_mean: float, again: float, max_calls: int, limit: int,
              seed: int):
    """(token ids, trained mask) pairs of taught trajectories, rendered the way the agent loop
    appends turns and observations (qwen3 format)."""
    from rlfactory_megatron.envs.tool_manager import get_tool_manager

    manager = get_tool_manager("qwen3", tokenizer)
    schemas = our_tool_schemas()
    rng = random.Random(seed)
    end = [tokenizer.eos_token_id]
    out = []
    for index in range(count):
        record = records[index % len(records)]
        ids = manager.render_prompt(record.messages, schemas)
        trained = [0] * len(ids)
        response = 0
        calls = 0
        while True:
            words = filler_ids(tokenizer, rng, geometric_length(rng, turn_mean, limit))
            if calls == 0 or (calls < max_calls and rng.random() < again):
                call = json.dumps({"name": "calculator", "arguments": {"expression": record.extra["expression"]}})
                turn = words + tokenizer.encode(f"\n<tool_call>\n{call}\n</tool_call>", add_special_tokens=False) + end
                observation = manager.render_observation([record.ground_truth])
            else:
                turn, observation = words + tokenizer.encode(f" #### {record.ground_truth}", add_special_tokens=False) + end, []
            ids, trained = ids + turn + observation, trained + [1] * len(turn) + [0] * len(observation)
            response += len(turn) + len(observation)
            calls += 1
            if not observation or response >= limit:
                break
        out.append((ids, trained))
    return out


def make_tool_model(hf_dir: str | Path, records, turn_mean: float = 32.0, again: float = 0.5, max_calls: int = 3,
                    limit: int = 512, steps: int = 300, batch: int = 32, lr: float = 3e-3, seed: int = 0,
                    cache: Path | None = None, verbose: bool = True) -> Path:
    """A copy of the HF model at `hf_dir` taught the multi-turn calculator trajectories; returns its folder."""
    recipe = {"prompts": [r.messages for r in records], "turn_mean": turn_mean, "again": again,
              "max_calls": max_calls, "limit": limit, "latency_s": TOOL_LATENCY_S, "version": 1}
    return teach(hf_dir, "tools", recipe,
                 lambda tokenizer: _examples(tokenizer, records, steps * batch, turn_mean, again, max_calls, limit, seed),
                 steps=steps, batch=batch, lr=lr, seed=seed, cache=cache, verbose=verbose)
