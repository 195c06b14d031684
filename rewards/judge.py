"""A judge's prompt and the reading of its reply: the template (prompt, response, ground truth,
tool calls) and the parser (a regex or a function from a file), shared by every route that asks
a model for a score (reward.remote's chat protocol; a judge served by our engines)."""
import json
import math
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlfactory_megatron.rewards.custom import RewardConfigError, RewardFnSpec, load_function
from rlfactory_megatron.rewards.records import RewardSample

TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "tool_calls")
DEFAULT_TEMPLATE = """You are grading an assistant's answer.

Question:
{prompt}

Tool calls the assistant made:
{tool_calls}

Assistant's answer:
{response}

Reference answer:
{ground_truth}

Does the assistant's final answer agree with the reference? Think briefly, then end with <score>1</score> if it does \
and <score>0</score> if it does not."""
# An observation longer than this is cut in the judge's prompt: the judge needs what a call
# returned, not every byte of it.
OBSERVATION_CHARS = 500
_FUNCTION = re.compile(r"^(?P<path>.+\.py):(?P<name>[A-Za-z_]\w*)$")


class ReplyNotParsed(ValueError):
    """A judge's reply holds no score the parser can read; `reply` is that reply, where known."""

    def __init__(self, message: str, reply: str | None = None) -> None:
        super().__init__(message)
        self.reply = reply


@dataclass
class JudgePrompt:
    """The template a sample is rendered into, checked at load (`reward.model.template`)."""

    template: str

    @classmethod
    def from_config(cls, value: str | None) -> "JudgePrompt":
        """`value`: a file holding the template, the template itself, or None for the built-in one."""
        if value is None:
            return cls(DEFAULT_TEMPLATE)
        text = Path(value).read_text() if _is_file(value) else value
        try:
            used = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
        except ValueError as exc:
            raise RewardConfigError(f"reward.model.template: {exc}; write literal braces as {{{{ and }}}}") from None
        unknown = sorted(used - set(TEMPLATE_FIELDS))
        if unknown:
            raise RewardConfigError(f"reward.model.template: unknown field(s) {unknown}; "
                                    f"a template may use {{{'}, {'.join(TEMPLATE_FIELDS)}}}")
        if "response" not in used:
            raise RewardConfigError("reward.model.template: has no {response}: the judge would not see what it "
                                    "scores; add {response} (and any of {prompt}, {ground_truth}, {tool_calls})")
        return cls(text)

    def messages(self, sample: RewardSample) -> list[dict]:
        """The chat the judge answers: one user turn."""
        calls = "\n".join(f"{c['name']}({json.dumps(c['arguments'], ensure_ascii=False)}) -> "
                          f"{str(c['observation'])[:OBSERVATION_CHARS]}" for c in sample.tool_calls) or "(none)"
        text = self.template.format(prompt=sample.prompt, response=sample.response,
                                    ground_truth=sample.ground_truth, tool_calls=calls)
        return [{"role": "user", "content": text}]


def _is_file(value: str) -> bool:
    """Whether a template setting names a file (a template longer than a path can be is not one)."""
    try:
        return "\n" not in value and Path(value).is_file()
    except OSError:
        return False


def reply_parser(value: str) -> Callable[[str], float]:
    """`reward.model.parser` as a function reply -> score: `file.py:function`, or a regex whose
    first group (of the last match) is the score. A reply with no finite score raises ReplyNotParsed."""
    match = _FUNCTION.match(value)
    if match:
        fn = load_function(RewardFnSpec(path=match["path"], name=match["name"], config_prefix="reward.model"),
                           ("reply",), "reward.model.parser", "reward.model.parser")
        return lambda reply: _finite(fn(reply), reply)
    try:
        pattern = re.compile(value)
    except re.error as exc:
        raise RewardConfigError(f"reward.model.parser: {value!r} is neither file.py:function nor a valid regex "
                                f"({exc})") from None
    if pattern.groups < 1:
        raise RewardConfigError(f"reward.model.parser: the regex {value!r} has no group; put the score in "
                                r"one, e.g. <score>\s*([0-9.]+)\s*</score>")

    def parse(reply: str) -> float:
        found = pattern.findall(reply)
        if not found:
            raise ReplyNotParsed(f"no match of {value!r} in the reply")
        last = found[-1]
        return _finite(last[0] if isinstance(last, tuple) else last, reply)

    return parse


def _finite(value: object, reply: str) -> float:
    try:
        score = float(value)
    except (TypeError, ValueError):
        raise ReplyNotParsed(f"the parsed score {value!r:.40} is not a number") from None
    if not math.isfinite(score):
        raise ReplyNotParsed(f"the parsed score {score} is not finite")
    return score
