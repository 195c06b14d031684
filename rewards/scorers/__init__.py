"""The scorer registry: one `score(solution_str, ground_truth, **kw)` per task, found by name or data source."""
from collections.abc import Callable
from typing import Any

from rlfactory_megatron.registry import Registry
from rlfactory_megatron.rewards.scorers import geo3k, gsm8k, judge_reply, math, search_qa, tool_format

Scorer = Callable[..., float | dict]

SCORERS: Registry[Scorer] = Registry("reward scorer")
for _name, _module in (("gsm8k", gsm8k), ("math", math), ("geo3k", geo3k), ("search_qa", search_qa),
                       ("tool_format", tool_format), ("judge_reply", judge_reply)):
    SCORERS.register(_name, _module.score)

# Dataset names as they appear in the `data_source` column of common RL datasets.
DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "hiyouga/geometry3k": "geo3k",
    **{
        f"searchR1_{name}": "search_qa"
        for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
    },
}


def get_scorer(name: str) -> Scorer:
    """The scorer registered as `name` (or a dataset name mapped to it)."""
    key = DATA_SOURCES.get(name, name)
    if key not in SCORERS:
        raise KeyError(
            f"no reward scorer for {name!r}; registered scorers: {', '.join(SCORERS)} "
            f"(dataset names: {', '.join(DATA_SOURCES)}); set reward.custom_function for other data"
        )
    return SCORERS.get(key)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    """The reward function used when no custom one is configured: the scorer for `data_source`."""
    return get_scorer(data_source)(solution_str, ground_truth, **kwargs)
