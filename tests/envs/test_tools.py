"""Built-in tools (calculator, search), schema validation, the registry and YAML declarations."""
import asyncio
import json

import pytest

from rlfactory_megatron.envs.tools import BaseTool, ToolBox, ToolResult, load_tool_specs, parse_tool_specs
from rlfactory_megatron.envs.tools.bm25 import BM25Index
from rlfactory_megatron.envs.tools.calculator import CalculatorTool
from rlfactory_megatron.envs.tools.search import SearchTool


def run(tool, args):
    return asyncio.run(tool.run(args))


@pytest.mark.parametrize(
    "expression, expected",
    [("2 + 3 * 4", "14"), ("(1 + 2) ** 10", "59049"), ("sqrt(16) / 2", "2"), ("2 ** -1", "0.5"),
     ("-7 // 2", "-4"), ("round(pi, 3)", "3.142"), ("max(1, 9, 4) % 5", "4"), ("10 / 4", "2.5")],
)
def test_calculator_arithmetic(expression, expected):
    result = run(CalculatorTool(), {"expression": expression})
    assert (result.text, result.is_error) == (expected, False)


@pytest.mark.parametrize(
    "expression, message",
    [("__import__('os').system('true')", "unsupported"), ("open('/etc/passwd')", "unsupported"),
     ("(1).__class__", "unsupported"), ("9 ** 9 ** 9", "too large"), ("1 / 0", "division"),
     ("sqrt(-1)", "math domain"), ("2 +", "not an arithmetic"), ("'a' * 3", "unsupported"), ("x", "unsupported")],
)
def test_calculator_rejects_without_eval(expression, message):
    result = run(CalculatorTool(), {"expression": expression})
    assert result.is_error and message in result.text


def test_arguments_are_validated_against_the_schema():
    result = run(CalculatorTool(), {"expr": "1"})
    assert result.is_error and result.metadata["error_kind"] == "invalid_arguments" and "expression" in result.text
    assert run(CalculatorTool(), {"expression": 5}).metadata["error_kind"] == "invalid_arguments"


def test_tool_exceptions_become_error_results():
    class Broken(BaseTool):
        name, description = "broken", "raises"

        async def execute(self, args):
            raise KeyError("missing")

    result = run(Broken(), {})
    assert result.is_error and "KeyError" in result.text and result.metadata["error_kind"] == "exception"


def test_bm25_ranks_by_term_weight():
    index = BM25Index(["the cat sat", "the dog ran far away", "cat cat cat", "unrelated text"])
    ranked = [doc for doc, _ in index.search("cat", 5)]
    assert ranked == [2, 0]
    assert index.search("the dog", 1)[0][0] == 1
    assert index.search("zebra", 3) == []


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    docs = [
        {"id": "paris", "title": "Paris", "text": "Paris is the capital of France."},
        {"id": "berlin", "title": "Berlin", "text": "Berlin is the capital of Germany."},
        {"id": "rhine", "title": "Rhine", "text": "The Rhine flows through Germany and the Netherlands."},
    ]
    path.write_text("\n".join(json.dumps(d) for d in docs))
    return path


def test_search_tool_returns_best_passages(corpus):
    tool = SearchTool(corpus=str(corpus), top_k=2)
    result = run(tool, {"query": "capital of Germany"})
    assert result.metadata["doc_ids"][0] == "berlin" and len(result.metadata["doc_ids"]) == 2
    assert result.text.startswith("[1] Berlin: Berlin is the capital")
    assert run(tool, {"query": "Germany", "top_k": 1}).metadata["doc_ids"] in (["rhine"], ["berlin"])
    assert run(tool, {"query": "zzz"}).text == "no results"
    assert run(tool, {"query": ""}).is_error


def test_search_tool_names_a_missing_corpus(tmp_path):
    with pytest.raises(ValueError, match="corpus"):
        SearchTool(corpus=str(tmp_path / "nope.jsonl"))


def test_tools_from_yaml(tmp_path, corpus):
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        "  - class: calculator\n"
        "  - class: search\n"
        f"    params: {{corpus: {corpus}, top_k: 1}}\n"
        "  - class: rlfactory_megatron.envs.tools.diagnostic.SleepTool\n"
        "    params: {latency_s: 0.0}\n"
    )

    async def go():
        box = await ToolBox.build(load_tool_specs(path))
        names = sorted(box.tools)
        results = [await box.run("calculator", {"expression": "6*7"}), await box.run("nope", {})]
        await box.close()
        return names, box.schemas(), results

    names, schemas, (ok, unknown) = asyncio.run(go())
    assert names == ["calculator", "search", "sleep"]
    assert {s["function"]["name"] for s in schemas} == set(names)
    assert ok == ToolResult("42") and unknown.is_error and "calculator" in unknown.text


@pytest.mark.parametrize(
    "config, message",
    [({"tools": [{"params": {}}]}, r"tools\[0\]: needs a 'class'"),
     ({"tools": [{"class": "calculator", "params": [1]}]}, r"tools\[0\].params must be a mapping"),
     ({"tools": "calculator"}, "must be a list")],
)
def test_bad_tool_config_names_the_entry(config, message):
    with pytest.raises(ValueError, match=message):
        parse_tool_specs(config)


@pytest.mark.parametrize(
    "entries, message",
    [([{"class": "no_such_tool"}], "unknown tool class"),
     ([{"class": "rlfactory_megatron.envs.tools.Missing"}], "cannot be imported"),
     ([{"class": "calculator"}, {"class": "calculator"}], "declared twice"),
     ([{"class": "sleep", "params": {"latency": 1}}], r"tools\[0\] \(sleep\): bad params")],
)
def test_bad_tool_declarations_fail_before_use(entries, message):
    with pytest.raises(ValueError, match=message):
        asyncio.run(ToolBox.build(parse_tool_specs(entries)))


def test_yaml_description_replaces_what_the_model_is_shown():
    specs = parse_tool_specs([{"class": "calculator", "description": "Add and multiply."}])
    box = asyncio.run(ToolBox.build(specs))
    assert box.schemas()[0]["function"]["description"] == "Add and multiply."
    assert "sqrt" in asyncio.run(ToolBox.build(parse_tool_specs([{"class": "calculator"}]))).schemas()[0]["function"]["description"]
    with pytest.raises(ValueError, match=r"tools\[0\].description must be a string"):
        parse_tool_specs([{"class": "calculator", "description": 3}])
