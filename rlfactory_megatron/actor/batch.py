"""The batch record of trajectories and its packing into token-budgeted Megatron micro-batches.

Token arrays are [B, T] (right-padded); every per-token quantity at index t belongs to token t,
i.e. to the prediction made at position t-1. Token 0 of a sequence is never trained on.
Packing concatenates whole sequences into one row per micro-batch (no padding waste), with
block-diagonal causal attention and per-sequence position ids, and cuts micro-batches by a
token budget; loss normalization is global, so cuts never change an update. Under context
parallelism each sequence's slot is padded to a multiple of 2 x cp and every rank of the CP
group runs its share of the pack's positions (models/context_parallel.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

import torch
import torch.distributed as dist

from rlfactory_megatron.models.context_parallel import ContextSplit

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
    # [B, T, layers, top-k] int16: the experts each token took in each MoE layer, where its
    # log-prob was computed (routing replay; actor/routing.py); -1 where none was recorded.
    routes: Optional[torch.Tensor] = None
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
        if self.routes is not None and (self.routes.dim() != 4 or self.routes.shape[:2] != (b, t)):
            raise ValueError(f"routes must be [batch, tokens, layers, top-k] like input_ids, got {list(self.routes.shape)}")
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
                if f.name in ("input_ids", "routes") or f.name in TOKEN_FIELDS:
                    value = value[:, :width]
            updates[f.name] = value
        return replace(self, **updates)

    def with_fields(self, **tensors: torch.Tensor) -> "RolloutBatch":
        return replace(self, **tensors)


def pad_rows(ids_list: list[list[int]], masks: list[list[int]], group_size: int = 1,
             step_rows: list[int] | None = None, step_size: int = 0) -> RolloutBatch:
    """Rows as one right-padded batch; with `step_rows`, a DP-local batch of those rows of the
    step's `step_size` (group ids from the step's numbering)."""
    width = max((len(ids) for ids in ids_list), default=1)
    ids = torch.zeros(len(ids_list), width, dtype=torch.long)
    mask = torch.zeros(len(ids_list), width)
    for row, (seq, m) in enumerate(zip(ids_list, masks)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(m)] = torch.tensor(m, dtype=torch.float32)
    lengths = torch.tensor([len(seq) for seq in ids_list], dtype=torch.long)
    if step_rows is None:
        return RolloutBatch(ids, lengths, mask, group_ids=torch.arange(len(ids_list)) // group_size)
    rows = torch.tensor(step_rows, dtype=torch.long)
    return RolloutBatch(ids, lengths, mask, group_ids=rows // group_size, step_rows=rows, step_size=step_size)


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


def slot_length(length: int, align: int) -> int:
    """Positions a sequence of `length` tokens takes in a pack whose slots are multiples of `align`."""
    return -(-length // align) * align


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
    slots: list[int]  # where each sequence's slot starts, then where the last one ends (the packed tail's start)
    align: int = 1  # every slot's length is a multiple of this (2 x cp)
    # Context parallelism: the positions (of input_ids, position_ids, segment, targets) are this
    # rank's share of the pack's (see context_shard); gather_index still indexes the whole pack.
    context: Optional[ContextSplit] = None

    @property
    def attention_mask(self) -> torch.Tensor:
        """[1, 1, L, L] bool, True = masked: block-diagonal causal. Built only for the specs that
        take a mask (THD attention never needs it; at 32k tokens it would be 1 GiB)."""
        length = self.segment.shape[0]
        causal = torch.ones(length, length, dtype=torch.bool, device=self.segment.device).tril()
        return ~(causal & (self.segment[:, None] == self.segment[None, :]))[None, None]

    def thd_bounds(self, tail_chunk: int = 64) -> list[int]:
        """THD sequence boundaries (cu_seqlens): every sequence's slot, then the padded tail as
        sequences of `tail_chunk` positions (as one sequence it would cost attention quadratic in
        its length, for outputs nobody reads), rounded up to the slots' multiple."""
        tail_chunk = slot_length(tail_chunk, self.align)
        return self.slots[:-1] + list(range(self.slots[-1], self.input_ids.shape[1], tail_chunk)) + [
            self.input_ids.shape[1]]

    def as_model_batch(self, thd: bool = False, tail_chunk: int = 64,
                       context_group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
        """Model inputs. `thd`: Transformer-Engine attention and local_sdpa take sequence
        boundaries (cu_seqlens, thd_bounds) instead of a block mask. `context_group`: a CP group of
        more than one rank, among which the pack's positions are split (THD only): the inputs and
        the "packed" micro-batch are this rank's share; the boundaries stay the whole pack's."""
        batch = {"input_ids": self.input_ids, "position_ids": self.position_ids, "packed": self}
        if not thd:
            if context_group is not None:
                raise ValueError("context parallelism needs packed THD attention (model.layer_spec local_sdpa or "
                                 "transformer_engine)")
            batch["attention_mask"] = self.attention_mask
            return batch
        from megatron.core.packed_seq_params import PackedSeqParams

        bounds = self.thd_bounds(tail_chunk)
        cu = torch.tensor(bounds, dtype=torch.int32, device=self.input_ids.device)
        longest = int((cu[1:] - cu[:-1]).max())
        batch["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=longest, max_seqlen_kv=longest)
        if context_group is not None:
            shard = self.context_shard(ContextSplit.of(bounds, context_group, self.input_ids.device))
            batch.update(input_ids=shard.input_ids, position_ids=shard.position_ids, packed=shard)
        return batch

    def context_shard(self, split: ContextSplit) -> "PackedMicroBatch":
        """This CP rank's share of the pack: its positions of the per-position inputs; unpack()
        gathers per-position outputs back from the whole group."""
        mine = split.positions
        return replace(self, input_ids=self.input_ids[:, mine], position_ids=self.position_ids[:, mine],
                       segment=self.segment[mine], targets=self.targets[:, mine], context=split)

    def to(self, device: torch.device) -> "PackedMicroBatch":
        """The same micro-batch with its tensors on `device` (the model's)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return PackedMicroBatch(**moved)

    def unpack(self, per_position: torch.Tensor) -> torch.Tensor:
        """[1, L] per-position outputs -> [k, T] per-token values (0 where not valid). A CP
        shard's [1, L / cp] outputs are all-gathered from its group first (differentiably)."""
        positions = per_position[0] if self.context is None else self.context.gather(per_position[0])
        gathered = positions[self.gather_index]
        return torch.where(self.token_valid, gathered, torch.zeros((), dtype=gathered.dtype, device=gathered.device))


def pack_rows(batch: RolloutBatch, rows: list[int], padded_length: int, align: int = 1) -> PackedMicroBatch:
    """`rows` back to back in one row of `padded_length` positions, each in a slot of a multiple of
    `align` positions (its padding continues its positions and segment; causal attention never
    lets a real token see it)."""
    lengths = [int(batch.lengths[r]) for r in rows]
    used = sum(slot_length(n, align) for n in lengths)
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
    slots = []
    for j, (row, n) in enumerate(zip(rows, lengths)):
        tokens = batch.input_ids[row, :n]
        slot = slot_length(n, align)
        input_ids[0, start : start + n] = tokens
        position_ids[0, start : start + slot] = torch.arange(slot)
        targets[0, start : start + n - 1] = tokens[1:]
        segment[start : start + slot] = j
        gather_index[j, 1:n] = torch.arange(start, start + n - 1)
        token_valid[j, 1:n] = True
        slots.append(start)
        start += slot
    # Padding positions form one-token segments of their own, so no attention row is empty.
    pad = torch.arange(used, padded_length)
    segment[used:] = len(rows) + pad
    position_ids[0, used:] = 0
    return PackedMicroBatch(rows, input_ids, position_ids, segment, targets, gather_index, token_valid,
                            slots + [used], align)


@dataclass
class MicroBatchPlan:
    """This DP rank's micro-batches of one mini-batch, and the normalizers shared by all ranks."""

    micro_batches: list[PackedMicroBatch]
    padded_length: int
    num_tokens: int  # loss tokens in the whole mini-batch (all DP ranks)
    num_sequences: int  # sequences with at least one loss token, whole mini-batch


def plan_micro_batches(batch: RolloutBatch, max_tokens: int, dp_rank: int, dp_size: int,
                       pad_to_multiple: int = 8, align: int = 1) -> MicroBatchPlan:
    """Balance rows across DP ranks by tokens, cut each rank's rows by `max_tokens`, pack them
    (in slots of a multiple of `align` positions, which the cuts count).

    Every rank computes the same cuts (the batch is identical on all ranks), so all micro-batches
    get one padded length (pipeline stages exchange fixed shapes) and every rank runs the same
    number of micro-batches (empty cuts get a padding-only micro-batch).
    """
    _check_fits([int(n) for n in batch.lengths], max_tokens)
    lengths = [slot_length(int(n), align) for n in batch.lengths]
    per_rank = [cut_by_token_budget(lengths, rows, max_tokens) for rows in balanced_partition(lengths, dp_size)]
    steps = max(len(cuts) for cuts in per_rank)
    longest = max(sum(lengths[r] for r in cut) for cuts in per_rank for cut in cuts)
    mask = batch.loss_mask > 0
    return pack_plan(batch, per_rank[dp_rank], steps, longest, int(mask.sum()), int(mask.any(-1).sum()),
                     pad_to_multiple, align)


def local_cuts(batch: RolloutBatch, max_tokens: int, align: int = 1) -> tuple[list[list[int]], list[int]]:
    """A DP-local batch's micro-batch cuts, and [cuts, longest cut, loss tokens, trained
    sequences]: what the DP ranks agree on (max, max, sum, sum) before `pack_plan`."""
    if not len(batch.lengths):
        return [], [0, 0, 0, 0]
    _check_fits([int(n) for n in batch.lengths], max_tokens)
    lengths = [slot_length(int(n), align) for n in batch.lengths]
    cuts = cut_by_token_budget(lengths, list(range(len(lengths))), max_tokens)
    mask = batch.loss_mask > 0
    return cuts, [len(cuts), max(sum(lengths[r] for r in cut) for cut in cuts), int(mask.sum()),
                  int(mask.any(-1).sum())]


def pack_plan(batch: RolloutBatch, cuts: list[list[int]], steps: int, longest: int, num_tokens: int,
              num_sequences: int, pad_to_multiple: int = 8, align: int = 1) -> MicroBatchPlan:
    """This rank's `cuts` packed to one padded length, padded to `steps` micro-batches."""
    padded = slot_length(max(longest, 1), pad_to_multiple)
    mine = cuts + [[]] * (steps - len(cuts))
    micro = [pack_rows(batch, cut, padded, align) if cut else _padding_only(padded, align) for cut in mine]
    return MicroBatchPlan(micro, padded, num_tokens, num_sequences)


def _check_fits(lengths: list[int], max_tokens: int) -> None:
    if max(lengths) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds actor.max_tokens_per_microbatch={max_tokens}; "
                         "raise it or lower rollout.max_prompt_tokens + rollout.max_response_tokens")


def _padding_only(padded_length: int, align: int = 1) -> PackedMicroBatch:
    zeros = torch.zeros(1, padded_length, dtype=torch.long)
    empty = torch.zeros(0, 1, dtype=torch.long)
    return PackedMicroBatch([], zeros, zeros, torch.arange(padded_length), zeros, empty, empty.bool(), [0], align)
