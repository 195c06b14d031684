"""Judge-reply scorer: a judge's reply agrees with the label the rule gave (teaching a judge, trainer.task=calculator_judge)."""
from typing import Any


def score(solution_str: str, ground_truth: Any) -> float:
    """Score a judge's reply against the rule's label.

    Rules:
    - The reply's score is read as a served judge's is, by reward.model.parser's default (the
      number in the last `<score>...</score>`).
    - 1.0 if it equals `ground_truth` as a number, else 0.0; a reply with no score: 0.0.
    """
    from rlfactory_megatron.config.schema import ModelRewardConfig
    from rlfactory_megatron.rewards.judge import ReplyNotParsed, reply_parser

    try:
        return 1.0 if reply_parser(ModelRewardConfig.parser)(solution_str) == float(ground_truth) else 0.0
    except ReplyNotParsed:
        return 0.0
