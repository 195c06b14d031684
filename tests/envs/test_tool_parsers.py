"""Tool-call parsing for each chat format: well-formed turns and every malformed case (never raises)."""
import json

import pytest

from rlfactory_megatron.envs.tool_manager import ParsedTurn, ToolCall, get_tool_parser

HERMES = ["qwen3", "qwen2_5"]


def hermes_block(name, arguments, key="arguments"):
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments}, ensure_ascii=False)}\n</tool_call>"


def llama_call(name, parameters):
    return json.dumps({"name": name, "parameters": parameters}, ensure_ascii=False)


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_single_call_and_content(fmt):
    turn = get_tool_parser(fmt).parse("Let me compute.\n" + hermes_block("calculator", {"expression": "1+2"}))
    assert turn == ParsedTurn("Let me compute.", [ToolCall("calculator", {"expression": "1+2"})], [])


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_several_calls_in_one_turn(fmt):
    text = hermes_block("search", {"query": "a"}) + "\n" + hermes_block("search", {"query": "b"}) + hermes_block("calculator", {"expression": "2"})
    turn = get_tool_parser(fmt).parse(text)
    assert [c.name for c in turn.tool_calls] == ["search", "search", "calculator"]
    assert [c.arguments for c in turn.tool_calls][:2] == [{"query": "a"}, {"query": "b"}]
    assert turn.errors == [] and turn.content == ""


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_call_after_think_runs_and_call_inside_think_does_not(fmt):
    inside = "<think>maybe " + hermes_block("search", {"query": "draft"}) + " no</think>"
    turn = get_tool_parser(fmt).parse(inside + "\nOK.\n" + hermes_block("search", {"query": "final"}))
    assert turn.tool_calls == [ToolCall("search", {"query": "final"})]
    assert turn.errors == []
    assert turn.content.startswith("<think>") and turn.content.endswith("OK.")


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_reasoning_opened_by_the_prompt(fmt):
    # Templates that open <think> in the prompt leave only "</think>" in the output.
    turn = get_tool_parser(fmt).parse("thinking " + hermes_block("a", {}) + "</think>" + hermes_block("b", {}))
    assert [c.name for c in turn.tool_calls] == ["b"]


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_call_inside_unclosed_think_is_an_error(fmt):
    turn = get_tool_parser(fmt).parse("<think>hmm " + hermes_block("search", {"query": "x"}))
    assert turn.tool_calls == [] and len(turn.errors) == 1 and "unclosed <think>" in turn.errors[0]


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_nested_and_unicode_arguments(fmt):
    args = {"filter": {"year": [2020, 2021], "meta": {"lang": "中文", "emoji": "🚀"}}, "q": "naïve café"}
    turn = get_tool_parser(fmt).parse(hermes_block("search", args))
    assert turn.tool_calls == [ToolCall("search", args)] and turn.errors == []


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_arguments_as_json_string(fmt):
    turn = get_tool_parser(fmt).parse(hermes_block("calculator", json.dumps({"expression": "3*3"})))
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "3*3"})] and turn.errors == []


@pytest.mark.parametrize("fmt", HERMES)
def test_hermes_lenient_json(fmt):
    text = "<tool_call>{'name': 'calculator', 'arguments': {'expression': '1+1', 'exact': true,},}</tool_call>"
    turn = get_tool_parser(fmt).parse(text)
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "1+1", "exact": True})] and turn.errors == []


MALFORMED_HERMES = {
    "unclosed block": ('<tool_call>{"name": "calculator", "arguments": {}}', "unclosed <tool_call>"),
    "block left open before the next": (
        '<tool_call>{"name": "a"}<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "unclosed <tool_call>"
    ),
    "invalid json": ("<tool_call>{name: calculator, arguments: }</tool_call>", "not valid JSON"),
    "truncated json": ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+</tool_call>', "not valid JSON"),
    "empty block": ("<tool_call></tool_call>", "not valid JSON"),
    "missing name": ('<tool_call>{"arguments": {"x": 1}}</tool_call>', 'no "name"'),
    "name not a string": ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', 'no "name"'),
    "not an object": ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    "arguments a non-object string": ('<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>', "does not hold a JSON object"),
    "arguments a list": ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "must be a JSON object"),
    "unknown tool": ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
    "stray close tag": ("done</tool_call>", "no matching <tool_call>"),
}


