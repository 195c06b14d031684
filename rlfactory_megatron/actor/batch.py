"""The batch record of trajectories and its packing into token-budgeted Megatron micro-batches.

Token arrays are [B, T] (right-padded); every per-token quantity at index t belongs to token t,
i.e. to the prediction made at position t-1. Token 0 of a sequence is never trained on.
Packing concatenates whole sequences into one row per micro-batch (no padding waste), with
block-diagonal causal attention and per-sequence position ids, and cuts micro-batches by a
token budget; loss normalization is global, so cuts never change an update.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch

# Per-token float arrays a batch may carry, all [B, T] and aligned to token t.
TOKEN_FIELDS = ("loss_mask", "old_log_probs", "ref_log_probs", "values", "token_rewards", "advantages", "returns",
                "engine_log_probs")


@dataclass
class RolloutBatch:
    """Trajectories of one step: prompt + response tokens, masks and the RL quantities on them."""

    input_ids: torch.Tensor  # [B, T] int64, right-padded
    lengths: torch.Tensor  # [B] int64, valid tokens per row
    loss_mask: torch.Tensor  # [B, T] float: 1 on tokens the policy produced; 0 on prompt, tool observations, padding
    group_ids: Optional[torch.Tensor] = None  # [B] int64: samples of one prompt (GRPO/RLOO groups)
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    engine_log_probs: Optional[torch.Tensor] = None  # the rollout engines' (for a correction inside the update)
    # A DP-local batch holds only the rows one DP rank trains on: `step_rows` [B] is each row's
    # index in the step's whole batch of `step_size` rows (it may hold none of them).
    step_rows: Optional[torch.Tensor] = None
    step_size: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {list(self.input_ids.shape)}")
        b, t = self.input_ids.shape
        if self.lengths.shape != (b,) or (b == 0 and not self.dp_local):
            raise ValueError("lengths must be [batch] with 1 <= length <= input_ids.shape[1]")
        if b and (int(self.lengths.max()) > t or int(self.lengths.min()) < 1):
            raise ValueError("lengths must be [batch] with 1 <= length <= input_ids.shape[1]")
        if self.dp_local and (self.step_rows.shape != (b,) or self.step_size < b):
            raise ValueError(f"step_rows must be [batch] indices into the step's {self.step_size} rows")
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and value.shape != (b, t):
                raise ValueError(f"{name} must have shape {[b, t]} like input_ids, got {list(value.shape)}")
        # Position 0 has no prediction and padding is never trained: enforce rather than trust.
        valid = torch.arange(t)[None, :] < self.lengths[:, None]
        self.loss_mask = self.loss_mask.float() * valid
        self.loss_mask[:, 0] = 0

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def dp_local(self) -> bool:
        return self.step_rows is not None

    @property
    def total_rows(self) -> int:
        """Rows of the whole step's batch, on all DP ranks together."""
        return self.step_size if self.dp_local else self.batch_size

    def select(self, rows: torch.Tensor | list[int]) -> "RolloutBatch":
        rows = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.lengths[rows].max()) if len(rows) else 1
        updates = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value[rows]
                if f.name == "input_ids" or f.name in TOKEN_FIELDS:
                    value = value[:, :width]
            updates[f.name] = value
        return replace(self, **updates)

    def with_fields(self, **tensors: torch.Tensor) -> "RolloutBatch":
        return replace(self, **tensors)


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Split row indices into `parts` groups of near-equal token totals (longest first, to the lightest)."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        target = min(range(parts), key=lambda p: (loads[p], len(groups[p]), p))
        groups[target].append(row)
        loads[target] += lengths[row]
    return [sorted(g) for g in groups]


def dp_row_owners(lengths: list[int], mini_batch_size: int, dp_size: int) -> list[int]:
    """The DP rank that trains each row of a step: every mini-batch (`mini_batch_size`
    consecutive rows) split across the DP ranks by tokens, as `plan_micro_batches` splits it.
    A row's owner computes its log-probs, values and update, so its tokens go there alone."""
    owners = [0] * len(lengths)
    for start in range(0, len(lengths), mini_batch_size):
        rows = range(start, min(start + mini_batch_size, len(lengths)))
        for rank, part in enumerate(balanced_partition([lengths[r] for r in rows], dp_size)):
            for i in part:
                owners[rows[i]] = rank
    return owners


