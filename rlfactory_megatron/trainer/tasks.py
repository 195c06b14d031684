"""Built-in tasks: prompts with ground truth, the tools they need, and demonstrations for an
optional SFT warm-start. `trainer.task` names one when `trainer.data_path` is not given."""
from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from rlfactory_megatron.envs.tools.registry import ToolSpec, load_tool_specs, parse_tool_specs
from rlfactory_megatron.registry import Registry
from rlfactory_megatron.rollout.prompts import PromptRecord


@dataclass(frozen=True)
class Task:
    make_records: Callable[[int, int], list[PromptRecord]]  # (count, seed) -> prompts with ground truth
    demonstration: Callable[[PromptRecord], list[dict]]  # the assistant/tool turns a good policy produces
    tools: tuple[dict, ...]  # tool pool entries ({"class": ...}) the task needs
    train_prompts: int = 512  # the training prompts a run draws (the held-out ones are a fresh draw)

    def records(self, count: int, seed: int) -> list[PromptRecord]:
        """Prompts with ground truth and their demonstrations attached."""
        records = self.make_records(count, seed)
        for record in records:
            record.demonstration = self.demonstration(record)
        return records

    def conversations(self, count: int, seed: int) -> list[tuple[list[dict], list[dict]]]:
        """(prompt messages, demonstration turns) pairs: tokenizer training text."""
        return [(r.messages, r.demonstration) for r in self.records(count, seed)]


TASKS: Registry[Task] = Registry("built-in task")

CALCULATOR_SYSTEM = "Use the calculator tool, then answer with #### and the number."
# Share of the demonstrations that call the calculator; the others answer straight away (right,
# as someone who did the sum in their head would). A policy warm-started on them calls the tool
# about this often and, being too small to do arithmetic itself, is mostly wrong when it does
# not: what RL has to discover is that the tool call pays. Below one half, so that greedy
# decoding answers straight away on every seed (held-out accuracy starts at ~0, not at a coin
# flip of the warm-start's numerics), while sampling at temperature 0.7 still calls the tool in
# about one sample in five: most groups of 8 hold a call to learn from.
CALCULATOR_TOOL_DEMO_SHARE = 0.3


def calculator_arithmetic(count: int, seed: int) -> list[PromptRecord]:
    """'What is a op b?' problems whose answer the policy should get from the calculator tool.
    Two-digit operands: every prompt has the same length, so copying them into the tool call is
    a fixed-offset copy, which a tiny model learns within a short warm-start."""
    rng = random.Random(seed)
    demo_rng = random.Random(f"{seed}:demonstrations")  # the prompts stay those of the seed alone
    records = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = rng.choice(["+", "-", "*"])
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        records.append(PromptRecord(
            messages=[{"role": "system", "content": CALCULATOR_SYSTEM},
                      {"role": "user", "content": f"What is {a} {op} {b}?"}],
            ground_truth=str(answer), data_source="calculator_arithmetic",
            extra={"expression": f"{a}{op}{b}", "demo_calls_tool": demo_rng.random() < CALCULATOR_TOOL_DEMO_SHARE}))
    return records


def calculator_demonstration(record: PromptRecord) -> list[dict]:
    """One Hermes-style calculator call, its result, and the answer line the gsm8k scorer reads;
    or, for the demonstrations that skip the tool, the answer line alone."""
    if not record.extra.get("demo_calls_tool", True):
        return [{"role": "assistant", "content": f"#### {record.ground_truth}"}]
    call = json.dumps({"name": "calculator", "arguments": {"expression": record.extra["expression"]}})
    return [
        {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": record.ground_truth},
        {"role": "assistant", "content": f"#### {record.ground_truth}"},
    ]


# A short tool description: the tiny model reads the whole schema in every prompt.
TASKS.register("calculator_arithmetic", Task(calculator_arithmetic, calculator_demonstration, tools=(
    {"class": "calculator", "description": "Evaluate an arithmetic expression."},)))


# The template a judge taught on trainer.task=calculator_judge reads (reward.model.template of the
# run it judges): short, so that the tiny model learns to compare the answer with the reference
# within a short SFT; one line with no ": ", so that it passes as a command-line override.
CALCULATOR_JUDGE_TEMPLATE = "Answer {response} Reference {ground_truth}"
# The end-of-turn marker a Qwen-format policy's response text keeps after each of its turns (the
# generator decodes the generated tokens, stop tokens included); half the judge's examples have it.
QWEN_TURN_END = "<|im_end|>"


def calculator_response(record: PromptRecord, rng: random.Random) -> str:
    """A response to a calculator prompt as the policy writes them: with or without the tool call
    and the end-of-turn markers, half of them right, now and then with no answer line."""
    truth = int(record.ground_truth)
    turns = []
    if rng.random() < 0.5:
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", record.extra["expression"]).groups()
        if rng.random() < 0.2:  # a miscopied operand
            a = str(int(a) + rng.choice([-10, -1, 1, 10]))
        turns.append("<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": a + op + b}})
                     + "\n</tool_call>")
    kind = rng.random()
    if kind < 0.5:
        answer = truth
    elif kind < 0.7:
        answer = truth + rng.choice([-100, -10, -2, -1, 1, 2, 10, 100])
    elif kind < 0.8:
        answer = -truth if truth else 1
    else:
        answer = rng.randint(-99, 9801)
    turns.append(f"#### {answer}" if rng.random() > 0.05 else str(answer))
    end = QWEN_TURN_END if rng.random() < 0.5 else ""
    return "".join(turn + end for turn in turns)


