"""GSM8K scorer: the final number after `####` (strict) or the last number (flexible)."""
import re

# Only the tail is searched, like the reference implementation users compare against:
# a long chain of thought may quote other "#### n" lines earlier on.
TAIL_CHARS = 300

_STRICT = re.compile(r"#### \$?(-?[0-9.,]+)")
# A number: digits with optional thousands commas and decimals; a sentence's final
# period or comma is not part of it ("is 72." -> "72").
_ANY_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string found in the tail of `solution_str`, or None."""
    tail = solution_str[-TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return _clean(found[-1]) if found else None
    if method == "flexible":
        numbers = _ANY_NUMBER.findall(tail)
        return _clean(numbers[-1]) if numbers else None
    raise ValueError(f"gsm8k: method must be 'strict' or 'flexible', got {method!r}")


def score(
    solution_str: str,
    ground_truth: str | int | float,
    method: str = "strict",
    format_score: float = 0.0,
    correct_score: float = 1.0,
) -> float:
    """Score a GSM8K response.

    Rules:
    - Only the last 300 characters of the response are searched.
    - strict (default): the answer is the number after the last `#### ` (an optional
      `$` before it is allowed); flexible: the last number in the tail (a trailing
      sentence period or comma is not part of the number).
    - Commas and `$` are removed from the answer, then it must equal the ground truth
      string exactly (so `1,000` matches `1000`, but `72.0` does not match `72`).
    - Correct: `correct_score`; an answer was found but is wrong: `format_score`;
      no answer found (or empty output): 0.0.
    """
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return correct_score if answer == _clean(str(ground_truth)) else format_score


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").strip()
