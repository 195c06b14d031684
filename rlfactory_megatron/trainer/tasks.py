"""Built-in tasks: prompts with ground truth (and demonstrations for an optional SFT warm-start)."""
from __future__ import annotations

import json
import random

from rlfactory_megatron.trainer.data import PromptRecord

SYSTEM = "Use the calculator tool, then answer with #### and the number."


def calculator_arithmetic(count: int, seed: int) -> list[PromptRecord]:
    """'What is a op b?' problems whose answer the policy should get from the calculator tool."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["+", "-", "*"])
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        records.append(PromptRecord(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} {op} {b}?"}],
            ground_truth=str(answer), data_source="calculator_arithmetic",
            extra={"expression": f"{a}{op}{b}"}))
    return records


def calculator_demonstration(record: PromptRecord) -> list[dict]:
    """The assistant/tool turns a good policy produces for `record` (Hermes-style tool call)."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": record.extra["expression"]}})
    return [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": record.ground_truth},
        {"role": "assistant", "content": f"#### {record.ground_truth}"},
    ]


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Text the tiny tokenizer is trained on, so the task's strings are few tokens."""
    corpus = [SYSTEM, "<tool_call>", "</tool_call>", '{"name": "calculator", "arguments": {"expression": "']
    for record in calculator_arithmetic(200, seed):
        corpus.append(record.messages[1]["content"])
        corpus.extend(turn["content"] for turn in calculator_demonstration(record))
    return corpus


BUILTIN_TASKS = {"calculator_arithmetic": calculator_arithmetic}