def cut_by_token_budget(lengths: list[int], rows: list[int], max_tokens: int) -> list[list[int]]:
    """`rows` cut into as few micro-batches as a greedy fill of `max_tokens` needs, balanced by
    tokens: every micro-batch is padded to the longest one, so a greedy fill's short last cut
    (31 rows + 1 row) would cost a whole budget of padding. Falls back to the greedy cuts in the
    rare case balancing overflows the budget (a longer row always gets its own cut)."""
    greedy: list[list[int]] = []
    current: list[int] = []
    used = 0
    for row in rows:
        if current and used + lengths[row] > max_tokens:
            greedy.append(current)
            current, used = [], 0
        current.append(row)
        used += lengths[row]
    if current:
        greedy.append(current)
    if len(greedy) < 2:
        return greedy
    parts = balanced_partition([lengths[r] for r in rows], len(greedy))
    balanced = [[rows[i] for i in part] for part in parts]
    if all(part and sum(lengths[r] for r in part) <= max_tokens for part in balanced):
        return balanced
    return greedy


@dataclass
class PackedMicroBatch:
    """Sequences packed into one row: what the model sees plus how to map outputs back to rows."""

    rows: list[int]  # rows of the source batch, in packing order
    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], restarting at 0 for each sequence
    segment: torch.Tensor  # [L]: which packed sequence each position belongs to (a padding position: its own)
    targets: torch.Tensor  # [1, L]: next token of the same sequence (0 where there is none)
    gather_index: torch.Tensor  # [k, T]: packed position whose output predicts token t of sequence j
    token_valid: torch.Tensor  # [k, T] bool: gather_index is meaningful (1 <= t < length)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[1, 1, L, L] bool, True = masked: block-diagonal causal. Built only for the specs that
        take a mask (THD attention never needs it; at 32k tokens it would be 1 GiB)."""
        length = self.segment.shape[0]
        causal = torch.ones(length, length, dtype=torch.bool, device=self.segment.device).tril()
        return ~(causal & (self.segment[:, None] == self.segment[None, :]))[None, None]

    def as_model_batch(self, thd: bool = False, tail_chunk: int = 64) -> dict[str, Any]:
        """Model inputs. `thd`: Transformer-Engine attention takes sequence boundaries (cu_seqlens)
        instead of a block mask; the padded tail counts as sequences of `tail_chunk` tokens (as
        one sequence it would cost attention quadratic in its length, for outputs nobody reads)."""
        batch = {"input_ids": self.input_ids, "position_ids": self.position_ids, "packed": self}
        if not thd:
            batch["attention_mask"] = self.attention_mask
            return batch
        from megatron.core.packed_seq_params import PackedSeqParams

        starts = (self.position_ids[0] == 0).nonzero().flatten().tolist()
        used = int(self.token_valid.sum()) + len(self.rows)  # tokens of the packed sequences
        bounds = [s for s in starts if s < used] + list(range(used, self.input_ids.shape[1], tail_chunk))
        cu = torch.tensor(bounds + [self.input_ids.shape[1]], dtype=torch.int32, device=self.input_ids.device)
        longest = int((cu[1:] - cu[:-1]).max())
        batch["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=longest, max_seqlen_kv=longest)
        return batch

    def to(self, device: torch.device) -> "PackedMicroBatch":
        """The same micro-batch with its tensors on `device` (the model's)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return PackedMicroBatch(**moved)

    def unpack(self, per_position: torch.Tensor) -> torch.Tensor:
        """[1, L] per-position outputs -> [k, T] per-token values (0 where not valid)."""
        gathered = per_position[0][self.gather_index]
        return torch.where(self.token_valid, gathered, torch.zeros((), dtype=gathered.dtype, device=gathered.device))


def pack_rows(batch: RolloutBatch, rows: list[int], padded_length: int) -> PackedMicroBatch:
    lengths = [int(batch.lengths[r]) for r in rows]
    used = sum(lengths)
    if used > padded_length:
        raise ValueError(f"micro-batch of {used} tokens does not fit padded length {padded_length}")
    width = max(lengths)
    input_ids = torch.zeros(1, padded_length, dtype=torch.long)
    position_ids = torch.zeros(1, padded_length, dtype=torch.long)
    targets = torch.zeros(1, padded_length, dtype=torch.long)
    segment = torch.full((padded_length,), -1, dtype=torch.long)
    gather_index = torch.zeros(len(rows), width, dtype=torch.long)
    token_valid = torch.zeros(len(rows), width, dtype=torch.bool)
    start = 0
    for j, (row, n) in enumerate(zip(rows, lengths)):
        tokens = batch.input_ids[row, :n]
        input_ids[0, start : start + n] = tokens
        position_ids[0, start : start + n] = torch.arange(n)
        targets[0, start : start + n - 1] = tokens[1:]
        segment[start : start + n] = j
        gather_index[j, 1:n] = torch.arange(start, start + n - 1)
        token_valid[j, 1:n] = True
        start += n
    # Padding positions form one-token segments of their own, so no attention row is empty.
    pad = torch.arange(used, padded_length)
    segment[used:] = len(rows) + pad
    position_ids[0, used:] = 0
    return PackedMicroBatch(rows, input_ids, position_ids, segment, targets, gather_index, token_valid)


@dataclass
class MicroBatchPlan:
    """This DP rank's micro-batches of one mini-batch, and the normalizers shared by all ranks."""

    micro_batches: list[PackedMicroBatch]
    padded_length: int
    num_tokens: int  # loss tokens in the whole mini-batch (all DP ranks)
    num_sequences: int  # sequences with at least one loss token, whole mini-batch


def plan_micro_batches(batch: RolloutBatch, max_tokens: int, dp_rank: int, dp_size: int,
                       pad_to_multiple: int = 8) -> MicroBatchPlan:
    """Balance rows across DP ranks by tokens, cut each rank's rows by `max_tokens`, pack them.

    Every rank computes the same cuts (the batch is identical on all ranks), so all micro-batches
    get one padded length (pipeline stages exchange fixed shapes) and every rank runs the same
    number of micro-batches (empty cuts get a padding-only micro-batch).
    """
    lengths = [int(n) for n in batch.lengths]
    _check_fits(lengths, max_tokens)
    per_rank = [cut_by_token_budget(lengths, rows, max_tokens) for rows in balanced_partition(lengths, dp_size)]
    steps = max(len(cuts) for cuts in per_rank)
    longest = max(sum(lengths[r] for r in cut) for cuts in per_rank for cut in cuts)
    mask = batch.loss_mask > 0
    return pack_plan(batch, per_rank[dp_rank], steps, longest, int(mask.sum()), int(mask.any(-1).sum()),
                     pad_to_multiple)


def local_cuts(batch: RolloutBatch, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """A DP-local batch's micro-batch cuts, and [cuts, longest cut, loss tokens, trained
    sequences]: what the DP ranks agree on (max, max, sum, sum) before `pack_plan`."""
    lengths = [int(n) for n in batch.lengths]
    if not lengths:
        return [], [0, 0, 0, 0]
    _check_fits(lengths, max_tokens)
    cuts = cut_by_token_budget(lengths, list(range(len(lengths))), max_tokens)
    mask = batch.loss_mask > 0
    return cuts, [len(cuts), max(sum(lengths[r] for r in cut) for cut in cuts), int(mask.sum()),
                  int(mask.any(-1).sum())]


def pack_plan(batch: RolloutBatch, cuts: list[list[int]], steps: int, longest: int, num_tokens: int,
              num_sequences: int, pad_to_multiple: int = 8) -> MicroBatchPlan:
    """This rank's `cuts` packed to one padded length, padded to `steps` micro-batches."""
    padded = -(-max(longest, 1) // pad_to_multiple) * pad_to_multiple
    mine = cuts + [[]] * (steps - len(cuts))
    micro = [pack_rows(batch, cut, padded) if cut else _padding_only(padded) for cut in mine]
    return MicroBatchPlan(micro, padded, num_tokens, num_sequences)


def _check_fits(lengths: list[int], max_tokens: int) -> None:
    if max(lengths) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds actor.max_tokens_per_microbatch={max_tokens}; "
                         "raise it or lower rollout.max_prompt_tokens + rollout.max_response_tokens")


def _padding_only(padded_length: int) -> PackedMicroBatch:
    zeros = torch.zeros(1, padded_length, dtype=torch.long)
    empty = torch.zeros(0, 1, dtype=torch.long)
    return PackedMicroBatch([], zeros, zeros, torch.arange(padded_length), zeros, empty, empty.bool())
