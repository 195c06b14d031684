"""Core attention on torch's fused scaled_dot_product_attention, for megatron's local (non-TE) layer spec.

megatron's local DotProductAttention materializes [b, heads, s, s] scores and softmaxes them in
Python-level ops; on CPU that costs several times the fused kernel torch ships. Same inputs,
outputs and masking convention, so it drops into the spec as `core_attention`. It also takes
packed THD sequences (cu_seqlens), the layout the actor uses with the TE spec.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("SDPACoreAttention does not support context parallelism; use the TE layer spec")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPACoreAttention")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        # [s, b, heads, dim] -> [b, heads, s, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask_type = attn_mask_type or self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal and q.shape[2] > 1
        # megatron's masks mark positions to hide; SDPA's boolean masks mark positions to keep.
        keep = None if attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, is_causal=causal, scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0, enable_gqa=q.shape[1] != k.shape[1])
        b, heads, s, dim = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * dim)

    def _packed(self, query, key, value, params):
        """THD input ([t, heads, dim], sequences back to back at cu_seqlens): causal attention per
        sequence. A block-diagonal mask over the whole pack costs (sum of lengths)^2; this costs
        about the sum of squares and allocates no mask. Sequences of similar length go through
        one batched SDPA call, right-padded to the longest of their group (a causal query never
        sees the padding after it): one call per sequence costs ~2x on CPU for ~100-token rows."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPACoreAttention: packed qkv_format '{params.qkv_format}' is not supported; use thd")
        bounds = params.cu_seqlens_q.tolist()
        if params.cu_seqlens_kv.tolist() != bounds:
            raise ValueError("SDPACoreAttention: packed sequences need equal query and key/value boundaries")
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [heads, t, dim]
        spans = [(start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
        outs, positions = [], []
        for group in _length_groups(spans):
            longest = group[0][1] - group[0][0]
            lengths = torch.tensor([end - start for start, end in group], device=q.device)
            starts = torch.tensor([start for start, _ in group], device=q.device)
            offsets = torch.arange(longest, device=q.device)
            valid = offsets[None, :] < lengths[:, None]  # [B, L]
            # padded slots repeat the row's last token: in range, and never attended (causal)
            index = starts[:, None] + torch.minimum(offsets[None, :], lengths[:, None] - 1)
            qb, kb, vb = (t[:, index].transpose(0, 1) for t in (q, k, v))  # [B, heads, L, dim]
            out = F.scaled_dot_product_attention(
                qb, kb, vb, is_causal=longest > 1, scale=self.softmax_scale,
                dropout_p=self.dropout_p if self.training else 0.0, enable_gqa=q.shape[0] != k.shape[0])
            outs.append(out.transpose(0, 1)[:, valid])  # [heads, tokens of the group, dim]
            positions.append(index[valid])
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])  # every position lies in one span
        out[:, torch.cat(positions)] = torch.cat(outs, dim=1)  # back to pack order
        return out.transpose(0, 1).reshape(out.shape[1], -1)


def _length_groups(spans: list[tuple[int, int]], max_waste: float = 2.0) -> list[list[tuple[int, int]]]:
    """Spans grouped longest first, a group growing while padding all of it to its longest costs
    at most `max_waste` x the attention of its sequences alone (sum of squared lengths)."""
    groups: list[list[tuple[int, int]]] = []
    exact = 0
    for span in sorted(spans, key=lambda se: se[0] - se[1]):
        n = span[1] - span[0]
        if groups:
            longest = groups[-1][0][1] - groups[-1][0][0]
            if (len(groups[-1]) + 1) * longest**2 <= max_waste * (exact + n * n):
                groups[-1].append(span)
                exact += n * n
                continue
        groups.append([span])
        exact = n * n
    return groups
