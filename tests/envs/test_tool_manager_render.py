"""Prompt and observation rendering through a chat template, and observation truncation."""
import json

import pytest

from rlfactory_megatron.envs.tool_manager import get_tool_manager, truncate_observation
from rlfactory_megatron.envs.tools.calculator import CalculatorTool
from rlfactory_megatron.rollout.engines import SamplingConfig

TOOLS = [CalculatorTool().schema()]
CASES = {
    "qwen3": ("qwen_tokenizer", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>', "<|im_end|>"),
    "qwen2_5": ("qwen_tokenizer", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>', "<|im_end|>"),
    "llama3": ("llama3_tokenizer", '<|python_tag|>{"name": "calculator", "parameters": {"expression": "12*7"}}', "<|eot_id|>"),
}


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_prompt_lists_tool_schemas(fmt, request):
    tokenizer_fixture, _, _ = CASES[fmt]
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    manager = get_tool_manager(fmt, tokenizer)
    ids = manager.render_prompt([{"role": "user", "content": "What is 12 times 7?"}], TOOLS)
    text = tokenizer.decode(ids)
    assert json.dumps(TOOLS[0]) in text
    assert text.endswith(tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)[-12:])


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_prompt_turn_observation_tokens_spell_the_whole_conversation(fmt, request):
    """prompt + generated turn + observation == the template rendering of the full conversation,
    so the token stream the trainer sees is exactly what the model is prompted with."""
    tokenizer_fixture, generated, end_of_turn = CASES[fmt]
    tokenizer = request.getfixturevalue(tokenizer_fixture)
    manager = get_tool_manager(fmt, tokenizer, tool_names=["calculator"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 times 7?"}]

    prompt = manager.render_prompt(messages, TOOLS)
    turn = tokenizer.encode(generated + end_of_turn, add_special_tokens=False)
    parsed = manager.parse(tokenizer.decode(turn))
    assert [c.arguments for c in parsed.tool_calls] == [{"expression": "12*7"}]
    observation = manager.render_observation(["84", "ünïcode ✓"])

    full = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": generated}, {"role": "tool", "content": "84"},
                    {"role": "tool", "content": "ünïcode ✓"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=False,
    )
    assert tokenizer.decode(prompt + turn + observation) == full


def test_observation_needs_a_matching_end_of_turn_marker(llama3_tokenizer):
    manager = get_tool_manager("qwen3", llama3_tokenizer)
    with pytest.raises(ValueError, match="end-of-turn"):
        manager.render_observation(["x"])


def test_truncate_observation_by_characters_and_tokens(qwen_tokenizer):
    assert truncate_observation("short", 100) == "short"
    big = "x" * (1 << 20)
    cut = truncate_observation(big, 1000)
    assert cut.startswith("x" * 1000) and "truncated" in cut and str((1 << 20) - 1000) in cut
    cut_tokens = truncate_observation(big, 50, qwen_tokenizer)
    assert len(qwen_tokenizer.encode(cut_tokens.split("\n...[truncated")[0], add_special_tokens=False)) <= 50
    assert cut_tokens.endswith("more characters not shown]")
    assert truncate_observation("84", 50, qwen_tokenizer) == "84"


def test_end_of_turn_has_one_owner_per_format(qwen_tokenizer, llama3_tokenizer):
    # Generation stops, demonstrations end and open turns are closed by the same markers.
    llama = get_tool_manager("llama3", llama3_tokenizer)
    eot, eom = llama3_tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|eom_id|>"])
    assert set(llama.stop_token_ids()) == {eot, eom} and llama.turn_end == "<|eot_id|>"
    qwen = get_tool_manager("qwen3", qwen_tokenizer)
    assert qwen.stop_token_ids() == [qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")] and qwen.turn_end == "<|im_end|>"


def test_a_llama3_turn_ended_by_eom_is_a_tool_call_turn(llama3_tokenizer):
    import asyncio

    from rlfactory_megatron.envs.agent_loop import AgentLoopConfig, run_agent_loop
    from rlfactory_megatron.envs.tools import ToolBox, parse_tool_specs

    box = asyncio.run(ToolBox.build(parse_tool_specs([{"class": "calculator"}])))
    manager = get_tool_manager("llama3", llama3_tokenizer, tool_names=["calculator"])
    replies = ['<|python_tag|>{"name": "calculator", "parameters": {"expression": "12*7"}}<|eom_id|>', "#### 84<|eot_id|>"]

    class Scripted:
        async def generate(self, prompt_ids, sampling):
            assert set(manager.stop_token_ids()) <= set(sampling.stop_token_ids)
            ids = llama3_tokenizer.encode(replies.pop(0), add_special_tokens=False)
            return ids, [-0.1] * len(ids)

    prompt = manager.render_prompt([{"role": "user", "content": "What is 12 times 7?"}], box.schemas())
    sampling = SamplingConfig(temperature=1.0, max_tokens=64, stop_token_ids=manager.stop_token_ids())
    traj = asyncio.run(run_agent_loop(prompt, Scripted(), manager, box.run, sampling, AgentLoopConfig()))
    assert traj.stop_reason == "answer" and len(traj.turns) == 2
    assert traj.turns[0].tool_calls[0].observation == "84" and not traj.turns[0].parse_errors
