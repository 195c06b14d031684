"""Hugging Face safetensors folders: lazy sliced reads (single file or index-sharded) and streamed writes."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has a wrong shape, or cannot be read."""


class HFCheckpointReader:
    """Reads whole tensors or row/column slices of them without loading the rest of the file."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.root = Path(hf_dir)
        index = self.root / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.root / fname for name, fname in weight_map.items()}
        elif (self.root / _SINGLE).is_file():
            with safe_open(self.root / _SINGLE, framework="pt") as f:
                self._file_of = {name: self.root / _SINGLE for name in f.keys()}
        else:
            raise CheckpointError(f"{self.root}: no {_SINGLE} or {_INDEX}; expected a HF safetensors folder")
        self._handles: dict[Path, object] = {}

    def names(self) -> list[str]:
        return list(self._file_of)

    def _slice(self, name: str):
        if name not in self._file_of:
            raise CheckpointError(f"{self.root}: tensor '{name}' is missing from the checkpoint")
        path = self._file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """The tensor, or rows[/cols] of it; only the requested bytes are read."""
        view = self._slice(name)
        if rows is None and cols is None:
            return view[:]
        if cols is None:
            return view[rows]
        return view[rows if rows is not None else slice(None), cols]


def copy_non_weight_files(src: str | Path, dst: str | Path) -> None:
    """config.json, tokenizer and generation files travel with the weights."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)


def _as_umask_allows(path: Path) -> None:
    """safetensors writes its file 0600; an exported model is read by others (a serving job, a
    colleague) as any file the user writes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_safetensors_shards(
    tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, max_shard_bytes: int = 2 * 1024**3
) -> list[str]:
    """Write (name, tensor) pairs as HF shards (+ index when more than one), holding one shard in memory."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    written: list[tuple[str, list[str]]] = []
    shard_bytes = 0
    total_bytes = 0

    def flush() -> None:
        nonlocal shard_bytes
        if shards[-1]:
            tmp_name = f"shard-{len(written):05d}.tmp"
            save_file(shards[-1], str(out_dir / tmp_name), metadata={"format": "pt"})
            _as_umask_allows(out_dir / tmp_name)
            written.append((tmp_name, list(shards[-1])))
        shards[-1] = {}
        shard_bytes = 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            flush()
        shards[-1][name] = tensor.detach().cpu().contiguous()
        shard_bytes += size
        total_bytes += size
    flush()
    if len(written) == 1:
        (out_dir / written[0][0]).rename(out_dir / _SINGLE)
        return [_SINGLE]
    weight_map = {}
    final_names = []
    for i, (tmp_name, names) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        (out_dir / tmp_name).rename(out_dir / final)
        final_names.append(final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / _INDEX).write_text(json.dumps(index, indent=2))
    return final_names


def write_hf_folder(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, files_dir: str | Path | None,
                    hf_config: dict, writer: bool = True) -> None:
    """A HF model folder from a collective export's (name, full tensor) pairs: safetensors shards
    (one shard in memory at a time), then the config, tokenizer and chat template files of
    `files_dir` (config.json from `hf_config` alone without them). Every rank of the export
    iterates `tensors` to its end; only the `writer` writes."""
    if not writer:
        for _ in tensors:
            pass
        return
    out_dir = Path(out_dir)
    write_safetensors_shards(tensors, out_dir)
    if files_dir is not None and Path(files_dir).is_dir():
        copy_non_weight_files(files_dir, out_dir)
    else:
        (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))


def iter_safetensors(hf_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    reader = HFCheckpointReader(hf_dir)
    for name in reader.names():
        yield name, reader.read(name)
