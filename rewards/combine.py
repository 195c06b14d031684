"""`reward.combine`: how the rule score and the model score of each sample make its reward: the
model score alone, a weighted sum, or a function from a file that receives both."""
from collections.abc import Callable
from dataclasses import dataclass

from rlfactory_megatron.rewards.custom import RewardConfigError, RewardFnSpec, load_function
from rlfactory_megatron.rewards.records import RewardResult, RewardSample
from rlfactory_megatron.rewards.remote import ModelScore
from rlfactory_megatron.rewards.scoring import describe, failed, to_sample_score

COMBINE_ARGS = ("rule_score", "model_score", "data_source", "solution_str", "ground_truth", "extra_info")


@dataclass
class CombineSpec:
    """The `reward.combine` settings (it pickles, to the reward workers)."""

    rule_weight: float | None = None
    model_weight: float | None = None
    function_path: str | None = None
    function_name: str = "combine"

    @classmethod
    def from_config(cls, combine) -> "CombineSpec":
        return cls(combine.rule_weight, combine.model_weight, combine.function_path, combine.function_name)

    @property
    def weighted(self) -> bool:
        return self.rule_weight is not None or self.model_weight is not None

    @property
    def uses_rule(self) -> bool:
        """Whether the rule score is computed at all (the model score alone needs no scorer)."""
        return self.function_path is not None or bool(self.rule_weight)

    def check(self, has_model: bool) -> None:
        """Refuses settings that cannot work; loads the function (its file and signature)."""
        if not has_model and (self.weighted or self.function_path is not None):
            raise RewardConfigError("reward.combine: mixes a model score with the rule, but no model reward is "
                                    "set; set reward.remote.url, or drop reward.combine")
        if self.weighted and self.function_path is not None:
            raise RewardConfigError("reward.combine: give weights (rule_weight, model_weight) or function_path, "
                                    "not both")
        self.load()

    def load(self) -> Callable[[float, float, RewardSample], float]:
        """fn(rule score, model score, sample) -> the reward."""
        if self.function_path is not None:
            fn = load_function(RewardFnSpec(path=self.function_path, name=self.function_name), COMBINE_ARGS,
                               "reward.combine.function_path", "reward.combine.function_name")
            return lambda rule, model, s: fn(rule_score=rule, model_score=model, data_source=s.data_source,
                                             solution_str=s.response, ground_truth=s.ground_truth,
                                             extra_info=s.extra_info)
        if not self.weighted:
            return lambda rule, model, sample: model
        rule_weight, model_weight = self.rule_weight or 0.0, self.model_weight or 0.0
        return lambda rule, model, sample: rule_weight * rule + model_weight * model


def combined(samples: list[RewardSample], rule: RewardResult | None, model: list[ModelScore],
             combine: Callable[[float, float, RewardSample], float]) -> RewardResult:
    """The batch's rewards from its rule result (None: no rule) and model scores; the parts stay
    in the extras (`rule/score`, `model/*`, the judge's reply text) for metrics and reading."""
    scores, extras, errors, kinds = [], [], [], []
    for i, (sample, outcome) in enumerate(zip(samples, model, strict=True)):
        rule_score = rule.scores[i] if rule is not None else 0.0
        extra = {**(rule.extras[i] if rule is not None else {}), "model/score": outcome.score,
                 "model/latency_s": outcome.latency_s, "model/retries": float(outcome.retries),
                 "model/failed": float(outcome.error is not None), "model/parse_failed": float(outcome.parse_failed),
                 "model/cache_hit": float(outcome.cached)}
        if outcome.wait_s is not None:
            extra["model/wait_s"] = outcome.wait_s
        if rule is not None:
            extra["rule/score"] = rule_score
        extra.update({key: text for key, text in (("model/reply", outcome.reply), ("model/error", outcome.error))
                      if text is not None})
        error, kind = (rule.errors[i], rule.error_kinds[i]) if rule is not None else (None, None)
        try:
            score = to_sample_score(combine(rule_score, outcome.score, sample)).score
        except Exception as exc:  # a user's combine function: its failure is this sample's
            failure = failed(i, f"reward.combine: {describe(exc)}")
            score, error, kind = failure.score, failure.error, failure.error_kind
        scores.append(score)
        extras.append(extra)
        errors.append(error)
        kinds.append(kind)
    return RewardResult(scores, [s.response_length for s in samples], extras, errors, kinds)


@dataclass
class CombinedFuture:
    """A batch's rewards once its rule is scored: the rule's RewardFuture (None: no rule) combined
    with the model scores the batch already has (a judge on our engines)."""

    samples: list[RewardSample]
    rule: object | None
    model: list[ModelScore]
    combine: Callable[[float, float, RewardSample], float]

    def result(self) -> RewardResult:
        return combined(self.samples, self.rule.result() if self.rule is not None else None, self.model, self.combine)
