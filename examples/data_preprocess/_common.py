"""What the preprocessing scripts share: reading a dataset's splits, writing our parquet layout."""
from __future__ import annotations

import os
from pathlib import Path


def load_splits(source: str, name: str | None, splits: tuple[str, ...]) -> dict[str, list[dict]]:
    """Each split's rows as dicts, from a hub dataset name or a local folder of its files
    (`datasets` reads parquet/jsonl/csv folders and names the splits after the files)."""
    import datasets

    local = Path(source).expanduser()
    if local.exists():
        # A local copy of a hub repo keeps each config in a folder of its own (gsm8k: main/, socratic/)
        folder = local / name if name and (local / name).is_dir() else local
        loaded = datasets.load_dataset(str(folder))
    else:
        loaded = datasets.load_dataset(source, name) if name else datasets.load_dataset(source)
    missing = [s for s in splits if s not in loaded]
    if missing:
        raise SystemExit(f"{source}: no {', '.join(missing)} split (it has {', '.join(loaded)})")
    return {split: [dict(row) for row in loaded[split]] for split in splits}


def write_split(rows: list[dict], out: Path, split: str) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = out.expanduser()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{split}.parquet"
    # Whole or absent: the nodes of a multi-node example may each preprocess into one shared folder.
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    pq.write_table(pa.Table.from_pylist(rows), partial)
    partial.replace(path)
    return path
