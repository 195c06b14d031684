"""Records that cross process boundaries: a sample to score, one sample's outcome, a batch result."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class RewardSample:
    """One finished trajectory, as the reward side needs it."""

    data_source: str
    response: str
    ground_truth: Any
    response_length: int = 0  # valid response tokens: where a token-level reward lands, and DAPO's length
    extra_info: dict = field(default_factory=dict)
    prompt: str = ""  # the task as the user asked it (its last user message): what a judge reads
    tool_calls: list[dict] = field(default_factory=list)  # {name, arguments, observation} per call, in order


# Extra values summed over the batch too (counts: `reward/<key>/sum`) and maxed (`reward/<key>/max`).
SUMMED_EXTRAS = ("model/failed", "model/parse_failed", "model/retries", "model/cache_hit", "model/latency_s")
MAXED_EXTRAS = ("model/latency_s", "model/wait_s")

# Why a sample's reward failed: its function raised, returned no finite number, ran past its
# timeout, or took its worker down.
ERROR_KINDS = ("raised", "invalid", "timeout", "crashed")


@dataclass
class SampleScore:
    """The outcome of scoring one sample; `error` is set when the reward function failed."""

    score: float
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None  # one of ERROR_KINDS when `error` is set


@dataclass
class RewardResult:
    """Rewards for a batch: sequence-level scores, per-sample extra values and errors."""

    scores: list[float]
    response_lengths: list[int]
    extras: list[dict[str, float]]
    errors: list[str | None]
    error_kinds: list[str | None] = field(default_factory=list)  # per sample, when errors were classified

    @classmethod
    def from_scores(cls, samples: list[RewardSample], outcomes: list[SampleScore]) -> "RewardResult":
        return cls(
            scores=[o.score for o in outcomes],
            response_lengths=[s.response_length for s in samples],
            extras=[o.extra for o in outcomes],
            errors=[o.error for o in outcomes],
            error_kinds=[o.error_kind for o in outcomes],
        )

    def token_level(self, width: int) -> "torch.Tensor":
        """A `[batch, width]` float tensor, zero except each score on its last response token."""
        # torch stays out of module import: scoring workers never need it and it is slow to load.
        import torch

        rewards = torch.zeros(len(self.scores), width, dtype=torch.float32)
        for row, (score, length) in enumerate(zip(self.scores, self.response_lengths, strict=True)):
            rewards[row, min(max(length, 1), width) - 1] = score
        return rewards

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        """Batch means of the score and of every numeric extra key (sums of the counts, maxima of
        the latencies), plus the error count."""
        columns: dict[str, list[float]] = {"score": self.scores}
        for extra in self.extras:
            for key, value in extra.items():
                if isinstance(value, (int, float)) and key != "score":
                    columns.setdefault(key, []).append(float(value))
        metrics = {f"{prefix}/{key}/mean": sum(v) / len(v) for key, v in columns.items() if v}
        if self.scores:
            metrics.update({f"{prefix}/score/min": float(min(self.scores)), f"{prefix}/score/max": float(max(self.scores))})
        metrics.update({f"{prefix}/{key}/sum": float(sum(columns[key])) for key in SUMMED_EXTRAS if key in columns})
        metrics.update({f"{prefix}/{key}/max": max(columns[key]) for key in MAXED_EXTRAS if columns.get(key)})
        metrics[f"{prefix}/errors"] = float(sum(e is not None for e in self.errors))
        for kind in ERROR_KINDS:
            metrics[f"{prefix}/errors/{kind}"] = float(sum(k == kind for k in self.error_kinds))
        return metrics
