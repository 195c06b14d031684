"""Core attention on torch's fused scaled_dot_product_attention, for megatron's local (non-TE) layer spec.

megatron's local DotProductAttention materializes [b, heads, s, s] scores and softmaxes them in
Python-level ops; on CPU that costs several times the fused kernel torch ships. Same inputs,
outputs and masking convention, so it drops into the spec as `core_attention`. It also takes
packed THD sequences (cu_seqlens), the layout the actor uses with the TE spec, and, on CPU,
splits them over a context-parallel group exactly (keys and values all-gathered).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from rlfactory_megatron.models.context_parallel import ContextSplit, all_gather_positions
from rlfactory_megatron.runtime.cpu_compat import cuda_available


class SDPACoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        self.cp_group = None
        if config.context_parallel_size > 1:
            if cuda_available():
                raise ValueError("context parallelism on GPU is Transformer-Engine's attention: set "
                                 "model.layer_spec=transformer_engine (or auto), or parallel.cp=1")
            self.cp_group = pg_collection.cp
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPACoreAttention")
        if self.cp_group is not None:
            if packed_seq_params is None:
                raise ValueError("SDPACoreAttention under context parallelism takes packed THD sequences (cu_seqlens)")
            return self._context_parallel(query, key, value, packed_seq_params)
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
        bounds = _thd_bounds(params)
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


    def _context_parallel(self, query, key, value, params):
        """This CP rank's queries of the pack ([t/cp, heads, dim], ContextSplit's layout) attend
        to the keys and values of the whole sequences they belong to, all-gathered from the group."""
        if self.training and self.dropout_p > 0:
            raise ValueError("SDPACoreAttention under context parallelism has no attention dropout; set it to 0")
        bounds = _thd_bounds(params)
        split = ContextSplit.of(bounds, self.cp_group, query.device)
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [heads, t/cp, dim]
        out = _ContextParallelAttention.apply(q, k, v, split, _query_blocks(bounds, split), self.softmax_scale)
        return out.transpose(0, 1).reshape(out.shape[1], -1)


def _thd_bounds(params) -> list[int]:
    if params.qkv_format != "thd":
        raise ValueError(f"SDPACoreAttention: packed qkv_format '{params.qkv_format}' is not supported; use thd")
    bounds = params.cu_seqlens_q.tolist()
    if params.cu_seqlens_kv.tolist() != bounds:
        raise ValueError("SDPACoreAttention: packed sequences need equal query and key/value boundaries")
    return bounds


def _query_blocks(bounds: list[int], split: ContextSplit) -> list[tuple[int, int, int, int]]:
    """(first local query row, rows, first key of the sequence, first key of the block's own chunk)
    per chunk this rank holds: its queries see the sequence's keys before the chunk in full and
    the chunk's own keys causally."""
    size = split.layout.shape[0]
    blocks, row = [], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * size)
        for index in (split.rank, 2 * size - 1 - split.rank):
            if chunk:
                blocks.append((row, chunk, start, start + index * chunk))
            row += chunk
    return blocks


# torch's CPU flash attention, with the log-sum-exp of each query row that SDPA does not return:
# what merging a query's attention over two key ranges needs (as ring attention merges its steps).
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _ContextParallelAttention(torch.autograd.Function):
    """Causal attention of this rank's query chunks over their whole sequences: keys and values
    all-gathered from the CP group in the forward and again in the backward (only this rank's
    are kept for it, as Transformer-Engine's CP attention keeps them), whose key/value gradients
    are summed over the group before each rank takes its own positions. Each chunk attends to the
    keys before it in full and to its own causally, two flash calls merged by their log-sum-exps."""

    @staticmethod
    def forward(ctx, q, k, v, split, blocks, scale):
        keys = all_gather_positions(k.transpose(0, 1), split.layout, split.group).transpose(0, 1)
        values = all_gather_positions(v.transpose(0, 1), split.layout, split.group).transpose(0, 1)
        outs, lses = [], []  # the blocks cover the query rows in order
        for row, rows, first, own in blocks:
            query = q[None, :, row:row + rows]
            o, m = _FLASH(query, keys[None, :, own:own + rows], values[None, :, own:own + rows], 0.0, True,
                          scale=scale)
            if own > first:
                o_before, m_before = _FLASH(query, keys[None, :, first:own], values[None, :, first:own], 0.0, False,
                                            scale=scale)
                merged = torch.logaddexp(m, m_before)
                o = ((m - merged).exp()[..., None] * o.to(m.dtype)
                     + (m_before - merged).exp()[..., None] * o_before.to(m.dtype)).to(q.dtype)
                m = merged
            outs.append(o[0])
            lses.append(m[0])
        out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.split, ctx.blocks, ctx.scale = split, blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        split = ctx.split
        keys = all_gather_positions(k.transpose(0, 1), split.layout, split.group).transpose(0, 1)
        values = all_gather_positions(v.transpose(0, 1), split.layout, split.group).transpose(0, 1)
        grad_q, grad_keys, grad_values = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        grad_out = grad_out.contiguous()
        for row, rows, first, own in ctx.blocks:
            # With the merged output and log-sum-exp, each key range's backward gives its exact share.
            pieces = [(own, own + rows, True)] + ([(first, own, False)] if own > first else [])
            args = (grad_out[None, :, row:row + rows], q[None, :, row:row + rows])
            for lo, hi, causal in pieces:
                dq, dk, dv = _FLASH_BACKWARD(*args, keys[None, :, lo:hi], values[None, :, lo:hi],
                                             out[None, :, row:row + rows], lse[None, :, row:row + rows], 0.0, causal,
                                             scale=ctx.scale)
                grad_q[:, row:row + rows] += dq[0]
                grad_keys[:, lo:hi] += dk[0]
                grad_values[:, lo:hi] += dv[0]
        # Every rank's queries saw every key: their gradients add up, then each rank keeps its own.
        grads = torch.stack([grad_keys, grad_values])
        dist.all_reduce(grads, group=split.group)
        own = split.positions
        return grad_q, grads[0][:, own], grads[1][:, own], None, None, None


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
