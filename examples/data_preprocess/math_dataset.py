"""MATH (competition mathematics) -> the parquet layout `rlf-train` reads. (Not `math.py`: run as a
script, a file of that name in this folder would shadow the standard library's `math` for every
script here.)

    python examples/data_preprocess/math_dataset.py --out ~/data/math               # from the Hugging Face hub
    python examples/data_preprocess/math_dataset.py --source /data/MATH --out D     # a local copy
Writes D/train.parquet and D/test.parquet: `prompt` (chat messages asking for a `\\boxed{}`
answer), `ground_truth` (the last `\\boxed{...}` of the reference solution, the form the `math`
scorer compares with math-verify), `data_source` (DigitalLearningGmbH/MATH-lighteval, which picks
the `math` scorer when `reward.scorer` is null) and `extra_info` (split, index, level, type).
"""
from __future__ import annotations

import sys

from _common import preprocess

from rlfactory_megatron.rewards.scorers.math import last_boxed

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def to_row(example: dict, split: str, index: int) -> dict:
    answer = last_boxed(example["solution"])
    if answer is None:
        raise ValueError(f"a MATH solution without a \\boxed{{}} answer (row {index} of {split}): "
                         f"{example['solution'][-80:]!r}")
    return {
        "prompt": [{"role": "user", "content": f"{example['problem']} {INSTRUCTION}"}],
        "ground_truth": answer,
        "data_source": DATA_SOURCE,
        "extra_info": {"split": split, "index": index, "level": example.get("level", ""),
                       "type": example.get("type", "")},
    }


def main(argv: list[str] | None = None) -> int:
    return preprocess(argv, __doc__, "math", DATA_SOURCE, None, to_row)


if __name__ == "__main__":
    sys.exit(main())
