"""The rollout side of a step, on every inference group: one engine per `rollout.tp` training
ranks (colocated), a step's prompts split across them, the agent loop with tools on each engine's
process, each process scoring and storing its own rows. Trajectories stay where they were made:
every rank learns only each row's size and counts (`RowSummary`), and each row's tokens go
point to point from the process that made it to the ranks of the one DP rank that trains it
(`RolloutPlane.place`). Rows are numbered in the order one engine would have produced them;
seeds come from (run seed, step, row), so a run's samples do not depend on how many engines
generate them.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlfactory_megatron.actor.batch import RolloutBatch, dp_row_owners
from rlfactory_megatron.trainer.data import PromptRecord, fit_prompt
from rlfactory_megatron.trainer.tasks import run_tool_specs

# What an engine's sleep gives up, as vLLM tags it, in the order a weight update wakes it.
ENGINE_MEMORY = ("weights", "kv_cache")


@dataclass(frozen=True)
class EngineLayout:
    """Which training ranks own an engine: the first of each group of `rollout_tp` ranks."""

    world: int
    rollout_tp: int
    rank: int

    @property
    def num_engines(self) -> int:
        return self.world // self.rollout_tp

    @property
    def engine_index(self) -> int | None:
        """This rank's engine, or None when another rank of its group owns it."""
        return self.rank // self.rollout_tp if self.rank % self.rollout_tp == 0 else None

    @property
    def owners(self) -> list[int]:
        return [engine * self.rollout_tp for engine in range(self.num_engines)]

    def share(self, count: int, engine: int) -> range:
        """The contiguous part of `count` prompts that `engine` generates."""
        n = self.num_engines
        return range(engine * count // n, (engine + 1) * count // n)


@dataclass
class RowSummary:
    """What every rank knows of one trajectory: where it was made, its size, what it did."""

    row: int
    producer: int  # the generating process that made it and holds it (EngineLayout.engine_index)
    prompt_tokens: int
    response_tokens: int
    turns: int
    tool_calls: int
    tool_errors: dict[str, int] = field(default_factory=dict)  # failed calls by error_kind; parse errors as "malformed_call"
    versions: dict[int, int] = field(default_factory=dict)  # weight version -> generated tokens it produced

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass
class RowData:
    """One trajectory's tokens, as the ranks that train on it need them."""

    row: int
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    log_probs: np.ndarray  # the engine's, of the generated tokens (0 on observation tokens)
    versions: np.ndarray  # the weight version that generated each response token (-1 on observation tokens)


# Tool failures counted per kind in the metrics (tools/errors/<kind>); others count as "other".
TOOL_ERROR_KINDS = ("malformed_call", "unknown_tool", "invalid_arguments", "exception", "timeout", "actor_died")


def _tool_errors(traj) -> dict[str, int]:
    counts: dict[str, int] = {}
    for turn in traj.turns:
        if turn.parse_errors:
            counts["malformed_call"] = counts.get("malformed_call", 0) + len(turn.parse_errors)
        for call in turn.tool_calls:
            if call.is_error:
                kind = call.metadata.get("error_kind")
                kind = kind if kind in TOOL_ERROR_KINDS else "other"
                counts[kind] = counts.get(kind, 0) + 1
    return counts


@dataclass
class Rollouts:
    """One rollout phase: every row's summary (on every rank), the trajectories this process made."""

    summaries: list[RowSummary]
    records: list[PromptRecord]  # one per row (a prompt repeated n times)
    group_size: int
    engine_stats: list[dict[str, float]]  # one per engine
    local: dict[int, tuple[Any, str]] = field(default_factory=dict)  # row -> (Trajectory, response text)
    versions: dict[int, list[int]] = field(default_factory=dict)  # row made here -> weight version per generated token
    reward_future: Any = None  # this process's rows being scored
    reward: Any = None  # RewardResult of all rows, once gathered
    extra_stats: dict[str, float] = field(default_factory=dict)  # e.g. dynamic sampling's refill counts

    def row_data(self, row: int) -> RowData:
        traj, _ = self.local[row]
        mask = np.asarray(traj.loss_mask, dtype=np.int8)
        versions = np.full(len(mask), -1, dtype=np.int32)
        versions[mask > 0] = self.versions.get(row, [])
        return RowData(row, np.asarray(traj.prompt_ids, dtype=np.int64), np.asarray(traj.response_ids, dtype=np.int64),
                       mask, np.asarray(traj.logprobs, dtype=np.float32), versions)

    def stored_record(self, row: int, step: int, advantages: np.ndarray):
        """A row this process made, as the rollout store keeps it (its reward gathered)."""
        from rlfactory_megatron.envs.storage import RolloutRecord

        traj, _ = self.local[row]
        record = self.records[row]
        calls = [{"turn": t, "name": c.name, "arguments": c.arguments, "observation": c.observation,
                  "is_error": c.is_error, "latency_s": c.latency_s}
                 for t, turn in enumerate(traj.turns) for c in turn.tool_calls]
        return RolloutRecord(
            step, f"{row:05d}", np.asarray(traj.prompt_ids), np.asarray(traj.response_ids), np.asarray(traj.loss_mask),
            np.asarray(traj.logprobs), advantages, float(self.reward.scores[row]), calls,
            {"data_source": record.data_source, "ground_truth": str(record.ground_truth),
             "group": row // self.group_size, "stop_reason": traj.stop_reason, "turns": len(traj.turns),
             "reward_error": self.reward.errors[row], "weight_versions": _runs(self.versions.get(row, []))})

    def staleness(self, version: int) -> dict[str, float]:
        """How many updates behind `version` (the weights being trained) the generated tokens'
        weights are: mean, max, and the share of tokens at each staleness (a histogram)."""
        counts: dict[int, int] = {}
        for summary in self.summaries:
            for made_by, tokens in summary.versions.items():
                counts[version - made_by] = counts.get(version - made_by, 0) + tokens
        total = max(sum(counts.values()), 1)
        metrics = {"rollout/staleness_mean": sum(k * n for k, n in counts.items()) / total,
                   "rollout/staleness_max": float(max(counts, default=0))}
        metrics.update({f"rollout/staleness_{k}_frac": n / total for k, n in sorted(counts.items())})
        return metrics

    def stats(self) -> dict[str, float]:
        rows = self.summaries
        calls = sum(r.tool_calls for r in rows)
        metrics = {"rollout/response_tokens_mean": float(np.mean([r.response_tokens for r in rows])),
                   "rollout/response_tokens_max": float(max(r.response_tokens for r in rows)),
                   "rollout/turns_mean": float(np.mean([r.turns for r in rows])),
                   "rollout/tool_calls_per_sample": calls / len(rows),
                   "rollout/num_engines": float(len(self.engine_stats))}
        for kind in (*TOOL_ERROR_KINDS, "other"):
            metrics[f"tools/errors/{kind}"] = float(sum(r.tool_errors.get(kind, 0) for r in rows))
        metrics["tools/errors"] = sum(metrics[f"tools/errors/{kind}"] for kind in (*TOOL_ERROR_KINDS, "other"))
        for index, engine in enumerate(self.engine_stats):
            metrics.update({f"rollout/engine_{index}_{k}": v for k, v in engine.items()})
        busy = [e["busy_s"] for e in self.engine_stats]
        metrics["rollout/engine_imbalance"] = max(busy) / max(float(np.mean(busy)), 1e-9) if max(busy) > 0 else 1.0
        metrics.update(self.extra_stats)
        return metrics

    @staticmethod
    def of_rows(parts: list[tuple["Rollouts", list[int]]]) -> "Rollouts":
        """The given rows of one or more rollouts, in order, as one (rows renumbered from 0)."""
        from rlfactory_megatron.rewards.records import RewardResult

        summaries, records, local, versions, rewards = [], [], {}, {}, []
        for part, picked in parts:
            for index in picked:
                position = len(summaries)
                summaries.append(dataclasses.replace(part.summaries[index], row=position))
                records.append(part.records[index])
                if index in part.local:
                    local[position] = part.local[index]
                if index in part.versions:
                    versions[position] = part.versions[index]
                rewards.append((part.reward, index))
        # Work adds up over the parts; the weight version is the one they all generated with.
        engines = [{k: (max if k in ("weight_version", "failed") else sum)(p.engine_stats[e][k] for p, _ in parts)
                    for k in parts[0][0].engine_stats[e]}
                   for e in range(len(parts[0][0].engine_stats))]
        reward = RewardResult([r.scores[i] for r, i in rewards], [r.response_lengths[i] for r, i in rewards],
                              [r.extras[i] for r, i in rewards], [r.errors[i] for r, i in rewards],
                              [r.error_kinds[i] for r, i in rewards])
        return Rollouts(summaries, records, parts[0][0].group_size, engines, local, versions, reward=reward)


def _runs(values: list[int]) -> list[list[int]]:
    """[3, 3, 4] -> [[3, 2], [4, 1]]: (value, count) runs, how the store keeps per-token versions."""
    runs: list[list[int]] = []
    for value in values:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return runs


@dataclass
class PendingRollout:
    """A rollout phase started with `RolloutPlane.start` and not yet finished: its prompts (on
    every rank) and, in the generating process, the generation under way."""

    records: list[PromptRecord]
    step: int
    greedy: bool
    first_row: int
    generation: concurrent.futures.Future | None = None  # -> (local, summaries, engine stats, versions)


@dataclass
class TrainRows:
    """The rows one DP rank trains on (a DP-local batch) and the engines' log-probs of them."""

    batch: RolloutBatch
    engine_log_probs: torch.Tensor  # [B, T], aligned to the batch's tokens
    engine_versions: torch.Tensor  # [B, T]: the weight version that generated each token (-1: not generated)


def pad_rows(ids_list: list[list[int]], masks: list[list[int]], group_size: int = 1,
             step_rows: list[int] | None = None, step_size: int = 0) -> RolloutBatch:
    """Rows as one right-padded batch; with `step_rows`, a DP-local batch of those rows of the
    step's `step_size` (group ids from the step's numbering)."""
    width = max((len(ids) for ids in ids_list), default=1)
    ids = torch.zeros(len(ids_list), width, dtype=torch.long)
    mask = torch.zeros(len(ids_list), width)
    for row, (seq, m) in enumerate(zip(ids_list, masks)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(m)] = torch.tensor(m, dtype=torch.float32)
    lengths = torch.tensor([len(seq) for seq in ids_list], dtype=torch.long)
    if step_rows is None:
        return RolloutBatch(ids, lengths, mask, group_ids=torch.arange(len(ids_list)) // group_size)
    rows = torch.tensor(step_rows, dtype=torch.long)
    return RolloutBatch(ids, lengths, mask, group_ids=rows // group_size, step_rows=rows, step_size=step_size)


class RolloutPlane:
    """Engines, tools, rewards and the rollout store of this process (when it owns an engine), and
    the collectives that make one step's rollouts out of every engine's. Every method is called
    on every training rank."""

    def __init__(self, cfg, hf_dir: str, tokenizer, output: Path) -> None:
        from rlfactory_megatron.envs.tool_manager import get_tool_manager

        self.cfg, self.hf_dir, self.tokenizer, self.output = cfg, hf_dir, tokenizer, output
        self.disaggregated = cfg.rollout.mode == "disaggregated"
        # Disaggregated: rank 0 drives every engine (through the router), so it is the one
        # generating process; colocated: the first rank of each rollout.tp group.
        self.layout = EngineLayout(dist.get_world_size(), dist.get_world_size() if self.disaggregated else cfg.rollout.tp,
                                   dist.get_rank())
        # Python objects travel over gloo whatever the training backend (NCCL moves only device tensors).
        self.cpu_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        # Every rank creates the owners' group (torch requires it), only owners use it.
        self.owner_group = (dist.new_group(ranks=self.layout.owners, backend="gloo")
                            if self.layout.num_engines < self.layout.world else self.cpu_group)
        self.engine = self.router = self.transport = self.tool_pool = self.reward_pool = None
        self.pool: list = []  # disaggregated: the engines (Ray actors)
        self._deaths_in_a_row: dict[int, int] = {}
        self._replaced = 0
        self.rollout_store = self.artifacts = None
        self.tool_schemas: list[dict] | None = None
        self._asleep: set[str] = set()  # the engine memory (ENGINE_MEMORY tags) its sleep gave up
        self._last_sync = None  # SyncStats of the last weight sync this rank sent
        # The ranks of each DP rank (all of its TP and PP ranks train on the same rows).
        from megatron.core import parallel_state

        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        dp_of_rank = self._gather(self.dp_rank)
        self.ranks_of_dp = [[r for r, d in enumerate(dp_of_rank) if d == dp] for dp in range(self.dp_size)]
        self.manager = get_tool_manager(cfg.tools.format, tokenizer)
        self._loop = asyncio.new_event_loop()
        # Asynchronous RL: the loop (agent loops, tools, engine calls) runs on a thread of its own,
        # so that generation goes on while this thread trains; work is handed to it by `_run`.
        self._loop_thread = None
        if cfg.trainer.max_staleness > 0:
            self._loop_thread = threading.Thread(target=self._loop.run_forever, name="rlf-rollout-loop", daemon=True)
            self._loop_thread.start()
        ray_join = self.broadcast(self._start_ray() if self.layout.rank == 0 else None)
        if self.layout.engine_index is not None:
            self._start_services(*ray_join)

    # ------------------------------------------------------------------ set-up
    def _run(self, coroutine):
        """Run `coroutine` on this process's event loop and return its result."""
        if self._loop_thread is None:
            return self._loop.run_until_complete(coroutine)
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        if self.layout.world > 1:
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def _gather(self, obj: Any, group=None, size: int | None = None) -> list[Any]:
        """`obj` from every rank of `group` (default: the whole job, over gloo)."""
        size = self.layout.world if size is None else size
        if size == 1:
            return [obj]
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=self.cpu_group if group is None else group)
        return out

    def _exchange(self, outgoing: dict[int, Any]) -> dict[int, Any]:
        """Point to point over gloo: `outgoing[rank]` goes to that rank alone; returns {sender:
        object} of what was sent here. One all-gather of the byte counts, then a send per pair."""
        me, world = self.layout.rank, self.layout.world
        received = {me: outgoing[me]} if me in outgoing else {}
        if world == 1:
            return received
        payloads = {dst: torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                          dtype=torch.uint8)
                    for dst, obj in outgoing.items() if dst != me}
        sizes = torch.zeros(world, dtype=torch.int64)
        for dst, payload in payloads.items():
            sizes[dst] = payload.numel()
        table = [torch.zeros(world, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(table, sizes, group=self.cpu_group)
        inbox = {src: torch.empty(int(table[src][me]), dtype=torch.uint8)
                 for src in range(world) if src != me and int(table[src][me]) > 0}
        requests = [dist.isend(payload, dst, group=self.cpu_group) for dst, payload in payloads.items()]
        requests += [dist.irecv(buffer, src, group=self.cpu_group) for src, buffer in inbox.items()]
        for request in requests:
            request.wait()
        received.update({src: pickle.loads(buffer.numpy().tobytes()) for src, buffer in inbox.items()})
        return received

    def _start_ray(self) -> tuple[str, dict[str, str]]:
        """Rank 0: one Ray per job, the sbatch script's (RAY_ADDRESS) or a local one started here
        with enough logical CPUs for every engine process's tool and reward actors at once.
        Returns what the other engine processes need to join it: its address and the variables
        of its token authentication (on by default for a local cluster since Ray 2.59)."""
        import ray

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            per_engine = self.cfg.tools.num_workers + self.cfg.reward.num_workers
            needed = per_engine * self.layout.num_engines + 1
            if self.disaggregated:
                needed += self.cfg.rollout.num_engines * self.cfg.rollout.tp
            with _engine_gpus_only(self.disaggregated and not address) as gpus:
                # "local": without RAY_ADDRESS a fresh cluster, never one a `ray start` on this host
                # left running (or a stale record of one in /tmp/ray) that Ray would otherwise join.
                ray.init(address=address or "local", num_cpus=None if address else max(needed, os.cpu_count() or 2),
                         num_gpus=gpus, include_dashboard=False, log_to_driver=False)
        if self.disaggregated and torch.cuda.is_available():
            wanted, have = self.cfg.rollout.num_engines * self.cfg.rollout.tp, ray.cluster_resources().get("GPU", 0)
            if have < wanted:  # the actors would wait for devices that never come
                raise ValueError(f"rollout.num_engines={self.cfg.rollout.num_engines} x rollout.tp={self.cfg.rollout.tp} "
                                 f"engine GPUs, but the Ray cluster has {have:g} besides the training ranks'; lower "
                                 "rollout.num_engines or give the job more GPUs (slurm/train.sbatch gives Ray the "
                                 "GPUs of each node that its RLF_GPUS_PER_NODE ranks leave)")
        auth = {}
        if os.environ.get("RAY_AUTH_MODE") == "token":
            token = os.environ.get("RAY_AUTH_TOKEN")
            if not token:
                path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
                token = path.read_text().strip() if path.is_file() else None
            auth = {"RAY_AUTH_MODE": "token", **({"RAY_AUTH_TOKEN": token} if token else {})}
        return ray.get_runtime_context().gcs_address, auth

    def _start_services(self, ray_address: str, ray_auth: dict[str, str]) -> None:
        # Before anything imports Ray (vLLM does): Ray reads its authentication mode once.
        for key, value in ray_auth.items():
            os.environ.setdefault(key, value)
        import ray

        from rlfactory_megatron.config import weight_sync_transport
        from rlfactory_megatron.rewards import RewardFnSpec
        from rlfactory_megatron.rewards.pool import RewardPool
        from rlfactory_megatron.rollout.async_engine import serving
        from rlfactory_megatron.rollout.engines import build_engine
        from rlfactory_megatron.rollout.router import EngineRouter
        from rlfactory_megatron.rollout.weight_sync import TRANSPORTS

        cfg = self.cfg
        engine_args = dict(dtype=cfg.model.params_dtype, tensor_parallel_size=cfg.rollout.tp,
                           max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens,
                           max_num_seqs=cfg.rollout.max_num_seqs, memory_utilization=cfg.rollout.gpu_memory_utilization,
                           seed=cfg.trainer.seed, batch_invariant=cfg.rollout.batch_invariant)
        if self.disaggregated:
            if not ray.is_initialized():
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
            self._engine_args = engine_args
            self.pool = [self._new_pool_engine(index) for index in range(cfg.rollout.num_engines)]
            self.transport = self._pool_transport()
            engines = self.pool
        else:
            with _engine_devices(self.layout):
                self.engine = build_engine(cfg.rollout.engine, self.hf_dir, enable_sleep_mode=torch.cuda.is_available(),
                                           **engine_args)
            self.transport = TRANSPORTS.get(weight_sync_transport(cfg))(self.engine)
            engines = [self.engine]
            if not ray.is_initialized():  # after vLLM: with Ray up, its TP>1 engine would pick Ray's executor
                ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        self.router = EngineRouter([serving(engine) for engine in engines], is_failure=_engine_died)
        if cfg.cache.enable:
            self._open_cache()
        if cfg.tools.enable:
            self._start_tool_pool()
        self.reward_pool = RewardPool(cfg.reward.manager, RewardFnSpec.from_config(cfg.reward),
                                      manager_options=dict(cfg.reward.manager_options),
                                      num_workers=cfg.reward.num_workers, sample_timeout_s=cfg.reward.timeout_s)

    def _cache_topology(self):
        """One shard per engine process: the training topology when every rank owns an engine,
        else the owners' group alone."""
        from rlfactory_megatron.envs.storage.topology import Topology, detect_topology

        if self.layout.num_engines == self.layout.world:
            return detect_topology()

        return Topology(rank=self.layout.engine_index, world=self.layout.num_engines, backend="torch",
                        allgather=lambda obj: self._gather(obj, self.owner_group, self.layout.num_engines))

    def _open_cache(self) -> None:
        """The run's HDF5 cache (cache.dir, default <output_dir>/cache): every step's trajectories
        as trained on, and the tool artifacts the tool pool answers repeated calls from; one shard
        per engine process."""
        from rlfactory_megatron.envs.storage import RolloutStore, ToolArtifactCache

        root = Path(self.cfg.cache.dir or self.output / "cache")
        topology = self._cache_topology()
        self.rollout_store = RolloutStore(root / "rollouts", topology=topology)
        self.artifacts = ToolArtifactCache(root / "tool_artifacts", topology=topology,
                                           max_bytes=self.cfg.cache.tool_cache_max_mb << 20,
                                           ttl_s=self.cfg.cache.tool_cache_ttl_s)

    def _start_tool_pool(self) -> None:
        from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig

        cfg = self.cfg.tools
        pool_cfg = ToolPoolConfig(run_tool_specs(self.cfg), num_actors=cfg.num_workers,
                                  max_concurrency=cfg.max_concurrency, call_timeout_s=cfg.call_timeout_s,
                                  channel=cfg.channel)
        self.tool_pool = ToolPool(pool_cfg, self.artifacts)
        self.tool_schemas = self._run(self.tool_pool.start())
        if self.layout.rank == 0:
            _report_sandboxes(pool_cfg.tools)

    # ------------------------------------------------------------------ a rollout phase
    def rollout(self, records: list[PromptRecord], step: int, greedy: bool = False, first_row: int = 0) -> Rollouts:
        """n trajectories per prompt (1 when greedy), each engine generating its share of the
        prompts; the rows of this process are submitted for scoring at once. `first_row` numbers
        the rows for their sampling seeds (refills must not repeat a step's earlier samples)."""
        return self.finish(self.start(records, step, greedy, first_row))

    def start(self, records: list[PromptRecord], step: int, greedy: bool = False, first_row: int = 0) -> PendingRollout:
        """Start a rollout phase (`rollout`'s first half): the generating process's share begins on
        its event loop; `finish` waits for it. No collective: ranks may start phases at any time,
        and must finish them in the same order."""
        pending = PendingRollout(records, step, greedy, first_row)
        if self.layout.engine_index is not None:
            pending.generation = asyncio.run_coroutine_threadsafe(self._generate(pending), self._loop) \
                if self._loop_thread is not None else _done(self._loop.run_until_complete(self._generate(pending)))
        return pending

    def finish(self, pending: PendingRollout) -> Rollouts:
        """Collective: the phase's rows from every generating process, this process's submitted for scoring."""
        n = 1 if pending.greedy else self.cfg.rollout.n
        local, summaries, engines, versions = (pending.generation.result() if pending.generation is not None
                                               else ({}, [], [], {}))
        gathered = self._gather((summaries, engines))
        every_row = sorted((row for part, _ in gathered for row in part), key=lambda r: r.row)
        records = pending.records
        rollouts = Rollouts(every_row, [records[i // n] for i in range(len(records) * n)], n,
                            [stats for _, part in gathered for stats in part], local, versions)
        if local:
            rollouts.reward_future = self.reward_pool.submit(self._reward_samples(rollouts, sorted(local)))
        return rollouts

    async def _generate(self, pending: PendingRollout):
        """This process's rows of a phase: (trajectories + text, summaries, engine stats, token versions)."""
        from rlfactory_megatron.envs.agent_loop import AgentLoopConfig, TurnBarrier, run_agent_loop

        records, step, greedy, first_row = pending.records, pending.step, pending.greedy, pending.first_row
        n = 1 if greedy else self.cfg.rollout.n
        share = self.layout.share(len(records), self.layout.engine_index)
        mine = [i * n + k for i in share for k in range(n)]

        cfg = self.cfg
        loop_cfg = AgentLoopConfig(max_turns=cfg.tools.max_turns if cfg.tools.enable else 1,
                                   max_response_tokens=cfg.rollout.max_response_tokens,
                                   tool_response_max_tokens=cfg.tools.tool_response_max_tokens)
        sampling = {"temperature": 0.0 if greedy else cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "top_k": cfg.rollout.top_k, "max_tokens": cfg.rollout.max_response_tokens,
                    "stop": list(cfg.rollout.stop), "stop_token_ids": self.manager.stop_token_ids()}
        prompts = {i: fit_prompt(self.manager.render_prompt(records[i].messages, self.tool_schemas),
                                 cfg.rollout.max_prompt_tokens, cfg.rollout.truncation, records[i].origin)
                   for i in sorted({row // n for row in mine})}
        run_tool = self.tool_pool.call if self.tool_pool is not None else None

        sessions = {row: self.router.session() for row in mine}  # each trajectory stays on one engine
        engines = self.router.engines
        busy_before = [engine.busy_s for engine in engines]
        barrier = TurnBarrier(len(mine)) if cfg.tools.turn_schedule == "lockstep" else None
        trajectories = await asyncio.gather(*(
            run_agent_loop(prompts[row // n], sessions[row], self.manager, run_tool,
                           sampling if greedy else {**sampling, "seed": self.sample_seed(step, first_row + row)},
                           loop_cfg, barrier)
            for row in mine))
        local, summaries, versions = {}, [], {}
        generated = [0] * len(engines)
        # Counted from this phase's own calls: with batches generating ahead (asynchronous RL) an
        # engine's counters also move for the other batches in flight.
        requests = [0] * len(engines)
        newest = [-1] * len(engines)  # the newest weights each engine generated this phase's tokens with
        for row, traj in zip(mine, trajectories):
            text = self.tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m])
            local[row] = (traj, text)
            versions[row] = sessions[row].token_versions(sum(traj.loss_mask))
            summaries.append(RowSummary(row, self.layout.engine_index, len(traj.prompt_ids), len(traj.response_ids),
                                        len(traj.turns), sum(len(turn.tool_calls) for turn in traj.turns),
                                        _tool_errors(traj), {v: versions[row].count(v) for v in sorted(set(versions[row]))}))
            for engine, version, tokens in sessions[row].calls:
                generated[engine] += tokens
                requests[engine] += 1
                newest[engine] = max(newest[engine], version)
        stats = [{"requests": float(calls), "generated_tokens": float(tokens),
                  "busy_s": engine.busy_s - busy,
                  "weight_version": float(version if version >= 0 else self.router.version),
                  "failed": float(index in self.router.failed)}
                 for index, (engine, busy, calls, tokens, version)
                 in enumerate(zip(engines, busy_before, requests, generated, newest))]
        return local, summaries, stats, versions

    def place(self, rollouts: Rollouts) -> TrainRows:
        """This DP rank's rows, from the processes that made them: each row goes point to point to
        the ranks of the DP rank that trains it (`dp_row_owners`: each mini-batch split by
        tokens), and nowhere else."""
        longest = max(r.tokens for r in rollouts.summaries)
        budget = self.cfg.actor.max_tokens_per_microbatch
        if longest > budget:  # refused here on every rank: where it is trained, only one DP rank would see it
            raise ValueError(f"a trajectory of {longest} tokens exceeds actor.max_tokens_per_microbatch={budget}; "
                             "raise it or lower rollout.max_prompt_tokens + rollout.max_response_tokens")
        owners = self.row_owners(rollouts)
        outgoing: dict[int, list[RowData]] = {}
        for row in sorted(rollouts.local):
            for rank in self.ranks_of_dp[owners[row]]:
                outgoing.setdefault(rank, []).append(rollouts.row_data(row))
        rows = sorted((data for part in self._exchange(outgoing).values() for data in part), key=lambda d: d.row)
        batch = pad_rows([np.concatenate([r.prompt_ids, r.response_ids]).tolist() for r in rows],
                         [[0] * len(r.prompt_ids) + r.loss_mask.tolist() for r in rows], rollouts.group_size,
                         step_rows=[r.row for r in rows], step_size=len(rollouts.summaries))
        engine_log_probs = torch.zeros(batch.input_ids.shape)
        engine_versions = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
        for i, r in enumerate(rows):
            start = len(r.prompt_ids)
            engine_log_probs[i, start:start + len(r.log_probs)] = torch.from_numpy(r.log_probs)
            engine_versions[i, start:start + len(r.versions)] = torch.from_numpy(r.versions).long()
        return TrainRows(batch, engine_log_probs, engine_versions)

    def row_owners(self, rollouts: Rollouts) -> list[int]:
        """The DP rank that trains each row of `rollouts`."""
        return dp_row_owners([r.tokens for r in rollouts.summaries], self.cfg.actor.mini_batch_size, self.dp_size)

    def rewards(self, rollouts: Rollouts):
        """Every row's reward (each process scored its own rows), on every rank."""
        from rlfactory_megatron.rewards.records import RewardResult

        if rollouts.reward is not None:
            return rollouts.reward
        mine = sorted(rollouts.local)
        result = rollouts.reward_future.result() if rollouts.reward_future is not None else None
        part = (mine, result) if result is not None else ([], None)
        by_row: dict[int, tuple] = {}
        for rows, res in self._gather(part):
            for i, row in enumerate(rows):
                by_row[row] = (res.scores[i], res.response_lengths[i], res.extras[i], res.errors[i], res.error_kinds[i])
        ordered = [by_row[r.row] for r in rollouts.summaries]
        rollouts.reward = RewardResult(*(list(column) for column in zip(*ordered)))
        return rollouts.reward

    def _reward_samples(self, rollouts: Rollouts, rows: list[int]):
        from rlfactory_megatron.rewards import RewardSample

        return [RewardSample(rollouts.records[row].data_source, rollouts.local[row][1], rollouts.records[row].ground_truth,
                             response_length=len(rollouts.local[row][0].response_ids)) for row in rows]

    def record(self, rollouts: Rollouts, batch: RolloutBatch, step: int) -> None:
        """Each engine process writes the rows it produced, as trained on, to its own shard (one
        flushed batch), then the artifact cache's step-boundary sync among the engine processes.
        `batch` is this DP rank's (DP-local): the first rank of each DP rank sends each row's
        advantages back to the process that made the row."""
        if not self.cfg.cache.enable:
            return
        outgoing: dict[int, list[tuple[int, np.ndarray]]] = {}
        if self.layout.rank == self.ranks_of_dp[self.dp_rank][0]:
            for i, row in enumerate(batch.step_rows.tolist()):
                summary = rollouts.summaries[row]
                start = summary.prompt_tokens
                advantages = batch.advantages[i, start:start + summary.response_tokens].numpy()
                outgoing.setdefault(self.layout.owners[summary.producer], []).append((row, advantages))
        advantages = dict(item for part in self._exchange(outgoing).values() for item in part)
        if self.rollout_store is None:
            return
        self.rollout_store.write([rollouts.stored_record(row, step, advantages[row]) for row in sorted(rollouts.local)])
        if self.artifacts is not None:
            self.artifacts.sync()

    # ------------------------------------------------------------------ weights
    def sync(self, actor_engine, version: int) -> None:
        """The actor's weights into every engine in one collective sync (disaggregated engines
        that died since the last one are replaced first, so they serve these weights). With
        generation in flight (asynchronous RL), engine calls pause for it: calls under way end
        after their engine's current decode step (partial rollout) or finish on the old weights,
        and go on on the new ones."""
        from rlfactory_megatron.rollout.weight_sync import EngineLostError, WeightSyncError, sync_weights

        paused = self._loop_thread is not None and self.router is not None
        if paused:
            self._run(self.router.pause(interrupt=self.cfg.trainer.partial_rollout))
        try:
            # An engine that dies during the sync is replaced and the whole sync runs again (the
            # others hold layers of two versions); one that keeps dying ends the run there.
            for attempt in range(1, MAX_ENGINE_DEATHS_IN_A_ROW + 1):
                # The pool lives on the sending rank only: its failure to replace an engine goes
                # into the sync as a refusal, so every rank stops with it (not in a collective).
                failure = None
                if self.pool:
                    try:
                        self._replace_failed_engines()
                    except Exception as exc:  # noqa: BLE001 - reraised on every rank below
                        failure = exc
                try:
                    self._last_sync = sync_weights(actor_engine, self.transport, self.cfg.weight_sync.bucket_mb,
                                                   version=version, refusal=None if failure is None else _refusal(failure))
                    break
                except WeightSyncError as exc:
                    raise exc from failure
                except EngineLostError as exc:
                    if attempt == MAX_ENGINE_DEATHS_IN_A_ROW:
                        raise RuntimeError(f"the weight sync to version {version} failed {attempt} times: {exc}; "
                                           f"the engines' logs are in {self.output / 'logs'}") from exc
                    if exc.lost:  # the sending rank
                        print(f"rlf-train: {exc}; syncing again", flush=True)
                        for index in exc.lost:
                            self.router.fail(index, exc)
        finally:
            if self.router is not None:
                # A sync cut short leaves the engines serving (layers of both versions): the version
                # stays the last complete one.
                self._run(self.router.resume(self.transport.served_version))

    def sync_metrics(self) -> dict[str, float]:
        """The last sync's model bytes and the bytes of the engine calls that carried them (on a
        rank that sent one: the weights go by handle or broadcast, so these stay small)."""
        stats = self._last_sync
        if stats is None:
            return {}
        return {"weight_sync/bytes": float(stats.bytes), "weight_sync/message_bytes": float(stats.message_bytes)}

    def _replace_failed_engines(self) -> None:
        """A fresh actor for each engine that died (its requests already ran elsewhere), and a
        broadcast group with it; an engine that died at MAX_ENGINE_DEATHS_IN_A_ROW syncs in a row
        ends the run instead of failing forever."""
        import ray

        from rlfactory_megatron.rollout.async_engine import serving

        self._check_pool_alive()
        failed = dict(self.router.failed)
        for index in range(len(self.pool)):
            self._deaths_in_a_row[index] = self._deaths_in_a_row.get(index, 0) + 1 if index in failed else 0
        for index, why in sorted(failed.items()):
            if self._deaths_in_a_row[index] >= MAX_ENGINE_DEATHS_IN_A_ROW:
                raise RuntimeError(f"rollout engine {index} died at {self._deaths_in_a_row[index]} syncs in a row "
                                   f"(last: {why}); its log is in {self.output / 'logs'}")
            print(f"rlf-train: rollout engine {index} died ({why}); starting a new one", flush=True)
            try:
                ray.kill(self.pool[index].actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
            self._run(self.router.engines[index].close())
            self._replaced += 1
            self.pool[index] = self._new_pool_engine(index, self._replaced)
            self.router.revive(index, serving(self.pool[index]))
        if failed:  # the group of the sender and every engine, the new ones included
            served = self.transport.served_version
            self.transport.close()  # its NCCL communicator, on this rank and the surviving engines
            self.transport = self._pool_transport()
            self.transport.served_version = served

    def _new_pool_engine(self, index: int, replacement: int = 0):
        """Pool engine `index` in a Ray actor of its own: devices of its own (Ray resources:
        rollout.tp GPUs, or one CPU), no sleep mode. Named rlf-engine-<i> (a replacement:
        rlf-engine-<i>-<n>; a killed actor's name may not be free yet), so that tools and
        operators can find them."""
        from rlfactory_megatron.rollout.ray_engine import RayVLLMEngine

        gpus = self.cfg.rollout.tp if torch.cuda.is_available() else 0
        name = f"rlf-engine-{index}" + (f"-{replacement}" if replacement else "")
        return RayVLLMEngine(self.hf_dir, num_cpus=1, num_gpus=gpus, name=name, **self._engine_args)

    def _pool_transport(self):
        """The weight group of this rank and every pool engine, at an address engines on other
        nodes reach."""
        import ray

        from rlfactory_megatron.config import weight_sync_transport
        from rlfactory_megatron.rollout.weight_sync import TRANSPORTS

        return TRANSPORTS.get(weight_sync_transport(self.cfg))(self.pool, host=ray.util.get_node_ip_address())

    def _check_pool_alive(self) -> None:
        """Engines that died between steps (no request saw it) count as failed, so the sync does
        not stream into a dead actor."""
        import ray

        # All pinged at once, under one deadline: a wedged engine costs the timeout once, not per engine.
        pings = {index: engine.actor.weight_names.remote() for index, engine in enumerate(self.pool)
                 if index not in self.router.failed}
        deadline = time.monotonic() + ENGINE_PING_TIMEOUT_S
        for index, ping in pings.items():
            try:
                ray.get(ping, timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:  # noqa: BLE001 - dead, or wedged: replaced either way
                self.router.fail(index, exc)

    def sleep(self, level: int = 2) -> None:
        """This process's engine gives its device memory to training (vLLM's sleep mode, GPU
        only). Level 2 drops its weights and KV cache: the weights wake first, for a weight sync
        to fill; level 1 keeps the weights in host memory, for work no sync follows."""
        if self.engine is not None and not self._asleep:
            self.engine.sleep(level)
            self._asleep = set(ENGINE_MEMORY)

    def wake_up(self, tags: Sequence[str] = ENGINE_MEMORY) -> None:
        """Give back the engine memory `tags` name (of those asleep): after a level-2 sleep,
        "weights", then the sync, then "kv_cache" (vLLM's order for a weight update)."""
        waking = [tag for tag in ENGINE_MEMORY if tag in tags and tag in self._asleep]
        if waking:
            self.engine.wake_up(waking)
            self._asleep -= set(waking)

    # ------------------------------------------------------------------ helpers
    def sample_seed(self, step: int, row: int) -> int:
        """The sampling seed of one trajectory, from (run seed, step, row): a resumed run draws the
        same samples as an uninterrupted one, however many engines and batches serve them."""
        return int(np.random.SeedSequence([self.cfg.trainer.seed, step, row]).generate_state(1)[0] >> 1)

    def close(self) -> None:
        if self.router is None:
            return
        for engine in self.router.engines:  # their batching tasks end with the loop
            self._run(engine.close())
        if self.tool_pool is not None:
            self._run(self.tool_pool.close())
        if self._loop_thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(timeout=30)
        self.reward_pool.shutdown()
        if self.transport is not None:
            self.transport.close()
        for engine in [self.engine, *self.pool]:
            if engine is not None:
                engine.close()
        for store in (self.rollout_store, self.artifacts):
            if store is not None:
                store.close()


def _done(result) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


# A disaggregated engine that dies at this many weight syncs in a row ends the run.
MAX_ENGINE_DEATHS_IN_A_ROW = 3
# How long a live engine may take to answer the check before a sync.
ENGINE_PING_TIMEOUT_S = 120


def _refusal(failure: Exception) -> str:
    """Why the sending rank cannot sync, in one line for every rank's error."""
    from rlfactory_megatron.rollout.router import error_line

    if type(failure) is RuntimeError:  # ours: already says what happened and where the logs are
        return str(failure)
    return f"a new rollout engine could not start: {error_line(failure)}"


def _engine_died(exc: BaseException) -> bool:
    """Whether an engine call failed because the engine is gone (its requests can run elsewhere):
    its Ray actor died, or the vLLM engine inside failed a step while the actor lives on."""
    from ray.exceptions import RayActorError

    from rlfactory_megatron.rollout.async_engine import EngineStepError

    return isinstance(exc, (RayActorError, EngineStepError))


def _report_sandboxes(specs) -> None:
    """One start-up line per sandboxed tool: the isolation its programs run under on this node
    (each result's metadata carries it too)."""
    from rlfactory_megatron.envs.tools.registry import resolve_tool_class

    for spec in specs:
        cls = resolve_tool_class(spec.cls)
        if hasattr(cls, "isolation"):
            isolation = cls(**spec.params).isolation()
            held = ", ".join(k for k, v in isolation.items() if v) or "none"
            missing = ", ".join(k for k, v in isolation.items() if not v)
            print(f"rlf-train: tool '{spec.cls}' runs programs isolated by: {held}"
                  + (f" (not: {missing})" if missing else ""), flush=True)


@contextlib.contextmanager
def _engine_gpus_only(local_cluster: bool):
    """Starting a local Ray for disaggregated engines on GPU: Ray sees only this node's devices
    the training ranks do not use (local ranks take devices 0..LOCAL_WORLD_SIZE-1), so that no
    engine lands on a training GPU. Yields the GPU count for ray.init (None: Ray's own view)."""
    if not (local_cluster and torch.cuda.is_available()):
        yield None
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    free = devices[int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())):]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(free)  # what the raylet starts with
    try:
        yield len(free)
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


@contextlib.contextmanager
def _engine_devices(layout: EngineLayout):
    """On GPU, the engine's processes see the devices of its group's ranks; on CPU nothing changes."""
    if not torch.cuda.is_available():
        yield
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = engine_visible_devices(visible, torch.cuda.device_count(),
                                                                torch.cuda.current_device(), layout.rollout_tp)
    try:
        yield
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def engine_visible_devices(visible: str | None, device_count: int, device: int, rollout_tp: int) -> str:
    """CUDA_VISIBLE_DEVICES of a colocated engine owned by the rank on `device` (its index among
    the `visible` ones, as init_distributed set it from the launcher's local rank): that device and
    the next rollout_tp - 1, those of the group's other ranks (a node's ranks are numbered in
    order). Not LOCAL_RANK, which srun and mpirun do not set, nor the global rank, which is past
    the node's devices on a second node; with one GPU per task (srun --gpus-per-task=1) a group
    of several ranks has no devices in common, and is refused."""
    devices = visible.split(",") if visible else [str(index) for index in range(device_count)]
    group = devices[device:device + rollout_tp]
    if len(group) < rollout_tp:
        raise ValueError(f"rollout.tp={rollout_tp}: a colocated engine runs on the devices of its {rollout_tp} ranks, "
                         f"but this rank (device {device}) sees only {len(devices)} GPU(s) ({','.join(devices)}), "
                         "as with one GPU per task (srun --gpus-per-task=1); give every task its node's GPUs "
                         "(--gpus-per-node), or set rollout.tp=1")
    return ",".join(group)