def calculator_judge(count: int, seed: int) -> list[PromptRecord]:
    """Judge prompts (CALCULATOR_JUDGE_TEMPLATE) over responses to the calculator task, labelled
    by the rule that scores that task (gsm8k, strict): ground truth "1" or "0"."""
    from rlfactory_megatron.rewards.judge import JudgePrompt
    from rlfactory_megatron.rewards.records import RewardSample
    from rlfactory_megatron.rewards.scorers import get_scorer

    rule, prompt = get_scorer("gsm8k"), JudgePrompt(CALCULATOR_JUDGE_TEMPLATE)
    rng = random.Random(f"{seed}:responses")
    records = []
    for task in calculator_arithmetic(count, seed):
        response = calculator_response(task, rng)
        label = int(rule(response, task.ground_truth))
        sample = RewardSample(task.data_source, response, task.ground_truth, prompt=task.messages[-1]["content"])
        records.append(PromptRecord(messages=prompt.messages(sample), ground_truth=str(label),
                                    data_source="calculator_judge",
                                    extra={"response": response, "reference": task.ground_truth}))
    return records


def calculator_judge_demonstration(record: PromptRecord) -> list[dict]:
    """The judge's reply: the response's final answer (as the gsm8k rule reads it) and the
    reference side by side, a character of each per cell with a mark (`=` the same, `x` not; `_`
    past the shorter one's end), then the score: `11= 10x 09x <score>0</score>` for 110 against
    109. Each mark compares two adjacent tokens, which a tiny judge learns within a short SFT;
    taught only the score, it learned the answer line's form and length and scored most wrong
    answers of the right length 1 (agreement 0.73-0.77; with the marks 1.0, docs/rewards.md)."""
    from rlfactory_megatron.rewards.scorers.gsm8k import extract_answer

    score = f"<score>{record.ground_truth}</score>"
    answer = extract_answer(record.extra["response"])
    if answer is None:
        return [{"role": "assistant", "content": f"none {score}"}]
    reference = record.extra["reference"]
    cells = []
    for i in range(max(len(answer), len(reference))):
        mine = answer[i] if i < len(answer) else "_"
        theirs = reference[i] if i < len(reference) else "_"
        cells.append(f"{mine}{theirs}{'=' if mine == theirs else 'x'}")
    return [{"role": "assistant", "content": f"{' '.join(cells)} {score}"}]


# train_prompts: a fresh response at nearly every draw of a warm-start, so that the judge generalizes.
TASKS.register("calculator_judge", Task(calculator_judge, calculator_judge_demonstration, tools=(), train_prompts=8192))


def run_tool_specs(cfg) -> list[ToolSpec]:
    """The tools a run declares: the YAML file tools.config_path names, else its built-in
    task's (trainer.task), else none."""
    if cfg.tools.config_path:
        return load_tool_specs(cfg.tools.config_path)
    if cfg.trainer.task is None:  # a user's own data without a tools file has no tools
        return []
    return parse_tool_specs([dict(tool) for tool in TASKS.get(cfg.trainer.task).tools])


def tokenizer_corpus(task: str = "calculator_arithmetic", seed: int = 0) -> list[str]:
    """The task's own text, so that a tokenizer trained on it keeps prompts and answers short.
    Whole rendered conversations are added by the tokenizer builder (they need a chat template)."""
    corpus = []
    for messages, turns in TASKS.get(task).conversations(200, seed):
        corpus.extend(m["content"] for m in messages)
        corpus.extend(turn["content"] for turn in turns)
    return corpus
