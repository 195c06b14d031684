"""Tool-format scorer: well-formed `<tool_call>` JSON blocks and one final `<answer>`."""
import json
import re
from typing import Any

_OBSERVATION = re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FINAL_ANSWER = re.compile(r"<answer>(.*?)</answer>\s*\Z", re.DOTALL)


def _is_tool_call(body: str) -> bool:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and bool(call["name"].strip())
        and isinstance(call.get("arguments", {}), dict)
    )


def score(solution_str: str, ground_truth: Any = None, require_tool_call: bool = False) -> float:
    """Score the format of a multi-turn tool-using response: 1.0 if well-formed, else 0.0.

    Rules (`ground_truth` is ignored):
    - `<tool_response>...</tool_response>` blocks are observations written by tools and
      are removed before checking.
    - Every `<tool_call>...</tool_call>` holds a JSON object with a non-empty string
      `name` and, if present, an object `arguments`; no tag is left unpaired.
    - The response ends with exactly one non-empty `<answer>...</answer>` (only
      whitespace after it) that comes after the last tool call.
    - With `require_tool_call=True`, at least one tool call is also required.
    """
    text = _OBSERVATION.sub("", solution_str)
    calls = _TOOL_CALL.findall(text)
    outside_calls = _TOOL_CALL.sub("", text)
    if "<tool_call>" in outside_calls or "</tool_call>" in outside_calls:
        return 0.0
    if not all(_is_tool_call(body) for body in calls) or (require_tool_call and not calls):
        return 0.0
    final = _FINAL_ANSWER.search(outside_calls)
    if final is None or not final.group(1).strip() or not text.count("<answer>") == 1 == text.count("</answer>"):
        return 0.0
    return 1.0 if text.rfind("</tool_call>") < text.rfind("<answer>") else 0.0
