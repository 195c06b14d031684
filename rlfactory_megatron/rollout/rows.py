"""What a rollout phase makes: each trajectory's summary (known on every rank), its tokens (sent to
the DP rank that trains it), the rows one DP rank trains, and a phase still generating."""
from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlfactory_megatron.actor.batch import RolloutBatch
from rlfactory_megatron.rollout.prompts import PromptRecord


@dataclass
class RowSummary:
    """What every rank knows of one trajectory: where it was made, its size, what it did."""

    row: int
    producer: int  # the generating process that made it and holds it (EngineLayout.producer)
    prompt_tokens: int
    response_tokens: int
    turns: int
    tool_calls: int
    tool_errors: dict[str, int] = field(default_factory=dict)  # failed calls by error_kind; parse errors as "malformed_call"
    versions: dict[int, int] = field(default_factory=dict)  # weight version -> generated tokens it produced
    stop_reason: str = ""  # the agent loop's: answer | max_turns | token_budget

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass
class RowData:
    """One trajectory as the ranks that train on it need it: its tokens, and what the rollout
    store keeps of it besides (the first rank of the DP rank that trains it writes it)."""

    row: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    log_probs: np.ndarray  # the engine's, of the generated tokens (0 on observation tokens)
    versions: np.ndarray  # the weight version that generated each response token (-1 on observation tokens)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # as the store keeps them
    stop_reason: str = ""
    turns: int = 0
    # The engine's routes of each position but the last ([tokens - 1, layers, top-k] int16, -1
    # where unknown) under routing replay R3, else None.
    routes: np.ndarray | None = None


def with_engine_routes(batch: RolloutBatch, rows: list[RowData]) -> RolloutBatch:
    """`batch` (of `rows`, in order) with the engines' routes of its rows when they carry them
    (routing replay R3), aligned like the log-probs: at token t the routes of position t - 1."""
    recorded = [r.routes for r in rows if r.routes is not None]
    if not recorded:
        return batch
    from rlfactory_megatron.actor.routing import NO_ROUTE

    routes = torch.full((*batch.input_ids.shape, *recorded[0].shape[1:]), NO_ROUTE, dtype=torch.int16)
    for i, r in enumerate(rows):
        if r.routes is not None:
            routes[i, 1:1 + len(r.routes)] = torch.from_numpy(r.routes)
    return batch.with_fields(routes=routes)


# Tool failures counted per kind in the metrics (tools/errors/<kind>); others count as "other".
TOOL_ERROR_KINDS = ("malformed_call", "unknown_tool", "invalid_arguments", "exception", "timeout", "actor_died")


def tool_errors(traj) -> dict[str, int]:
    counts: dict[str, int] = {}
    for turn in traj.turns:
        if turn.parse_errors:
            counts["malformed_call"] = counts.get("malformed_call", 0) + len(turn.parse_errors)
        for call in turn.tool_calls:
            if call.is_error:
                kind = call.metadata.get("error_kind")
                kind = kind if kind in TOOL_ERROR_KINDS else "other"
                counts[kind] = counts.get(kind, 0) + 1
    return counts