@pytest.mark.parametrize("fmt", HERMES)
@pytest.mark.parametrize("case", sorted(MALFORMED_HERMES))
def test_hermes_malformed_output_becomes_an_error(fmt, case):
    text, message = MALFORMED_HERMES[case]
    turn = get_tool_parser(fmt, tool_names=["calculator", "search"]).parse(text)
    assert any(message in e for e in turn.errors), turn.errors
    assert all(c.name in ("calculator", "search") for c in turn.tool_calls)


def test_hermes_valid_call_survives_a_broken_one():
    text = "<tool_call>{oops}</tool_call>" + hermes_block("calculator", {"expression": "2"})
    turn = get_tool_parser("qwen3").parse(text)
    assert turn.tool_calls == [ToolCall("calculator", {"expression": "2"})] and len(turn.errors) == 1


def test_llama3_single_call_plain_and_with_python_tag():
    parser = get_tool_parser("llama3")
    plain = parser.parse(llama_call("calculator", {"expression": "6*7"}))
    tagged = parser.parse("<|python_tag|>" + llama_call("calculator", {"expression": "6*7"}) + "<|eom_id|>")
    for turn in (plain, tagged):
        assert turn == ParsedTurn("", [ToolCall("calculator", {"expression": "6*7"})], [])


def test_llama3_several_calls_and_answer_text():
    parser = get_tool_parser("llama3")
    text = "Checking.<|python_tag|>" + llama_call("search", {"query": "a"}) + "; " + llama_call("search", {"query": "b"})
    turn = parser.parse(text)
    assert turn.content == "Checking." and [c.arguments["query"] for c in turn.tool_calls] == ["a", "b"]
    assert parser.parse("The answer is 42.<|eot_id|>") == ParsedTurn("The answer is 42.")
    newline_separated = parser.parse(llama_call("a", {}) + "\n" + llama_call("b", {}))
    assert [c.name for c in newline_separated.tool_calls] == ["a", "b"]


def test_llama3_nested_unicode_string_arguments_and_arguments_key():
    args = {"where": {"city": "Zürich", "tags": ["日本", {"deep": [1, {"x": None}]}]}}
    parser = get_tool_parser("llama3")
    assert parser.parse(llama_call("search", args)).tool_calls == [ToolCall("search", args)]
    as_string = json.dumps({"name": "search", "parameters": json.dumps(args)})
    assert parser.parse(as_string).tool_calls == [ToolCall("search", args)]
    openai_key = json.dumps({"name": "search", "arguments": args})
    assert parser.parse(openai_key).tool_calls == [ToolCall("search", args)]


def test_llama3_think_prefix_is_content():
    # Llama 3 has no reasoning tags; text before the python tag is the turn's content.
    turn = get_tool_parser("llama3").parse("<think>plan</think><|python_tag|>" + llama_call("search", {"query": "x"}))
    assert turn.content == "<think>plan</think>" and turn.tool_calls[0].name == "search"


MALFORMED_LLAMA = {
    "unclosed object": ('{"name": "calculator", "parameters": {"expression": "1"}', "not valid JSON"),
    "invalid json": ("<|python_tag|>{name: calculator}", "not valid JSON"),
    "tag without call": ("<|python_tag|>   ", "no JSON tool call"),
    "missing name": ('{"parameters": {"expression": "1"}}', 'no "name"'),
    "parameters a non-object string": ('{"name": "calculator", "parameters": "1+1"}', "does not hold a JSON object"),
    "parameters a number": ('{"name": "calculator", "parameters": 3}', "must be a JSON object"),
    "unknown tool": ('{"name": "format_disk", "parameters": {}}', "unknown tool 'format_disk'"),
    "garbage after a call": ('{"name": "calculator", "parameters": {}} and then {broken', "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_LLAMA))
def test_llama3_malformed_output_becomes_an_error(case):
    text, message = MALFORMED_LLAMA[case]
    turn = get_tool_parser("llama3", tool_names=["calculator"]).parse(text)
    assert any(message in e for e in turn.errors), turn.errors


@pytest.mark.parametrize("fmt", HERMES + ["llama3"])
@pytest.mark.parametrize(
    "text",
    ["", "<tool_call>", "</tool_call>", "<think>", "</think>", "{", "[", "<|python_tag|>", '{"name": ' * 2000,
     "<tool_call>" + "[" * 5000 + "</tool_call>", "\x00\udcff", "<tool_call>{'name': 'a', 'arguments': {1: 2}}</tool_call>"],
)
def test_parsers_never_raise(fmt, text):
    turn = get_tool_parser(fmt).parse(text)
    assert isinstance(turn, ParsedTurn)


def test_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match="qwen3"):
        get_tool_parser("gpt5")
