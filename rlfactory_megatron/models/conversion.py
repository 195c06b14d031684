"""HF <-> Megatron weights, table-driven and sharded by TP and PP.

`PARAM_RULES` maps each megatron parameter (local and Transformer-Engine names) to its
HF tensor(s) and how it is split across tensor-parallel ranks. A MoE expert's parameters
are split over the expert-TP group and live on one rank of the expert-parallel group, which
holds a contiguous block of experts: its local expert index plus the block's offset is HF's.
Loading reads only this rank's slices from safetensors; exporting streams `(hf_name,
full_tensor)` one tensor at a time (TP all-gather, for experts then an EP all-gather, then PP
broadcast), which is what weight sync and HF export consume.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlfactory_megatron.models.builder import ValueHead
from rlfactory_megatron.models.hf_arch import ModelArch
from rlfactory_megatron.models.hf_checkpoint import CheckpointError, HFCheckpointReader
from rlfactory_megatron.runtime.cpu_compat import compute_device


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter pattern and the HF tensors it is made of."""

    mcore: str  # regex over the chunk-local megatron name; (?P<layer>) is the local layer index,
    # (?P<expert>) the expert's index on this expert-parallel rank
    hf: tuple[str, ...]  # HF names; {layer} is the global layer index, {expert} the global expert index
    split: str  # replicated | column | row | vocab | qkv | gate_up


