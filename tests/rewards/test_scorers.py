"""Each scorer on a table of cases per rule, tricky ones included."""
import pytest

from rlfactory_megatron.rewards import get_scorer
from rlfactory_megatron.rewards.scorers import DATA_SOURCES, SCORERS, default_compute_score
from rlfactory_megatron.rewards.scorers.gsm8k import TAIL_CHARS

GSM8K = [
    # (response, ground truth, kwargs, expected)
    ("so the answer is\n#### 72", "72", {}, 1.0),
    ("#### 71", "72", {}, 0.0),
    ("#### 71", "72", {"format_score": 0.1}, 0.1),
    ("the answer is 72", "72", {}, 0.0),  # strict needs ####
    ("the answer is 72", "72", {"format_score": 0.1}, 0.0),  # no answer at all: not even format
    ("#### -3", "-3", {}, 1.0),
    ("#### -3", "3", {}, 0.0),
    ("#### 2.5", "2.5", {}, 1.0),
    ("#### 1,000", "1000", {}, 1.0),
    ("#### $5", "5", {}, 1.0),
    ("#### 5\nwait, no\n#### 6", "6", {}, 1.0),  # the last one counts
    ("#### 5\nwait, no\n#### 6", "5", {}, 0.0),
    ("#### 72.0", "72", {}, 0.0),  # exact string match, as the reference rule
    ("#### 72.", "72", {}, 0.0),
    ("#### 7" + "x" * TAIL_CHARS, "7", {}, 0.0),  # outside the tail window
    ("x" * 1000 + "#### 7", "7", {}, 1.0),
    ("", "7", {}, 0.0),
    ("so it is 1,234.", "1234", {"method": "flexible"}, 1.0),
    ("first 3 then -4.5", "-4.5", {"method": "flexible"}, 1.0),
    ("costs $12 in total", "12", {"method": "flexible"}, 1.0),
    ("3 apples and 4 pears", "3", {"method": "flexible"}, 0.0),
    ("no number here", "3", {"method": "flexible", "format_score": 0.1}, 0.0),
    ("8 is wrong", "3", {"method": "flexible", "format_score": 0.1}, 0.1),
    ("7 " + "x" * TAIL_CHARS, "7", {"method": "flexible"}, 0.0),
]

