"""MATH scorer: the last `\\boxed{...}` answer, compared with math-verify and a string fallback."""
import re
import threading

_BOX = re.compile(r"\\(?:boxed|fbox)")
_MATH_VERIFY_TIMEOUT_S = 5


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces) or `\\boxed x`; None if absent or unclosed."""
    boxes = list(_BOX.finditer(text))
    if not boxes:
        return None
    after = text[boxes[-1].end():]
    if after[:1].isspace():
        # `\boxed 5`: the next whitespace-delimited token, without a sentence's final period.
        token = after.split(None, 1)[0] if after.strip() else ""
        return token.split("$", 1)[0].rstrip(".") or None
    if not after.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(after):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return after[1:i]
    return None


# Applied in order; each removes a difference in notation that leaves the answer the same.
_NORMALIZATIONS = [
    (r"\\text\{\s*([^{}]*)\}", r"\1"),
    (r"\\mbox\{\s*([^{}]*)\}", r"\1"),
    (r"\\[dt]frac", r"\\frac"),
    (r"\\frac(\d)(\d)", r"\\frac{\1}{\2}"),
    (r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}"),
    (r"\\frac(\d)\{", r"\\frac{\1}{"),
    (r"\\sqrt(\w)", r"\\sqrt{\1}"),
    (r"\\left|\\right|\\!|\\,|\\;|\\:|\\ ", ""),
    (r"\^\{?\\circ\}?", ""),
    (r"\\?\$|\\?%", ""),
    (r"\s+", ""),
    (r"(?<![\d])\.(\d)", r"0.\1"),
]


def normalize(answer: str) -> str:
    """A canonical string for answers math-verify cannot compare (text, odd LaTeX)."""
    s = answer.strip()
    for pattern, repl in _NORMALIZATIONS:
        s = re.sub(pattern, repl, s)
    s = s.rstrip(".").lower()
    # A lone variable assignment ("x=3") answers with its value.
    s = re.sub(r"^[a-z]=", "", s)
    return s


def is_equivalent(prediction: str, gold: str) -> bool:
    """True if the answers match as normalized strings or math-verify proves them equal."""
    if normalize(prediction) == normalize(gold):
        return True
    # math-verify times out with SIGALRM, which only the main thread may set; elsewhere
    # the caller (reward pool, prime processes) bounds the time.
    timeout = _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    # Imported on first use: math-verify pulls in sympy (~2 CPU-s), which every process that
    # imports the scorers (reward workers, the trainer) would pay, whatever its task.
    from math_verify import parse, verify

    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    if not gold_parsed:
        return False
    return verify(gold_parsed, parse(f"${prediction}$", parsing_timeout=timeout), timeout_seconds=timeout)


def score(solution_str: str, ground_truth: str | int | float) -> float:
    """Score a MATH response: 1.0 if correct, else 0.0.

    Rules:
    - The answer is the content of the last `\\boxed{...}` (or `\\fbox{...}`) in the
      response, with balanced braces (`\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`), or the
      token after `\\boxed ` (`\\boxed 5` -> `5`). No box, an unclosed box or an empty
      response scores 0.0.
    - A ground truth that itself contains a box (a full MATH solution) is reduced to
      its last boxed answer the same way.
    - Correct when the normalized strings are equal (spacing, `\\left`/`\\right`,
      `\\dfrac`, `\\text{}`, degrees, `$`, `%`, case, `x=` prefix ignored) or when the
      `math-verify` package finds them mathematically equal (`0.5` vs `\\frac12`).
    """
    prediction = last_boxed(solution_str)
    if prediction is None:
        return 0.0
    gold = str(ground_truth)
    if _BOX.search(gold):
        gold = last_boxed(gold)
    if gold is None:
        return 0.0
    return 1.0 if is_equivalent(prediction, gold) else 0.0
