"""The CPU core attention: packed THD sequences (cu_seqlens) give exactly what a block-diagonal
causal mask over the same pack gives, including GQA and the padded tail; split over a
context-parallel group, each rank's share of the outputs and gradients is the whole pack's."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from rlfactory_megatron.models.context_parallel import ContextSplit, split_positions
from rlfactory_megatron.models.sdpa_attention import SDPACoreAttention, _length_groups
from rlfactory_megatron.runtime.distributed import spawn_local_workers


@pytest.mark.parametrize("lengths", [
    [5, 1, 9, 3],  # the last one stands for the padded tail
    [1, 2, 7, 30, 31, 64, 64, 5, 100, 3, 64, 64, 1],  # several length groups, padded within each
])
def test_packed_thd_equals_block_diagonal_mask(lengths):
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                               kv_channels=32)
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self").eval()
    total = sum(lengths)
    q = torch.randn(total, 1, 4, 32, requires_grad=True)
    k, v = torch.randn(total, 1, 2, 32, requires_grad=True), torch.randn(total, 1, 2, 32, requires_grad=True)

    hide = torch.ones(total, total, dtype=torch.bool)  # megatron convention: True = masked out
    start = 0
    for n in lengths:
        hide[start:start + n, start:start + n] = ~torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    masked = attention(q, k, v, hide[None, None])  # [s, b, hidden]

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    packed = attention(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=params)  # [t, hidden]
    assert packed.shape == (total, 128)
    torch.testing.assert_close(packed, masked[:, 0], atol=1e-6, rtol=1e-5)
    weights = torch.randn(total, 128)
    grads_masked = torch.autograd.grad((masked[:, 0] * weights).sum(), (q, k, v))
    grads_packed = torch.autograd.grad((packed * weights).sum(), (q, k, v))
    for a, b in zip(grads_packed, grads_masked):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_length_groups_cover_every_span_once_and_bound_the_padding():
    spans, start = [], 0
    for n in [1, 2, 7, 30, 31, 64, 64, 5, 100, 3, 64, 64, 1, 500]:
        spans.append((start, start + n))
        start += n
    groups = _length_groups(spans)
    assert sorted(s for g in groups for s in g) == spans
    assert groups[0][0] == (start - 500, start) and len(groups) > 2  # longest first; short ones not padded to it
    for group in groups:
        longest = max(e - s for s, e in group)
        assert len(group) * longest**2 <= 2.0 * sum((e - s) ** 2 for s, e in group)


def test_cp_split_keeps_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence():
    # Two sequences of 8 and 4 positions over 2 ranks: chunks of 2 and 1.
    assert split_positions([0, 8, 12], 2).tolist() == [[0, 1, 6, 7, 8, 11], [2, 3, 4, 5, 9, 10]]
    with pytest.raises(ValueError, match="a packed sequence of 6 positions .* multiple of 4"):
        split_positions([0, 6], 2)


def _cp_attention_worker(lengths: list[int]) -> dict[str, float]:
    """Outputs and gradients of this rank's share under CP vs the whole pack on one rank, fp64."""
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        total, size = sum(lengths), dist.get_world_size()
        q = torch.randn(total, 4, 32, dtype=torch.float64)
        k, v = torch.randn(total, 2, 32, dtype=torch.float64), torch.randn(total, 2, 32, dtype=torch.float64)
        weights = torch.randn(total, 128, dtype=torch.float64)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        shape = dict(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                     attention_dropout=0.0)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = SDPACoreAttention(TransformerConfig(**shape), 1, AttnMaskType.causal, "self")(
            *whole, None, packed_seq_params=params)
        (reference * weights).sum().backward()
        mine = ContextSplit.of(cu.tolist(), dist.group.WORLD).positions
        local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
        attention = SDPACoreAttention(TransformerConfig(**shape, context_parallel_size=size), 1, AttnMaskType.causal,
                                      "self", pg_collection=SimpleNamespace(cp=dist.group.WORLD))
        out = attention(*local, None, packed_seq_params=params)
        (out * weights[mine]).sum().backward()
        diffs = {"out": (out - reference[mine]).abs().max().item()}
        for name, a, b in zip("qkv", local, whole):
            diffs[f"d{name}"] = (a.grad - b.grad[mine]).abs().max().item()
        return diffs
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cp,lengths", [(2, [8, 4, 12, 64]), (3, [18, 6, 42, 6])])
def test_context_parallel_attention_is_exact(cp, lengths):
    # Sequences of several chunk sizes (the last one stands for the padded tail); at cp=3 every
    # rank's second chunk of a sequence lies past its first with another one between them.
    for diffs in spawn_local_workers(_cp_attention_worker, cp, lengths):
        assert max(diffs.values()) < 1e-12, diffs