MATH = [
    ("so \\boxed{5}", "5", 1.0),
    ("so \\boxed{6}", "5", 0.0),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac12", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("$\\boxed 5$", "5", 1.0),
    ("the answer is \\boxed 5.", "5", 1.0),
    ("\\boxed{-3}", "-3", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{3} no wait \\boxed{4}", "4", 1.0),
    ("\\boxed{3} no wait \\boxed{4}", "3", 0.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{x = 3}", "3", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{\\frac{1}{2}", "0.5", 0.0),  # unbalanced: no answer
    ("the answer is 5", "5", 0.0),  # no box
    ("", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("\\boxed{2}", "The solution ... so $\\boxed{2}$.", 1.0),  # boxed ground truth
    ("\\fbox{7}", "7", 1.0),
]

GEO3K = [
    ("<think>angles sum</think> so \\boxed{30}", "30", 1.0),
    ("<think>angles sum</think> so \\boxed{31}", "30", 0.1),
    ("so \\boxed{30}", "30", 0.9),
    ("<think>x</think> 30", "30", 0.0),
    ("", "30", 0.0),
    ("<think>x</think>\\boxed{\\frac{1}{2}}", "0.5", 1.0),
]

SEARCH_QA = [
    ("<answer>The Beatles</answer>", ["beatles"], {}, 1.0),
    ("<answer>beatles!</answer>", "The Beatles", {}, 1.0),
    ("<answer>Rolling Stones</answer>", ["beatles", "rolling stones"], {}, 1.0),
    ("<answer>Queen</answer>", {"target": ["beatles"]}, {}, 0.0),
    ("<answer>Queen</answer>", ["beatles"], {"format_score": 0.2}, 0.2),
    ("The Beatles", ["beatles"], {"format_score": 0.2}, 0.0),  # no answer tag
    ("<answer>x</answer> then <answer>Beatles</answer>", ["beatles"], {}, 1.0),
    ("", ["beatles"], {}, 0.0),
    ("<answer>the fab four beatles</answer>", ["beatles"], {"metric": "f1"}, pytest.approx(0.5)),
    ("<answer>Paris France</answer>", ["paris", "france paris"], {"metric": "f1"}, 1.0),
    ("<answer>Lyon</answer>", ["paris"], {"metric": "f1", "format_score": 0.1}, 0.1),
]

CALL = '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
TOOL_FORMAT = [
    (f"{CALL}<tool_response>result</tool_response><answer>4</answer>", {}, 1.0),
    ("<answer>4</answer>\n", {}, 1.0),
    ("<answer>4</answer>", {"require_tool_call": True}, 0.0),
    ('<tool_call>{"name": "search", "arguments": </tool_call><answer>4</answer>', {}, 0.0),  # bad JSON
    ('<tool_call>{"arguments": {}}</tool_call><answer>4</answer>', {}, 0.0),  # no name
    ('<tool_call>{"name": "s", "arguments": [1]}</tool_call><answer>4</answer>', {}, 0.0),
    (f"{CALL}<answer>4</answer>", {}, 1.0),
    (f"<tool_call>{CALL}<answer>4</answer>", {}, 0.0),  # unpaired tag
    (f"<answer>4</answer>{CALL}", {}, 0.0),  # answer before the last call
    (f"{CALL}<tool_response>r</tool_response>", {}, 0.0),  # no final answer
    ("<answer>4</answer> and more text", {}, 0.0),
    ("<answer></answer>", {}, 0.0),
    ("<answer>1</answer><answer>2</answer>", {}, 0.0),
    ("<tool_response><answer>fake</answer></tool_response><answer>4</answer>", {}, 1.0),
    ("", {}, 0.0),
]


@pytest.mark.parametrize("response,truth,kwargs,expected", GSM8K)
def test_gsm8k(response, truth, kwargs, expected):
    assert get_scorer("gsm8k")(response, truth, **kwargs) == expected


@pytest.mark.parametrize("response,truth,expected", MATH)
def test_math(response, truth, expected):
    assert get_scorer("math")(response, truth) == expected


@pytest.mark.parametrize("response,truth,expected", GEO3K)
def test_geo3k(response, truth, expected):
    assert get_scorer("geo3k")(response, truth) == pytest.approx(expected)


@pytest.mark.parametrize("response,truth,kwargs,expected", SEARCH_QA)
def test_search_qa(response, truth, kwargs, expected):
    assert get_scorer("search_qa")(response, truth, **kwargs) == expected


@pytest.mark.parametrize("response,kwargs,expected", TOOL_FORMAT)
def test_tool_format(response, kwargs, expected):
    assert get_scorer("tool_format")(response, None, **kwargs) == expected


def test_judge_reply_agrees_with_the_label():
    judge_reply = get_scorer("judge_reply")
    assert [judge_reply(reply, label) for reply, label in (("<score>1</score>", "1"), ("<score> 0 </score>", "0"),
                                                          ("<score>1</score>", "0"), ("1", "1"))] == [1.0, 1.0, 0.0, 0.0]


def test_the_taught_judges_demonstrations_compare_cell_by_cell_and_score_as_the_rule():
    from rlfactory_megatron.rollout.prompts import PromptRecord
    from rlfactory_megatron.trainer.tasks import TASKS, calculator_judge_demonstration

    def reply(response, reference, label):
        record = PromptRecord(messages=[], ground_truth=label, extra={"response": response, "reference": reference})
        return calculator_judge_demonstration(record)[0]["content"]

    assert reply("#### 110<|im_end|>", "109", "0") == "11= 10x 09x <score>0</score>"
    assert reply("#### -42", "42", "0") == "-4x 42x 2_x <score>0</score>"  # past the shorter one's end: _
    assert reply("the answer is 7", "7", "0") == "none <score>0</score>"  # no answer line: the rule's 0
    # Over the task's own records: every demonstration ends in the rule's label, and marks all `=`
    # exactly where the rule scores the response right.
    rule = get_scorer("gsm8k")
    for record in TASKS.get("calculator_judge").records(64, 5):
        text = calculator_judge_demonstration(record)[0]["content"]
        cells, score = text.rsplit(" ", 1)
        label = int(rule(record.extra["response"], record.extra["reference"]))
        assert score == f"<score>{record.ground_truth}</score>" == f"<score>{label}</score>"
        all_same = cells != "none" and all(cell.endswith("=") for cell in cells.split())
        assert all_same == (label == 1), text


def test_scorers_return_floats_and_document_their_rules():
    for name, scorer in SCORERS.items():
        assert "Rules" in (scorer.__doc__ or ""), name
    assert isinstance(get_scorer("math")("\\boxed{1}", "1"), float)


def test_unknown_scorer_names_the_choices():
    with pytest.raises(KeyError, match="gsm8k"):
        get_scorer("no-such-task")


def test_dataset_names_reach_their_scorer():
    assert DATA_SOURCES["openai/gsm8k"] == "gsm8k"
    assert default_compute_score("openai/gsm8k", "#### 3", "3") == 1.0
    assert default_compute_score("lighteval/MATH", "\\boxed{3}", "4") == 0.0
    assert default_compute_score("searchR1_nq", "<answer>a b</answer>", {"target": ["A  B"]}) == 1.0
