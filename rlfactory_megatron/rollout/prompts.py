"""A prompt as the rollout side takes it (a data set's row, or a built-in task's), and its fit
into rollout.max_prompt_tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptRecord:
    messages: list[dict[str, Any]]  # chat messages of the prompt
    ground_truth: Any
    data_source: str = "unknown"
    extra: dict[str, Any] = field(default_factory=dict)
    demonstration: list[dict[str, Any]] | None = None  # assistant/tool turns for an SFT warm-start
    origin: str = ""  # where the row comes from ("<file> row 17"), for messages that name it


def fit_prompt(ids: list[int], limit: int, truncation: str, origin: str = "a prompt") -> list[int]:
    """A prompt's token ids within `limit` by rollout.truncation: as they are when they fit, else
    `left` cuts its first tokens (keeps the last `limit`), `right` its last tokens (keeps the first
    `limit`), and `error` refuses it (rlf-train refuses such data at load already)."""
    if len(ids) <= limit:
        return ids
    if truncation == "left":
        return ids[len(ids) - limit:]
    if truncation == "right":
        return ids[:limit]
    raise ValueError(f"{origin}: a prompt of {len(ids)} tokens exceeds rollout.max_prompt_tokens={limit}; raise it, "
                     f"or set rollout.truncation=left or right")
