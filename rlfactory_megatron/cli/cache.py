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
    export.add_argument("--text", action="store_true",
                        help="add the decoded prompt, response and turns (the run's tokenizer, see show)")
    export.add_argument("--tokenizer", help="HF folder of the tokenizer (default: the run's model)")
    export.set_defaults(run=_export)
    show = commands.add_parser("show", help="a step's trajectories as readable text: prompt, turns, tool calls, "
                               "reward, advantage (decoded with the run's tokenizer)")
    show.add_argument("directory", type=Path, help="a training run's output folder, or its cache/rollouts")
    show.add_argument("--step", type=int, help="default: the last stored step")
    show.add_argument("--sample", help="one sample id (00003, or 3); default: every sample of the step")
    show.add_argument("--tokenizer", help="HF folder of the tokenizer (default: the run's model)")
    show.add_argument("--full-prompt", action="store_true", help="the whole prompt, not its last 2000 characters")
    show.set_defaults(run=_show)
    merge = commands.add_parser("merge", help="many shards (of one kind) into one file; under mpiexec the ranks "
                                "copy in parallel where h5py is built with MPI (parallel HDF5)")
    merge.add_argument("paths", type=Path, nargs="+", help="cache directories or shard files")
    merge.add_argument("--out", type=Path, required=True)
    merge.set_defaults(run=_merge)
    return parser


def _shard_paths(paths: list[Path]) -> list[Path]:
    """Shard files, cache folders' shards, or a run's output folder's (as `show` takes it)."""
    found = []
    for path in paths:
        if not path.is_dir():
            found.append(path)
            continue
        found += list_shards(path) or [shard for base in (path, path / "cache") for kind in STORE_FOLDERS
                                       for shard in list_shards(base / kind)]
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


def _run_tokenizer(directory: Path, tokenizer: str | None = None):
    """The tokenizer a run trained with: `tokenizer` (a HF folder) if given, else the model of the
    run's config.yaml (found in `directory` or the folders above it, up to the run's own)."""
    from transformers import AutoTokenizer

    if tokenizer is None:
        config = next((folder / "config.yaml" for folder in (directory, *directory.resolve().parents)
                       if (folder / "config.yaml").is_file() and (folder / "metrics.jsonl").exists()), None)
        if config is None:
            raise ValueError(f"{directory}: no training run's config.yaml here or above; pass --tokenizer "
                             "<HF model folder>")
        from omegaconf import OmegaConf

        from rlfactory_megatron.trainer.model_path import resolve_model_path

        tokenizer = str(resolve_model_path(OmegaConf.load(config).model.path))
    return AutoTokenizer.from_pretrained(tokenizer)


# The cache's stores, each a folder of shards (rollout/generator.py lays them out).
STORE_FOLDERS = ("rollouts", "tool_artifacts")


def _rollouts_dir(directory: Path) -> Path:
    """A run's rollout store: `directory` itself, or the cache of the run it is the output of."""
    return directory / "cache" / "rollouts" if (directory / "cache" / "rollouts").is_dir() else directory


def _export(args: argparse.Namespace) -> int:
    text = None
    if args.text:
        from rlfactory_megatron.envs.storage.text import decoded

        tokenizer = _run_tokenizer(args.directory, args.tokenizer)
        text = lambda record: decoded(record, tokenizer)  # noqa: E731
    count = export_step(_rollouts_dir(args.directory), args.step, args.out, args.format, text)
    if count == 0:
        print(f"rlf-cache export: no rollout records for step {args.step} in {args.directory}", file=sys.stderr)
        return 1
    print(f"{count} record(s) of step {args.step} -> {args.out}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from rlfactory_megatron.envs.storage import RolloutStore
    from rlfactory_megatron.envs.storage.text import render

    directory = _rollouts_dir(args.directory)
    tokenizer = _run_tokenizer(args.directory, args.tokenizer)
    with RolloutStore(directory, readonly=True) as store:
        steps = store.steps()
        if not steps:
            raise ValueError(f"{directory}: no rollout records")
        step = steps[-1] if args.step is None else args.step
        if step not in steps:
            raise ValueError(f"no rollout records for step {step} in {directory}; stored steps: "
                             f"{steps[0]}..{steps[-1]}")
        try:
            # a sample id as stored (00003), or its number (3)
            sample = f"{int(args.sample):05d}" if args.sample and args.sample.isdigit() else args.sample
            records = [store.read(step, sample)] if sample else store.read_step(step)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
    for record in sorted(records, key=lambda r: r.sample_id):
        print(render(record, tokenizer, prompt_chars=None if args.full_prompt else 2000) + "\n")
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