@dataclass
class Rollouts:
    """One rollout phase: every row's summary (on every rank), the trajectories this process made."""

    summaries: list[RowSummary]
    records: list[PromptRecord]  # one per row (a prompt repeated n times)
    group_size: int
    engine_stats: list[dict[str, float]]  # one per engine
    local: dict[int, tuple[Any, str]] = field(default_factory=dict)  # row -> (Trajectory, response text)
    versions: dict[int, list[int]] = field(default_factory=dict)  # row made here -> weight version per generated token
    reward_future: Any = None  # this process's rows being scored
    reward: Any = None  # RewardResult of all rows, once gathered
    extra_stats: dict[str, float] = field(default_factory=dict)  # e.g. dynamic sampling's refill counts

    def row_data(self, row: int) -> RowData:
        """A row this process made, to send to the ranks that train it."""
        traj, _ = self.local[row]
        mask = np.asarray(traj.loss_mask, dtype=np.int8)
        versions = np.full(len(mask), -1, dtype=np.int32)
        versions[mask > 0] = self.versions.get(row, [])
        calls = [{"turn": t, "name": c.name, "arguments": c.arguments, "observation": c.observation,
                  "is_error": c.is_error, "latency_s": c.latency_s}
                 for t, turn in enumerate(traj.turns) for c in turn.tool_calls]
        fed = len(traj.prompt_ids) + len(traj.response_ids) - 1
        routes = None if traj.routes is None else traj.routes[:fed]
        return RowData(row, np.asarray(traj.prompt_ids, dtype=np.int64), np.asarray(traj.response_ids, dtype=np.int64),
                       mask, np.asarray(traj.logprobs, dtype=np.float32), versions, calls, traj.stop_reason,
                       len(traj.turns), routes)

    def stored_record(self, data: RowData, step: int, advantages: np.ndarray):
        """A row as the rollout store keeps it, from its data (on any rank: every rank knows each
        row's prompt record and, once gathered, its reward)."""
        from rlfactory_megatron.envs.storage import RolloutRecord

        row, record = data.row, self.records[data.row]
        return RolloutRecord(
            step, f"{row:05d}", data.prompt_ids, data.response_ids, data.loss_mask, data.log_probs, advantages,
            float(self.reward.scores[row]), data.tool_calls,
            routes=data.routes, metadata={"data_source": record.data_source, "ground_truth": str(record.ground_truth),
             "group": row // self.group_size, "stop_reason": data.stop_reason, "turns": data.turns,
             "reward_error": self.reward.errors[row], "weight_versions": _runs(data.versions[data.loss_mask > 0].tolist()),
             **_model_reward(self.reward.extras[row])})

    def staleness(self, version: int) -> dict[str, float]:
        """How many updates behind `version` (the weights being trained) the generated tokens'
        weights are: mean, max, and the share of tokens at each staleness (a histogram)."""
        counts: dict[int, int] = {}
        for summary in self.summaries:
            for made_by, tokens in summary.versions.items():
                counts[version - made_by] = counts.get(version - made_by, 0) + tokens
        total = max(sum(counts.values()), 1)
        metrics = {"rollout/staleness_mean": sum(k * n for k, n in counts.items()) / total,
                   "rollout/staleness_max": float(max(counts, default=0))}
        metrics.update({f"rollout/staleness_{k}_frac": n / total for k, n in sorted(counts.items())})
        return metrics

    def stats(self) -> dict[str, float]:
        rows = self.summaries
        calls = sum(r.tool_calls for r in rows)
        metrics = {"rollout/response_tokens_mean": float(np.mean([r.response_tokens for r in rows])),
                   "rollout/response_tokens_max": float(max(r.response_tokens for r in rows)),
                   "rollout/turns_mean": float(np.mean([r.turns for r in rows])),
                   "rollout/tool_calls_per_sample": calls / len(rows),
                   # cut at rollout.max_response_tokens (verl's response_length/clip_ratio)
                   "rollout/clip_ratio": sum(r.stop_reason == "token_budget" for r in rows) / len(rows),
                   "rollout/num_engines": float(len(self.engine_stats))}
        for kind in (*TOOL_ERROR_KINDS, "other"):
            metrics[f"tools/errors/{kind}"] = float(sum(r.tool_errors.get(kind, 0) for r in rows))
        metrics["tools/errors"] = sum(metrics[f"tools/errors/{kind}"] for kind in (*TOOL_ERROR_KINDS, "other"))
        for index, engine in enumerate(self.engine_stats):
            metrics.update({f"rollout/engine_{index}_{k}": v for k, v in engine.items()})
        busy = [e["busy_s"] for e in self.engine_stats]
        metrics["rollout/engine_imbalance"] = max(busy) / max(float(np.mean(busy)), 1e-9) if max(busy) > 0 else 1.0
        metrics.update(self.extra_stats)
        return metrics

    @staticmethod
    def of_rows(parts: list[tuple["Rollouts", list[int]]]) -> "Rollouts":
        """The given rows of one or more rollouts, in order, as one (rows renumbered from 0)."""
        from rlfactory_megatron.rewards.records import RewardResult

        summaries, records, local, versions, rewards = [], [], {}, {}, []
        for part, picked in parts:
            for index in picked:
                position = len(summaries)
                summaries.append(dataclasses.replace(part.summaries[index], row=position))
                records.append(part.records[index])
                if index in part.local:
                    local[position] = part.local[index]
                if index in part.versions:
                    versions[position] = part.versions[index]
                rewards.append((part.reward, index))
        # Work adds up over the parts; the weight version is the one they all generated with.
        engines = [{k: (max if k in ("weight_version", "failed") else sum)(p.engine_stats[e][k] for p, _ in parts)
                    for k in parts[0][0].engine_stats[e]}
                   for e in range(len(parts[0][0].engine_stats))]
        reward = RewardResult([r.scores[i] for r, i in rewards], [r.response_lengths[i] for r, i in rewards],
                              [r.extras[i] for r, i in rewards], [r.errors[i] for r, i in rewards],
                              [r.error_kinds[i] for r, i in rewards])
        return Rollouts(summaries, records, parts[0][0].group_size, engines, local, versions, reward=reward)


def _runs(values: list[int]) -> list[list[int]]:
    """[3, 3, 4] -> [[3, 2], [4, 1]]: (value, count) runs, how the store keeps per-token versions."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs


@dataclass
class PendingRollout:
    """A rollout phase started with `RolloutGenerator.start` and not yet finished: its prompts (on
    every rank) and, in the generating process, the generation under way."""

    records: list[PromptRecord]
    step: int
    greedy: bool
    first_row: int
    generation: concurrent.futures.Future | None = None  # -> (local, summaries, engine stats, versions, model scores)


@dataclass
class TrainRows:
    """The rows one DP rank trains on (a DP-local batch, and each row's data, to store), the
    engines' log-probs of them, and the phase they come from (every row's summary; the rows
    this process made, to score)."""

    batch: RolloutBatch
    engine_log_probs: torch.Tensor  # [B, T], aligned to the batch's tokens
    engine_versions: torch.Tensor  # [B, T]: the weight version that generated each token (-1: not generated)
    rollouts: Rollouts
    data: list[RowData] = field(default_factory=list)  # in the batch's row order


def _model_reward(extra: dict) -> dict:
    """A row's model reward as its stored record keeps it (none without one): the model's score,
    the rule's, the judge's reply text and why the model reward failed."""
    keys = {"model/score": "model_score", "rule/score": "rule_score", "model/reply": "model_reply",
            "model/error": "model_error"}
    return {name: extra[key] for key, name in keys.items() if key in extra}
