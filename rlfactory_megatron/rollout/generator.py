"""One step's trajectories, on every engine process: a step's prompts split across the engines,
the agent loop with tools, each process scoring and storing its own rows. Trajectories stay where
they were made: every rank learns only each row's size and counts (`RowSummary`), and each row's
tokens go point to point from the process that made it to the ranks of the one DP rank that
trains it (`RolloutGenerator.place`). Rows are numbered in the order one engine would have
produced them; seeds come from (run seed, step, row), so a run's samples do not depend on how
many engines generate them.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from rlfactory_megatron.actor.batch import RolloutBatch, dp_row_owners, pad_rows
from rlfactory_megatron.rollout.fleet import EngineFleet
from rlfactory_megatron.rollout.prompts import PromptRecord, fit_prompt
from rlfactory_megatron.rollout.rows import PendingRollout, Rollouts, RowData, RowSummary, TrainRows, tool_errors
from rlfactory_megatron.runtime.collectives import RankCollectives


class RolloutGenerator:
    """Tools, rewards and the rollout store of this process (when it drives engines), and the
    collectives that make one step's rows out of every engine process's; every method is called
    on every training rank. `draw` gives a step's prompts; `drop_uniform_groups`: DAPO's dynamic
    sampling; trainer.max_staleness > 0: batches generated ahead of training."""

    def __init__(self, cfg, fleet: EngineFleet, collectives: RankCollectives, tokenizer, output: Path,
                 tool_specs: list, draw: Callable[[], list[PromptRecord]], drop_uniform_groups: bool) -> None:
        from megatron.core import parallel_state

        from rlfactory_megatron.envs.tool_manager import get_tool_manager
        from rlfactory_megatron.rollout.pipeline import RolloutPipeline

        self.cfg, self.fleet, self.collectives, self.tokenizer, self.output = cfg, fleet, collectives, tokenizer, output
        self.draw, self.drop_uniform_groups = draw, drop_uniform_groups
        layout = fleet.layout
        # Every rank creates the engine processes' group (torch requires it), only they use it.
        self.owner_group = collectives.subgroup(layout.owners)
        self.tool_pool = self.reward_pool = self.rollout_store = self.artifacts = None
        self.tool_schemas: list[dict] | None = None
        # The ranks of each DP rank (all of its TP and PP ranks train on the same rows).
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        dp_of_rank = collectives.gather(self.dp_rank)
        self.ranks_of_dp = [[r for r, d in enumerate(dp_of_rank) if d == dp] for dp in range(self.dp_size)]
        self.manager = get_tool_manager(cfg.tools.format, tokenizer)
        if fleet.generates:
            self._start_services(tool_specs)
        # Asynchronous RL: batches generated ahead of training (pipeline.py); None: synchronous steps.
        self.pipeline = (RolloutPipeline(self, draw, cfg.trainer.max_staleness, cfg.trainer.partial_rollout,
                                         cfg.trainer.total_steps)
                         if cfg.trainer.max_staleness > 0 else None)

    def _start_services(self, tool_specs: list) -> None:
        from rlfactory_megatron.rewards import CombineSpec, RemoteRewardSpec, RewardFnSpec
        from rlfactory_megatron.rewards.pool import RewardPool

        cfg = self.cfg
        if cfg.cache.enable:
            self._open_cache()
        if cfg.tools.enable:
            self._start_tool_pool(tool_specs)
        self.reward_pool = RewardPool(cfg.reward.manager, RewardFnSpec.from_config(cfg.reward),
                                      manager_options=dict(cfg.reward.manager_options),
                                      num_workers=cfg.reward.num_workers, sample_timeout_s=cfg.reward.timeout_s,
                                      remote=RemoteRewardSpec.from_config(cfg.reward),
                                      combine=CombineSpec.from_config(cfg.reward.combine))

    def _cache_topology(self):
        """One shard per engine process: the training topology when every rank owns an engine,
        else the engine processes' group alone."""
        from rlfactory_megatron.envs.storage.topology import Topology, detect_topology

        layout = self.fleet.layout
        if layout.num_engines == layout.world:
            return detect_topology()

        return Topology(rank=layout.engine_index, world=layout.num_engines, backend="torch",
                        allgather=lambda obj: self.collectives.gather(obj, self.owner_group, layout.num_engines))

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

    def _start_tool_pool(self, tool_specs: list) -> None:
        from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig

        cfg = self.cfg.tools
        pool_cfg = ToolPoolConfig(tool_specs, num_actors=cfg.num_workers, max_concurrency=cfg.max_concurrency,
                                  call_timeout_s=cfg.call_timeout_s, channel=cfg.channel)
        self.tool_pool = ToolPool(pool_cfg, self.artifacts)
        self.tool_schemas = self.fleet.run(self.tool_pool.start())
        if self.fleet.layout.rank == 0:
            _report_sandboxes(pool_cfg.tools)

    # ------------------------------------------------------------------ a step's rows
    def generate(self, step: int) -> TrainRows:
        """This DP rank's rows of step `step`, generated on every engine; their rewards are
        gathered later (`rewards`: overlapped with the log-probs), except with dynamic sampling
        (DAPO), which needs them to choose the groups it keeps. Asynchronous, the batch generated
        ahead for this step."""
        from rlfactory_megatron.rollout.dynamic_sampling import informative_rollouts

        cfg = self.cfg.trainer
        if self.pipeline is not None:
            rollouts = self.pipeline.take(step)
        elif self.drop_uniform_groups:
            rollouts = informative_rollouts(self, self.draw, step, cfg.prompts_per_step, self.cfg.rollout.n,
                                            cfg.max_refill_rounds)
        else:
            rollouts = self.rollout(self.draw(), step)
        return self.place(rollouts)

    def before_sync(self) -> None:
        """Asynchronous RL without partial rollout: the batches in flight finish on the old weights."""
        if self.pipeline is not None:
            self.pipeline.before_sync()

    def after_sync(self, version: int) -> None:
        """The engines serve `version`: asynchronous, the batches it allows start generating."""
        if self.pipeline is not None:
            self.pipeline.after_sync(version)

    # ------------------------------------------------------------------ a rollout phase
    def rollout(self, records: list[PromptRecord], step: int, greedy: bool = False, first_row: int = 0) -> Rollouts:
        """n trajectories per prompt (1 when greedy), each engine generating its share of the
        prompts; the rows of this process are submitted for scoring at once. `first_row` numbers
        the rows for their sampling seeds (refills must not repeat a step's earlier samples)."""
        return self.finish(self.start(records, step, greedy, first_row))

    def start(self, records: list[PromptRecord], step: int, greedy: bool = False, first_row: int = 0) -> PendingRollout:
        """Start a rollout phase (`rollout`'s first half): the generating process's share begins on
        the fleet's event loop; `finish` waits for it. No collective: ranks may start phases at
        any time, and must finish them in the same order."""
        pending = PendingRollout(records, step, greedy, first_row)
        if self.fleet.generates:
            pending.generation = self.fleet.submit(self._generate(pending))
        return pending

    def samples_per_prompt(self, greedy: bool) -> int:
        """rollout.n samples of a prompt; greedy (validation), one: its samples would be equal."""
        return 1 if greedy else self.cfg.rollout.n

    def finish(self, pending: PendingRollout) -> Rollouts:
        """Collective: the phase's rows from every generating process, this process's submitted for scoring."""
        n = self.samples_per_prompt(pending.greedy)
        local, summaries, engines, versions = (pending.generation.result() if pending.generation is not None
                                               else ({}, [], [], {}))
        gathered = self.collectives.gather((summaries, engines))
        every_row = sorted((row for part, _ in gathered for row in part), key=lambda r: r.row)
        records = pending.records
        rollouts = Rollouts(every_row, [records[i // n] for i in range(len(records) * n)], n,
                            [stats for _, part in gathered for stats in part], local, versions)
        if local:
            rollouts.reward_future = self.reward_pool.submit(self._reward_samples(rollouts, sorted(local)))
        return rollouts

    async def _generate(self, pending: PendingRollout):
        """This process's rows of a phase: (trajectories + text, summaries, engine stats, token versions)."""
        from rlfactory_megatron.envs.agent_loop import TURN_SCHEDULES, AgentLoopConfig, run_agent_loop

        records, step, greedy, first_row = pending.records, pending.step, pending.greedy, pending.first_row
        n = self.samples_per_prompt(greedy)
        layout, router = self.fleet.layout, self.fleet.router
        share = layout.share(len(records), layout.engine_index)
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

        sessions = {row: router.session() for row in mine}  # each trajectory stays on one engine
        engines = router.engines
        busy_before = [engine.busy_s for engine in engines]
        barrier = TURN_SCHEDULES.get(cfg.tools.turn_schedule)(len(mine))
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
            summaries.append(RowSummary(row, layout.engine_index, len(traj.prompt_ids), len(traj.response_ids),
                                        len(traj.turns), sum(len(turn.tool_calls) for turn in traj.turns),
                                        tool_errors(traj), {v: versions[row].count(v) for v in sorted(set(versions[row]))}))
            for engine, version, tokens in sessions[row].calls:
                generated[engine] += tokens
                requests[engine] += 1
                newest[engine] = max(newest[engine], version)
        stats = [{"requests": float(calls), "generated_tokens": float(tokens),
                  "busy_s": engine.busy_s - busy,
                  "weight_version": float(version if version >= 0 else router.version),
                  "failed": float(index in router.failed)}
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
        rows = sorted((data for part in self.collectives.exchange(outgoing).values() for data in part),
                      key=lambda d: d.row)
        batch = pad_rows([np.concatenate([r.prompt_ids, r.response_ids]).tolist() for r in rows],
                         [[0] * len(r.prompt_ids) + r.loss_mask.tolist() for r in rows], rollouts.group_size,
                         step_rows=[r.row for r in rows], step_size=len(rollouts.summaries))
        engine_log_probs = torch.zeros(batch.input_ids.shape)
        engine_versions = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
        for i, r in enumerate(rows):
            start = len(r.prompt_ids)
            engine_log_probs[i, start:start + len(r.log_probs)] = torch.from_numpy(r.log_probs)
            engine_versions[i, start:start + len(r.versions)] = torch.from_numpy(r.versions).long()
        return TrainRows(batch, engine_log_probs, engine_versions, rollouts)

    def metrics(self, rollouts: Rollouts, version: int) -> dict[str, float]:
        """What the trainer logs of a step's rows (collective): their rewards and counts, and,
        asynchronous, how old the weights that generated them are against `version`, the
        weights trained on them; older than trainer.max_staleness would be a bug of the
        pipeline, so it stops the run."""
        metrics = {**self.rewards(rollouts).metrics(), **rollouts.stats()}
        if self.pipeline is not None:
            staleness = rollouts.staleness(version)
            if staleness["rollout/staleness_max"] > self.cfg.trainer.max_staleness:
                raise RuntimeError(f"step {version + 1}: a trained token is {staleness['rollout/staleness_max']:g} "
                                   f"weight versions old, over trainer.max_staleness={self.cfg.trainer.max_staleness}")
            metrics.update(staleness)
        return metrics

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
        for rows, res in self.collectives.gather(part):
            for i, row in enumerate(rows):
                by_row[row] = (res.scores[i], res.response_lengths[i], res.extras[i], res.errors[i], res.error_kinds[i])
        ordered = [by_row[r.row] for r in rollouts.summaries]
        rollouts.reward = RewardResult(*(list(column) for column in zip(*ordered)))
        return rollouts.reward

    def _reward_samples(self, rollouts: Rollouts, rows: list[int]):
        from rlfactory_megatron.rewards import RewardSample

        return [RewardSample(rollouts.records[row].data_source, rollouts.local[row][1], rollouts.records[row].ground_truth,
                             response_length=len(rollouts.local[row][0].response_ids),
                             prompt=_user_text(rollouts.records[row].messages),
                             tool_calls=[{"name": c.name, "arguments": c.arguments, "observation": c.observation}
                                         for turn in rollouts.local[row][0].turns for c in turn.tool_calls])
                for row in rows]

    def record(self, rows: TrainRows, batch: RolloutBatch, step: int) -> None:
        """Each engine process writes the rows it produced, as trained on, to its own shard (one
        flushed batch), then the artifact cache's step-boundary sync among the engine processes.
        `batch` is this DP rank's `rows` with their advantages: the first rank of each DP rank
        sends each row's advantages back to the process that made the row."""
        if not self.cfg.cache.enable:
            return
        rollouts = rows.rollouts
        outgoing: dict[int, list[tuple[int, np.ndarray]]] = {}
        if self.fleet.layout.rank == self.ranks_of_dp[self.dp_rank][0]:
            for i, row in enumerate(batch.step_rows.tolist()):
                summary = rollouts.summaries[row]
                start = summary.prompt_tokens
                advantages = batch.advantages[i, start:start + summary.response_tokens].numpy()
                outgoing.setdefault(self.fleet.layout.owners[summary.producer], []).append((row, advantages))
        advantages = dict(item for part in self.collectives.exchange(outgoing).values() for item in part)
        if self.rollout_store is None:
            return
        self.rollout_store.write([rollouts.stored_record(row, step, advantages[row]) for row in sorted(rollouts.local)])
        if self.artifacts is not None:
            self.artifacts.sync()

    def sample_seed(self, step: int, row: int) -> int:
        """The sampling seed of one trajectory, from (run seed, step, row): a resumed run draws the
        same samples as an uninterrupted one, however many engines and batches serve them."""
        return int(np.random.SeedSequence([self.cfg.trainer.seed, step, row]).generate_state(1)[0] >> 1)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> bytes | None:
        """Asynchronous RL: the batches generated ahead, as checkpoint bytes (rollout/pipeline.py)."""
        return self.pipeline.state() if self.pipeline is not None else None

    def restore(self, directory: Path) -> None:
        if self.pipeline is not None:
            self.pipeline.restore(directory)

    def close(self) -> None:
        if self.tool_pool is not None:
            self.fleet.run(self.tool_pool.close())
        if self.reward_pool is not None:
            self.reward_pool.shutdown()
        for store in (self.rollout_store, self.artifacts):
            if store is not None:
                store.close()


def _user_text(messages: list[dict]) -> str:
    """The task as the user asked it: the last user message's text (what a judge reads as the prompt)."""
    content = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    return content if isinstance(content, str) else str(content)


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
