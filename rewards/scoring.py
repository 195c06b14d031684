"""Calling a reward function safely: one sample or one batch in, `SampleScore`s out, errors caught."""
import logging
import math
import traceback
from collections.abc import Callable
from typing import Any

from rlfactory_megatron.rewards.records import RewardSample, SampleScore

logger = logging.getLogger(__name__)


class InvalidReward(ValueError):
    """A reward function returned something that is not a finite number."""


def to_sample_score(value: Any) -> SampleScore:
    """A reward function's return value (a number, or a dict with "score" and extras) as a SampleScore.

    The score must be a finite number: one NaN reward makes every advantage and the update NaN,
    so a NaN, an infinity or a string is that sample's error, like a raise."""
    extra: dict = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"a reward dict must have a 'score' key, got keys {sorted(value)}")
        extra = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if isinstance(value, (str, bytes)):
        raise InvalidReward(f"reward must be a number, got the {type(value).__name__} {value!r:.60}")
    try:
        score = float(value)
    except (TypeError, ValueError) as exc:
        raise InvalidReward(f"reward must be a number, got {type(value).__name__}: {exc}") from None
    if not math.isfinite(score):
        raise InvalidReward(f"reward must be finite, got {score}")
    return SampleScore(score=score, extra=extra)


def failed(sample_index: int, error: str, kind: str = "raised") -> SampleScore:
    """The outcome of a sample whose reward function failed: 0 reward, error (and its kind, one of
    records.ERROR_KINDS) logged and kept."""
    logger.error("reward for sample %d failed: %s", sample_index, error)
    return SampleScore(score=0.0, error=error, error_kind=kind)


def _kind(exc: BaseException) -> str:
    return "invalid" if isinstance(exc, InvalidReward) else "raised"


def describe(exc: BaseException) -> str:
    """`Type: message` plus the innermost frame, enough to find the failing line."""
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" ({frame[0].filename}:{frame[0].lineno})" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


def score_one(fn: Callable[..., Any], sample: RewardSample, index: int) -> SampleScore:
    """`fn(data_source, solution_str, ground_truth, extra_info)` on one sample; raising costs 0 + error."""
    try:
        return to_sample_score(
            fn(
                data_source=sample.data_source,
                solution_str=sample.response,
                ground_truth=sample.ground_truth,
                extra_info=sample.extra_info,
            )
        )
    except Exception as exc:  # user code: any failure is that sample's, never the batch's
        return failed(index, describe(exc), _kind(exc))


def score_batch(fn: Callable[..., Any], samples: list[RewardSample]) -> list[SampleScore]:
    """One `fn(data_sources, solution_strs, ground_truths, extra_infos)` call for the whole batch."""
    try:
        values = fn(
            data_sources=[s.data_source for s in samples],
            solution_strs=[s.response for s in samples],
            ground_truths=[s.ground_truth for s in samples],
            extra_infos=[s.extra_info for s in samples],
        )
        if len(values) != len(samples):
            raise ValueError(f"batch reward function returned {len(values)} scores for {len(samples)} samples")
    except Exception as exc:  # one bad batch call costs the batch 0, not the run
        error = describe(exc)
        return [failed(i, error) for i in range(len(samples))]
    return [_checked(value, i) for i, value in enumerate(values)]


def _checked(value: Any, index: int) -> SampleScore:
    """One returned value as a SampleScore; a bad one (NaN, a string) fails its own sample only."""
    try:
        return to_sample_score(value)
    except Exception as exc:
        return failed(index, describe(exc), _kind(exc))
