"""The CPU core attention: packed THD sequences (cu_seqlens) give exactly what a block-diagonal
causal mask over the same pack gives, including GQA and the padded tail."""
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from rlfactory_megatron.models.sdpa_attention import SDPACoreAttention


import pytest

from rlfactory_megatron.models.sdpa_attention import _length_groups


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
