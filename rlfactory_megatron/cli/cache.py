"""`rlf-cache`: inspect, check, export and merge the HDF5 cache (rollout and tool-artifact shards)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlfactory_megatron.envs.storage.export import export_step
from rlfactory_megatron.envs.storage.merge import merge_shards
from rlfactory_megatron.envs.storage.schemas import SCHEMAS
from rlfactory_megatron.envs.storage.shard import ShardError, list_shards, open_reader
from rlfactory_megatron.envs.storage.topology import detect_topology
from rlfactory_megatron.envs.storage.verify import verify_shard


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (ShardError, ValueError, OSError) as exc:
        print(f"rlf-cache {args.command}: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlf-cache", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    stats = commands.add_parser("stats", help="rows, steps and bytes of every shard in a cache directory")
    stats.add_argument("directory", type=Path)
    stats.set_defaults(run=_stats)
    verify = commands.add_parser("verify", help="check every shard; exit status 1 on any problem")
    verify.add_argument("paths", type=Path, nargs="+", help="cache directories or shard files")
    verify.set_defaults(run=_verify)
    export = commands.add_parser("export", help="one step's rollout records to JSONL or parquet")
    export.add_argument("directory", type=Path)
    export.add_argument("--step", type=int, required=True)
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--format", choices=("jsonl", "parquet"), help="default: from the --out suffix")
    export.set_defaults(run=_export)
    merge = commands.add_parser("merge", help="many shards (of one kind) into one file; under mpiexec the ranks "
                                "copy in parallel where h5py is built with MPI (parallel HDF5)")
    merge.add_argument("paths", type=Path, nargs="+", help="cache directories or shard files")
    merge.add_argument("--out", type=Path, required=True)
    merge.set_defaults(run=_merge)
    return parser


def _shard_paths(paths: list[Path]) -> list[Path]:
    found = [shard for path in paths for shard in (list_shards(path) if path.is_dir() else [path])]
    if not found:
        raise ShardError(f"no shard files (shard-*-of-*.h5) in {', '.join(map(str, paths))}")
    return found


def _stats(args: argparse.Namespace) -> int:
    total = 0
    for path in _shard_paths([args.directory]):
        shard = open_reader(path, SCHEMAS)
        try:
            rows = {table.name: shard.rows(table.name) for table in shard.schema.tables}
            detail = ""
            if shard.schema.kind == "rollouts":
                steps = set(shard.read("rollouts", "step", 0, rows["rollouts"]).tolist())
                detail = f", steps {min(steps)}..{max(steps)} ({len(steps)})" if steps else ""
            elif shard.schema.kind == "artifacts":
                detail = f", live {rows['artifacts'] - rows['evictions']}"
        finally:
            shard.close()
        size = path.stat().st_size
        total += size
        counts = ", ".join(f"{name} {count}" for name, count in rows.items())
        print(f"{path.name}: {shard.schema.kind}, {counts}{detail}, {size / 1e6:.1f} MB")
    print(f"total {total / 1e6:.1f} MB")
    return 0


def _verify(args: argparse.Namespace) -> int:
    paths = _shard_paths(args.paths)
    problems = [problem for path in paths for problem in verify_shard(path)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(paths)} shard(s) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


def _export(args: argparse.Namespace) -> int:
    count = export_step(args.directory, args.step, args.out, args.format)
    if count == 0:
        print(f"rlf-cache export: no rollout records for step {args.step} in {args.directory}", file=sys.stderr)
        return 1
    print(f"{count} record(s) of step {args.step} -> {args.out}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    # Under mpiexec/srun the ranks merge together (in parallel where h5py is built with MPI).
    topology = detect_topology()
    comm = None
    if topology.backend == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    written = merge_shards(_shard_paths(args.paths), args.out, comm)
    if topology.rank == 0:
        print(f"merged -> {args.out}: " + ", ".join(f"{table} {rows} rows" for table, rows in written.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
