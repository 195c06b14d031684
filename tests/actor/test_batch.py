"""Packing rows into micro-batches: masks for the local specs, cu_seqlens for Transformer-Engine,
slots that a context-parallel group splits."""
import torch

from rlfactory_megatron.actor.batch import RolloutBatch, plan_micro_batches
from rlfactory_megatron.models.context_parallel import ContextSplit, split_positions
from toy_rows import toy_batch


def make_batch():
    return toy_batch([[], [], []], [[1, 2, 3, 4, 5], [6, 7, 8], [11, 12, 13, 14]])


def test_packed_rows_targets_and_block_mask():
    plan = plan_micro_batches(make_batch(), max_tokens=16, dp_rank=0, dp_size=1)
    (mb,) = plan.micro_batches
    assert plan.padded_length == 16 and mb.rows == [0, 1, 2]
    assert mb.input_ids[0, :12].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14]
    assert mb.targets[0, :5].tolist() == [2, 3, 4, 5, 0]  # the last token of a sequence predicts nothing
    mask = mb.attention_mask[0, 0]
    assert not mask[6, 5] and mask[5, 4]  # row 1 attends to itself, never to row 0
    assert mask[12, 12] == False and mask[12, 11]  # padding attends only to itself  # noqa: E712
    assert mb.unpack(torch.arange(16.0)[None])[1].tolist() == [0.0, 5.0, 6.0, 0.0, 0.0]


def test_thd_inputs_mark_every_sequence_and_the_padded_tail():
    (mb,) = plan_micro_batches(make_batch(), max_tokens=16, dp_rank=0, dp_size=1).micro_batches
    batch = mb.as_model_batch(thd=True)
    params = batch["packed_seq_params"]
    assert "attention_mask" not in batch and params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 5, 8, 12, 16] and params.max_seqlen_q == 5
    tail = mb.as_model_batch(thd=True, tail_chunk=3)["packed_seq_params"]  # a long tail: short pieces
    assert tail.cu_seqlens_q.tolist() == [0, 5, 8, 12, 15, 16] and tail.max_seqlen_q == 5


def test_dp_ranks_share_rows_by_tokens_and_run_the_same_number_of_micro_batches():
    batch = make_batch()
    plans = [plan_micro_batches(batch, max_tokens=5, dp_rank=r, dp_size=2) for r in range(2)]
    rows = sorted(r for p in plans for mb in p.micro_batches for r in mb.rows)
    assert rows == [0, 1, 2]
    assert len(plans[0].micro_batches) == len(plans[1].micro_batches)
    assert plans[0].num_tokens == plans[1].num_tokens == int(batch.loss_mask.sum())


def test_micro_batches_are_balanced_so_padding_stays_small():
    # A greedy fill of 100 tokens cuts 9 x 11 rows + 1 row, both padded to 104; balanced: 2 x ~55.
    lengths = torch.tensor([11] * 10)
    batch = RolloutBatch(torch.ones(10, 11, dtype=torch.long), lengths, torch.ones(10, 11))
    plan = plan_micro_batches(batch, max_tokens=100, dp_rank=0, dp_size=1)
    assert [len(mb.rows) for mb in plan.micro_batches] == [5, 5]
    assert plan.padded_length == 56
    assert sorted(r for mb in plan.micro_batches for r in mb.rows) == list(range(10))


def test_cuts_never_exceed_the_budget():
    lengths = torch.tensor([60, 50, 50, 40, 30, 20, 10, 90])
    batch = RolloutBatch(torch.ones(8, 90, dtype=torch.long), lengths, torch.ones(8, 90))
    for budget in (90, 100, 120, 200, 350):
        plan = plan_micro_batches(batch, max_tokens=budget, dp_rank=0, dp_size=1)
        assert all(sum(int(lengths[r]) for r in mb.rows) <= budget for mb in plan.micro_batches), budget
        assert sorted(r for mb in plan.micro_batches for r in mb.rows) == list(range(8))


def test_context_parallel_slots_are_multiples_of_2cp_and_each_rank_holds_its_chunks():
    # cp=2: 5, 3 and 4 tokens take slots of 8, 4 and 4 positions; the budget counts the slots.
    plan = plan_micro_batches(make_batch(), max_tokens=16, dp_rank=0, dp_size=1, align=4)
    (mb,) = plan.micro_batches
    assert mb.slots == [0, 8, 12, 16] and mb.thd_bounds() == [0, 8, 12, 16] and plan.padded_length == 16
    assert mb.input_ids[0].tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 0, 11, 12, 13, 14]
    assert mb.targets[0, :8].tolist() == [2, 3, 4, 5, 0, 0, 0, 0]  # the slot's padding predicts nothing
    assert mb.unpack(torch.arange(16.0)[None])[1].tolist() == [0.0, 8.0, 9.0, 0.0, 0.0]
    layout = split_positions(mb.thd_bounds(), 2)
    assert layout.tolist() == [[0, 1, 6, 7, 8, 11, 12, 15], [2, 3, 4, 5, 9, 10, 13, 14]]
    shard = mb.context_shard(ContextSplit(layout, 1, None))
    assert shard.input_ids[0].tolist() == [3, 4, 5, 0, 7, 8, 12, 13] and shard.targets[0].tolist() == [4, 5, 0, 0, 8, 0, 13, 14]
    assert shard.gather_index.equal(mb.gather_index)  # still the whole pack's positions
    # A budget of 12 cuts the 16 slot positions in two; the padded tails go in pieces of 2 x cp too.
    cuts = plan_micro_batches(make_batch(), max_tokens=12, dp_rank=0, dp_size=1, pad_to_multiple=16, align=4)
    assert {tuple(mb.rows): mb.thd_bounds(tail_chunk=3) for mb in cuts.micro_batches} == {
        (0,): [0, 8, 12, 16], (1, 2): [0, 4, 8, 12, 16]}
