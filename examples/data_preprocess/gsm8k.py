"""GSM8K -> the parquet layout `rlf-train` reads (`trainer.data_path`, `trainer.val_data_path`).

    python examples/data_preprocess/gsm8k.py --out ~/data/gsm8k              # from the Hugging Face hub
    python examples/data_preprocess/gsm8k.py --source /data/gsm8k --out D    # a local copy (the hub's
                                                                              # parquet/jsonl files)
Writes D/train.parquet and D/test.parquet with one row per problem: `prompt` (chat messages),
`ground_truth` (the number after the reference answer's `####`), `data_source` ("openai/gsm8k",
which picks the `gsm8k` scorer when `reward.scorer` is null) and `extra_info` (split, index,
question, the reference answer).
"""
from __future__ import annotations

import sys

from _common import preprocess

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def ground_truth(answer: str) -> str:
    """'... #### 1,234' -> '1234'."""
    if "####" not in answer:
        raise ValueError(f"a GSM8K answer without '####': {answer[-80:]!r}")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def to_row(example: dict, split: str, index: int) -> dict:
    question = example["question"]
    return {
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ground_truth": ground_truth(example["answer"]),
        "data_source": DATA_SOURCE,
        "extra_info": {"split": split, "index": index, "question": question, "answer": example["answer"]},
    }


def main(argv: list[str] | None = None) -> int:
    return preprocess(argv, __doc__, "gsm8k", DATA_SOURCE, "main", to_row)


if __name__ == "__main__":
    sys.exit(main())
