"""Megatron distributed checkpoints of a model converted from HF, with what is needed to go back."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from rlfactory_megatron.models.hf_arch import ModelArch, arch_from_hf_config
from rlfactory_megatron.models.hf_checkpoint import copy_non_weight_files

META_FILE = "rlf_model.json"
HF_FILES_DIR = "hf_files"  # config.json, tokenizer files of the source checkpoint


def _sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_mcore_checkpoint(chunks: list[torch.nn.Module], arch: ModelArch, out_dir: str | Path,
                          hf_dir: str | Path | None, padded_vocab_size: int) -> None:
    """Collective: every rank writes its shards; rank 0 writes the metadata."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        write_model_meta(out_dir, arch, hf_dir, padded_vocab_size)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(chunks), str(out_dir))


def write_model_meta(out_dir: str | Path, arch: ModelArch, hf_dir: str | Path | None, padded_vocab_size: int) -> None:
    """What a distributed checkpoint of a model needs to go back to HF (`rlf-convert mcore-to-hf`):
    the HF config, the padded vocabulary, and the source's config and tokenizer files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"hf_config": arch.hf_config, "padded_vocab_size": padded_vocab_size, "format": 1}
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2))
    if hf_dir is not None:
        copy_non_weight_files(hf_dir, out_dir / HF_FILES_DIR)


def read_mcore_meta(ckpt_dir: str | Path) -> tuple[ModelArch, int]:
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file():
        raise ValueError(f"{ckpt_dir}: no {META_FILE}; --mcore-dir must be a folder written by "
                         "`rlf-convert hf-to-mcore`, or a run checkpoint (<output_dir>/checkpoints/step_N)")
    meta = json.loads(path.read_text())
    return arch_from_hf_config(meta["hf_config"], source=str(path)), int(meta["padded_vocab_size"])


def load_mcore_checkpoint(chunks: list[torch.nn.Module], ckpt_dir: str | Path) -> None:
    """Collective: loads (and reshards, if the TP/PP layout differs) into this rank's chunks."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded_state_dict(chunks), str(ckpt_dir))
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{i}"])
