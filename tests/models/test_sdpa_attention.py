"""The CPU core attention: packed THD sequences (cu_seqlens) give exactly what a block-diagonal
causal mask over the same pack gives, including GQA and the padded tail."""
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from rlfactory_megatron.models.sdpa_attention import SDPACoreAttention


def test_packed_thd_equals_block_diagonal_mask():
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                               kv_channels=32)
    attention = SDPACoreAttention(config, 1, AttnMaskType.causal, "self").eval()
    lengths = [5, 1, 9, 3]  # the last one stands for the padded tail
    total = sum(lengths)
    q = torch.randn(total, 1, 4, 32)
    k, v = torch.randn(total, 1, 2, 32), torch.randn(total, 1, 2, 32)

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
