"""Search-QA scorer: the `<answer>` text against a list of gold answers, by exact match or F1."""
import re
import string
from collections import Counter
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalization: lowercase, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-overlap F1 between two normalized answers."""
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def gold_answers(ground_truth: Any) -> list[str]:
    """Gold answers from a string, a list, or a `{"target": [...]}` record (Search-R1 data)."""
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        return [ground_truth]
    return [str(g) for g in ground_truth]


def score(
    solution_str: str,
    ground_truth: Any,
    metric: str = "em",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """Score a search-agent response against gold answers.

    Rules:
    - The prediction is the text inside the last `<answer>...</answer>`; none found
      (or empty output) scores 0.0.
    - Answers are normalized: lowercase, punctuation and articles (a/an/the) removed,
      whitespace collapsed.
    - metric="em" (default): `correct_score` if the prediction equals any gold answer,
      else `format_score` (a well-formed but wrong answer).
    - metric="f1": the best token F1 over the gold answers, scaled by `correct_score`;
      `format_score` is the floor for a well-formed answer.
    """
    found = _ANSWER.findall(solution_str)
    if not found:
        return 0.0
    prediction, golds = found[-1], gold_answers(ground_truth)
    if metric == "em":
        correct = any(normalize_answer(prediction) == normalize_answer(g) for g in golds)
        return correct_score if correct else format_score
    if metric == "f1":
        best = max((token_f1(prediction, g) for g in golds), default=0.0)
        return max(correct_score * best, format_score)
    raise ValueError(f"search_qa: metric must be 'em' or 'f1', got {metric!r}")
