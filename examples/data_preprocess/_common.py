"""What the preprocessing scripts share: reading a dataset's splits, writing our parquet layout."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

SPLITS = ("train", "test")


def preprocess(argv: list[str] | None, description: str, dataset: str, default_source: str, config: str | None,
               to_row: Callable[[dict, str, int], dict]) -> int:
    """A preprocessing script's command: `--source` (hub name or local folder) into `--out`'s
    train.parquet and test.parquet, one `to_row` per example. A folder that already holds both is
    kept (`--force` writes them again): the examples call this before every run."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=default_source, help="hub name or local folder (default: %(default)s)")
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--force", action="store_true", help="write the splits even if the folder holds them")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    if not args.force and all((out / f"{split}.parquet").is_file() for split in SPLITS):
        print(f"{dataset}: {out} already holds {' and '.join(SPLITS)}: kept (--force writes them again)")
        return 0
    for split, examples in load_splits(args.source, name=config, splits=SPLITS).items():
        path = write_split([to_row(e, split, i) for i, e in enumerate(examples)], out, split)
        print(f"{dataset}: {len(examples)} {split} rows -> {path}")
    return 0


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
