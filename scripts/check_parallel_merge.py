"""Check `rlf-cache merge`'s parallel-HDF5 path where h5py is built with MPI (PyPI's h5py is not, so the test
suite covers the serial path and the MPI plumbing only):

    mpiexec -n 3 python scripts/check_parallel_merge.py /scratch/merge-check

Rank 0 writes five rollout shards and five artifact shards (with evictions), merges each kind in one process,
then all ranks merge them again together through MPI-IO; every dataset of the two results must be equal.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from rlfactory_megatron.envs.storage import RolloutRecord, RolloutStore, ToolArtifactCache, Topology
from rlfactory_megatron.envs.storage.merge import merge_shards
from rlfactory_megatron.envs.storage.shard import list_shards

SOURCES = 5


def main(root: Path) -> int:
    comm = MPI.COMM_WORLD
    if not h5py.get_config().mpi:
        print("h5py is built without MPI: nothing parallel to check", file=sys.stderr)
        return 2
    if comm.rank == 0:
        _write_sources(root)
        for kind in ("rollouts", "artifacts"):
            merge_shards(list_shards(root / kind), root / f"one-process-{kind}.h5")
    comm.Barrier()
    for kind in ("rollouts", "artifacts"):
        written = merge_shards(list_shards(root / kind), root / f"parallel-{kind}.h5", comm)
        if comm.rank == 0:
            compared = _compare(root / f"one-process-{kind}.h5", root / f"parallel-{kind}.h5")
            print(f"{kind}: merged by {comm.size} ranks through MPI-IO {written}, "
                  f"{compared} datasets equal to the one-process merge", flush=True)
    return 0


def _record(step: int, rank: int, i: int) -> RolloutRecord:
    rng = np.random.default_rng([step, rank, i])
    n = int(rng.integers(0, 900))
    return RolloutRecord(step, f"r{rank}-{i}", rng.integers(0, 1000, int(rng.integers(1, 300))),
                         rng.integers(0, 1000, n), rng.integers(0, 2, n), rng.random(n), rng.random(n),
                         float(rng.random()), [{"i": i}], {"rank": rank})


def _write_sources(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for rank in range(SOURCES):
        topology = Topology(rank, SOURCES, "single", lambda obj: [obj])
        with RolloutStore(root / "rollouts", topology) as store:
            for step in range(3):
                store.write([_record(step, rank, i) for i in range(50 + 13 * rank)])
        with ToolArtifactCache(root / "artifacts", topology, max_bytes=60_000) as cache:
            for i in range(40):
                cache.put("t", {"rank": rank, "i": i}, f"{rank}-{i}|".encode() * 300)
            cache.sync()  # over the cap: evicts, so the merge must skip rows


def _compare(one: Path, two: Path) -> int:
    with h5py.File(one, "r") as a, h5py.File(two, "r") as b:
        names: list[str] = []
        a.visit(names.append)
        datasets = [name for name in names if isinstance(a[name], h5py.Dataset)]
        for name in datasets:
            if not np.array_equal(a[name][()], b[name][()]):
                raise SystemExit(f"{two}: /{name} differs from the one-process merge")
    return len(datasets)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
