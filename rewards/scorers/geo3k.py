"""Geometry3K scorer: boxed-answer accuracy plus a small reward for the think/answer format."""
import re

from rlfactory_megatron.rewards.scorers.math import is_equivalent, last_boxed

_FORMAT = re.compile(r"\s*<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def score(solution_str: str, ground_truth: str | int | float, format_weight: float = 0.1) -> float:
    """Score a Geometry3K response: `(1 - format_weight) * accuracy + format_weight * format`.

    Rules (defaults give 0.9 * accuracy + 0.1 * format):
    - format is 1 when the response is `<think>...</think>` followed by text containing
      `\\boxed{...}`, else 0.
    - accuracy is 1 when the last boxed answer equals the ground truth under the `math`
      scorer's equivalence (normalized strings or math-verify), else 0.
    """
    well_formed = _FORMAT.fullmatch(solution_str) is not None
    prediction = last_boxed(solution_str)
    correct = prediction is not None and is_equivalent(prediction, str(ground_truth))
    return (1.0 - format_weight) * float(correct) + format_weight * float(well_formed)