_L = r"decoder\.layers\.(?P<layer>\d+)\."
_H = "model.layers.{layer}."
_E = _H + "mlp.experts.{expert}."
# An expert's SwiGLU: the local spec's SequentialMLP holds one module per expert, the TE spec's
# TEGroupedMLP one weight per expert in a shared module.
_EXPERT_FC1 = (_E + "gate_proj.weight", _E + "up_proj.weight")
_EXPERT_FC2 = (_E + "down_proj.weight",)
PARAM_RULES: tuple[ParamRule, ...] = (
    ParamRule(r"embedding\.word_embeddings\.weight", ("model.embed_tokens.weight",), "vocab"),
    ParamRule(_L + r"input_layernorm\.weight", (_H + "input_layernorm.weight",), "replicated"),
    ParamRule(_L + r"self_attention\.linear_qkv\.layer_norm_weight", (_H + "input_layernorm.weight",), "replicated"),
    ParamRule(_L + r"self_attention\.linear_qkv\.weight",
              tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    ParamRule(_L + r"self_attention\.linear_qkv\.bias", tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    ParamRule(_L + r"self_attention\.q_layernorm\.weight", (_H + "self_attn.q_norm.weight",), "replicated"),
    ParamRule(_L + r"self_attention\.k_layernorm\.weight", (_H + "self_attn.k_norm.weight",), "replicated"),
    ParamRule(_L + r"self_attention\.linear_proj\.weight", (_H + "self_attn.o_proj.weight",), "row"),
    ParamRule(_L + r"pre_mlp_layernorm\.weight", (_H + "post_attention_layernorm.weight",), "replicated"),
    ParamRule(_L + r"mlp\.linear_fc1\.layer_norm_weight", (_H + "post_attention_layernorm.weight",), "replicated"),
    ParamRule(_L + r"mlp\.linear_fc1\.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up"),
    ParamRule(_L + r"mlp\.linear_fc2\.weight", (_H + "mlp.down_proj.weight",), "row"),
    ParamRule(_L + r"mlp\.router\.weight", (_H + "mlp.gate.weight",), "replicated"),
    ParamRule(_L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc1\.weight", _EXPERT_FC1, "gate_up"),
    ParamRule(_L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc2\.weight", _EXPERT_FC2, "row"),
    ParamRule(_L + r"mlp\.experts\.linear_fc1\.weight(?P<expert>\d+)", _EXPERT_FC1, "gate_up"),
    ParamRule(_L + r"mlp\.experts\.linear_fc2\.weight(?P<expert>\d+)", _EXPERT_FC2, "row"),
    ParamRule(r"decoder\.final_layernorm\.weight", ("model.norm.weight",), "replicated"),
    ParamRule(r"output_layer\.weight", ("lm_head.weight",), "vocab"),
)
VALUE_HEAD_HF_NAME = "value_head.weight"
_COMPILED = tuple((re.compile(rule.mcore + "$"), rule) for rule in PARAM_RULES)


@dataclass
class BoundParam:
    """A parameter of this rank with the HF names it corresponds to."""

    mcore_name: str
    param: torch.nn.Parameter
    hf_names: tuple[str, ...]
    split: str
    export: bool = True  # False for the last stage's copy of tied embeddings
    # An expert's parameter: its HF names on every rank of the expert-parallel group (this rank's
    # are `hf_names`), which the export gathers; empty for every other parameter.
    ep_hf_names: tuple[tuple[str, ...], ...] = ()

    @property
    def expert(self) -> bool:
        return bool(self.ep_hf_names)

    @property
    def export_names(self) -> tuple[str, ...]:
        """The HF tensors exporting this parameter yields, in order: every EP rank's for an expert."""
        return tuple(name for names in self.ep_hf_names for name in names) or self.hf_names


def _tp(expert: bool = False):
    """(rank, size, group) of the TP group that splits a parameter: the expert-TP one for an expert's."""
    from megatron.core import parallel_state

    if expert:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_group())
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def hf_names_of(rule: ParamRule, match: re.Match, layer_numbers: dict[int, int], experts_per_rank: int,
                ep: int) -> tuple[tuple[str, ...], ...]:
    """The HF names a matched megatron parameter stands for on each of the `ep` expert-parallel
    ranks (one tuple unless it is an expert's, whose global index depends on the rank)."""
    fields = match.groupdict()
    layer = layer_numbers[int(fields["layer"])] if "layer" in fields else None
    if "expert" not in fields:
        return (tuple(n.format(layer=layer) for n in rule.hf),)
    return tuple(tuple(n.format(layer=layer, expert=rank * experts_per_rank + int(fields["expert"])) for n in rule.hf)
                 for rank in range(ep))


def bind_params(chunks: list[torch.nn.Module], arch: ModelArch) -> list[BoundParam]:
    """Match every parameter of this rank's chunks to its rule; unknown parameters are an error."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    experts_per_rank = arch.moe.num_experts // ep if arch.moe else 0
    bound = []
    for chunk in chunks:
        layer_numbers = {}
        decoder = getattr(chunk, "decoder", None)
        if decoder is not None:
            layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}
        for name, param in chunk.named_parameters():
            if name == "output_layer.weight" and isinstance(chunk.output_layer, ValueHead):
                bound.append(BoundParam(name, param, (VALUE_HEAD_HF_NAME,), "replicated"))
                continue
            for pattern, rule in _COMPILED:
                match = pattern.match(name)
                if match:
                    break
            else:
                raise CheckpointError(f"megatron parameter '{name}' has no HF mapping in PARAM_RULES")
            per_ep_rank = hf_names_of(rule, match, layer_numbers, experts_per_rank, ep)
            if "expert" in match.groupdict():
                bound.append(BoundParam(name, param, per_ep_rank[ep_rank], rule.split, ep_hf_names=per_ep_rank))
                continue
            hf_names = per_ep_rank[0]
            if name == "output_layer.weight" and arch.tie_word_embeddings:
                # The last stage's copy of tied embeddings (PP > 1): loaded from, not exported as, embed_tokens.
                bound.append(BoundParam(name, param, ("model.embed_tokens.weight",), "vocab", export=False))
                continue
            bound.append(BoundParam(name, param, hf_names, rule.split))
    return bound


# ---------------------------------------------------------------- load (HF -> this rank's shards)

def _expected_full_shapes(bp: BoundParam, arch: ModelArch, tp: int) -> list[tuple[int, ...]]:
    local = tuple(bp.param.shape)
    d, hidden = arch.head_dim, arch.hidden_size
    if bp.split == "replicated":
        return [local]
    if bp.split == "column":
        return [(local[0] * tp, *local[1:])]
    if bp.split == "row":
        return [(local[0], local[1] * tp)]
    if bp.split == "vocab":
        return [(arch.vocab_size, hidden)]
    if bp.split == "qkv":
        tail = local[1:]
        return [(arch.num_heads * d, *tail), (arch.num_kv_heads * d, *tail), (arch.num_kv_heads * d, *tail)]
    if bp.split == "gate_up":  # a dense MLP's or an expert's, each half split over TP
        return [(local[0] // 2 * tp, local[1])] * 2
    raise AssertionError(bp.split)


def _read_shard(reader: HFCheckpointReader, bp: BoundParam, arch: ModelArch, tp_rank: int, tp: int) -> torch.Tensor:
    local = bp.param.shape
    if bp.split == "replicated":
        return reader.read(bp.hf_names[0])
    if bp.split == "column":
        n = local[0]
        return reader.read(bp.hf_names[0], rows=slice(tp_rank * n, (tp_rank + 1) * n))
    if bp.split == "row":
        n = local[1]
        return reader.read(bp.hf_names[0], cols=slice(tp_rank * n, (tp_rank + 1) * n))
    if bp.split == "vocab":
        n = local[0]
        start, stop = tp_rank * n, min((tp_rank + 1) * n, arch.vocab_size)
        out = torch.zeros(local, dtype=bp.param.dtype)
        if stop > start:  # rows past the HF vocab are megatron's padding
            out[: stop - start] = reader.read(bp.hf_names[0], rows=slice(start, stop))
        return out
    if bp.split == "qkv":
        groups = arch.num_kv_heads // tp
        q_rows = groups * arch.heads_per_group * arch.head_dim
        kv_rows = groups * arch.head_dim
        q = reader.read(bp.hf_names[0], rows=slice(tp_rank * q_rows, (tp_rank + 1) * q_rows))
        k = reader.read(bp.hf_names[1], rows=slice(tp_rank * kv_rows, (tp_rank + 1) * kv_rows))
        v = reader.read(bp.hf_names[2], rows=slice(tp_rank * kv_rows, (tp_rank + 1) * kv_rows))
        tail = q.shape[1:]
        # Megatron interleaves per query group: [q heads of group g, k of g, v of g] for each g.
        fused = torch.cat(
            [q.reshape(groups, -1, *tail), k.reshape(groups, -1, *tail), v.reshape(groups, -1, *tail)], dim=1
        )
        return fused.reshape(-1, *tail)
    if bp.split == "gate_up":
        n = local[0] // 2
        rows = slice(tp_rank * n, (tp_rank + 1) * n)
        return torch.cat([reader.read(bp.hf_names[0], rows=rows), reader.read(bp.hf_names[1], rows=rows)])
    raise AssertionError(bp.split)


def load_hf_weights(chunks: list[torch.nn.Module], arch: ModelArch, hf_dir: str) -> None:
    """Copy this rank's slices of the HF checkpoint into its megatron shards (no full-model copy)."""
    reader = HFCheckpointReader(hf_dir)
    for bp in bind_params(chunks, arch):
        tp_rank, tp, _ = _tp(bp.expert)
        if bp.hf_names == (VALUE_HEAD_HF_NAME,) and VALUE_HEAD_HF_NAME not in reader.names():
            continue  # a critic initialized from a policy checkpoint keeps its fresh head
        for hf_name, expected in zip(bp.hf_names, _expected_full_shapes(bp, arch, tp)):
            found = reader.shape(hf_name)
            if found != expected:
                raise CheckpointError(
                    f"{hf_dir}: tensor '{hf_name}' has shape {list(found)}, expected {list(expected)} "
                    f"for this config.json"
                )
        shard = _read_shard(reader, bp, arch, tp_rank, tp)
        with torch.no_grad():
            bp.param.copy_(shard.to(bp.param.dtype))


# ---------------------------------------------------------------- export (shards -> full HF tensors)

def _merge_tp(bp: BoundParam, shards: list[torch.Tensor], arch: ModelArch) -> list[torch.Tensor]:
    if bp.split == "replicated":
        return [shards[0]]
    if bp.split in ("column", "vocab"):
        full = torch.cat(shards, dim=0)
        return [full[: arch.vocab_size] if bp.split == "vocab" else full]
    if bp.split == "row":
        return [torch.cat(shards, dim=1)]
    if bp.split == "qkv":
        full = torch.cat(shards, dim=0)
        tail = full.shape[1:]
        d, hpg = arch.head_dim, arch.heads_per_group
        grouped = full.reshape(arch.num_kv_heads, (hpg + 2) * d, *tail)
        q, k, v = grouped.split([hpg * d, d, d], dim=1)
        return [t.reshape(-1, *tail) for t in (q, k, v)]
    if bp.split == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise AssertionError(bp.split)


def _gather_tp(tensor: torch.Tensor, tp: int, group) -> list[torch.Tensor]:
    if tp == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _gather_ep(tensors: list[torch.Tensor], bp: BoundParam) -> list[torch.Tensor]:
    """An expert's full tensors from every rank of the expert-parallel group, in `export_names` order."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    if ep == 1:
        return tensors
    gathered = []
    for tensor in tensors:
        parts = [torch.empty_like(tensor) for _ in range(ep)]
        dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_expert_model_parallel_group())
        gathered.append(parts)
    return [parts[rank] for rank in range(ep) for parts in gathered]


def _stage_manifests(chunks, arch, source) -> tuple[list, dict]:
    """Per pipeline stage: the HF names, full shapes and dtypes it owns (collective over PP)."""
    from megatron.core import parallel_state

    bound = [bp for bp in bind_params(chunks, arch) if bp.export]
    manifest = [(bp.export_names, _full_meta(bp, arch, source)) for bp in bound]
    manifests = [manifest]
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        manifests = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(manifests, manifest, group=parallel_state.get_pipeline_model_parallel_group())
    return manifests, {bp.export_names: bp for bp in bound}


def hf_weight_manifest(chunks: list[torch.nn.Module], arch: ModelArch) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every HF tensor the export will yield, with its full shape and dtype, known on every rank."""
    manifests, _ = _stage_manifests(chunks, arch, lambda p: p.detach())
    return {name: meta for stage in manifests for names, metas in stage for name, meta in zip(names, metas)}


def iter_hf_tensors(
    chunks: list[torch.nn.Module],
    arch: ModelArch,
    source: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.detach(),
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every HF tensor, full size, on every rank, in one order; holds one tensor at a time.

    All ranks must iterate to the end together (each tensor is a TP all-gather on its owning
    stage, then a broadcast over the pipeline group). `source` picks what to export from a
    parameter (its data by default; e.g. its gradient for tests).
    """
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    manifests, local = _stage_manifests(chunks, arch, source)
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else [None]
    for owner, stage_manifest in enumerate(manifests):
        for hf_names, metas in stage_manifest:
            if owner == pp_rank:
                bp = local[hf_names]
                _, tp, tp_group = _tp(bp.expert)
                fulls = _merge_tp(bp, _gather_tp(source(bp.param), tp, tp_group), arch)
                if bp.expert:
                    fulls = _gather_ep(fulls, bp)
            else:
                fulls = [torch.empty(shape, dtype=dt, device=compute_device()) for shape, dt in metas]
            for name, full in zip(hf_names, fulls):
                if pp > 1:
                    dist.broadcast(full, src=pp_ranks[owner], group=pp_group)
                yield name, full if dtype is None else full.to(dtype)


def _full_meta(bp: BoundParam, arch: ModelArch, source) -> list[tuple[tuple[int, ...], torch.dtype]]:
    dt = source(bp.param).dtype
    _, tp, _ = _tp(bp.expert)
    return [(shape, dt) for shape in _expected_full_shapes(bp, arch, tp)] * max(1, len(bp.ep_hf_names))


