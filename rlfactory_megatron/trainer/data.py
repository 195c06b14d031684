"""Prompt records from parquet/jsonl (or a built-in task) and a seeded sampler whose position is checkpointed."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rlfactory_megatron.rollout.prompts import PromptRecord


def _record(row: dict[str, Any], source: str) -> PromptRecord:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{source}: every row needs a 'prompt' (a string or a list of chat messages)")
    truth = row.get("ground_truth")
    if truth is None and isinstance(row.get("reward_model"), dict):  # verl's layout
        truth = row["reward_model"].get("ground_truth")
    if truth is None:
        raise ValueError(f"{source}: a row has no 'ground_truth' (or reward_model.ground_truth)")
    demonstration = row.get("demonstration")
    if demonstration is not None and not (isinstance(demonstration, list) and all(
            isinstance(t, dict) and t.get("role") in ("assistant", "tool") for t in demonstration)):
        raise ValueError(f"{source}: 'demonstration' must be a list of assistant/tool messages")
    return PromptRecord([dict(m) for m in prompt], truth, str(row.get("data_source", "unknown")),
                        dict(row.get("extra_info") or {}), demonstration, origin=source)


def load_prompts(path: str) -> list[PromptRecord]:
    """Rows with `prompt`, `ground_truth` (or verl's `reward_model.ground_truth`), optional `data_source`,
    `extra_info` and `demonstration` (assistant/tool messages for the SFT warm-start)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"trainer.data_path='{path}' does not exist")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(file).to_pylist()
    elif file.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    else:
        raise ValueError(f"trainer.data_path='{path}': use a .parquet or .jsonl file")
    return [_record(row, f"{path} row {i}") for i, row in enumerate(rows)]


def run_records(cfg) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """A run's training prompts and its held-out validation prompts (never trained on):
    trainer.data_path's rows, validated on trainer.val_data_path's first val_prompts rows (else
    on data_path's last ones, held out); without a data_path, the built-in task's."""
    from rlfactory_megatron.trainer.tasks import TASKS

    cfg = cfg.trainer
    if cfg.data_path:
        records = load_prompts(cfg.data_path)
        if cfg.val_data_path:
            return records, load_prompts(cfg.val_data_path)[: cfg.val_prompts]
        held = min(cfg.val_prompts, len(records) // 2)
        return records[: len(records) - held], records[len(records) - held:]
    task = TASKS.get(cfg.task)
    train = task.records(task.train_prompts, cfg.seed)
    seen = {json.dumps(r.messages) for r in train}
    fresh = [r for r in task.records(2 * cfg.val_prompts + 64, cfg.seed + 1) if json.dumps(r.messages) not in seen]
    for name, records in (("training", train), ("validation", fresh)):
        for i, record in enumerate(records):
            record.origin = f"trainer.task={cfg.task} {name} prompt {i}"
    return train, fresh[: cfg.val_prompts]


class PromptSampler:
    """Epochs of seeded permutations; `state_dict` is enough to continue exactly after a restart."""

    def __init__(self, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError("the prompt set is empty")
        self.size, self.seed = size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        order = list(range(self.size))
        random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next(self, count: int) -> list[int]:
        out = []
        while len(out) < count:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation()
