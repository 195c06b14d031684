"""Export one step's rollout records to JSONL or parquet, for inspection and replay outside the trainer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from .rollouts import RolloutRecord, RolloutStore


def export_step(directory: Path, step: int, out: Path, fmt: str | None = None,
                text: Callable[[RolloutRecord], dict[str, Any]] | None = None) -> int:
    """Write every rank's records of `step` to `out` (format from `fmt` or the suffix); returns the
    count. `text(record)`: extra columns per record (the decoded text, see text.decoded)."""
    fmt = fmt or ("parquet" if Path(out).suffix == ".parquet" else "jsonl")
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"export format {fmt!r}: choose jsonl or parquet")
    with RolloutStore(directory, readonly=True) as store:
        rows = [{**record.to_json(), **(text(record) if text else {})} for record in store.read_step(step)]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Free-form JSON fields go in as JSON text: parquet needs one schema for every row.
        for row in rows:
            row["tool_traces"], row["metadata"] = json.dumps(row["tool_traces"]), json.dumps(row["metadata"])
            if "turns_text" in row:
                row["turns_text"] = json.dumps(row["turns_text"], ensure_ascii=False)
        pq.write_table(pa.Table.from_pylist(rows), out)
    else:
        with open(out, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    return len(rows)
