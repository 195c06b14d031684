"""The MPI-sharded HDF5 cache: per-rank shards of rollout records and tool-call artifacts."""
from .artifacts import CachedArtifact, ToolArtifactCache, artifact_key, owner_of
from .rollouts import RolloutRecord, RolloutStore
from .shard import ShardError
from .topology import LauncherMismatchError, Topology, detect_topology, single_process

__all__ = ["CachedArtifact", "LauncherMismatchError", "RolloutRecord", "RolloutStore", "ShardError",
           "ToolArtifactCache", "Topology", "artifact_key", "detect_topology", "owner_of", "single_process"]
