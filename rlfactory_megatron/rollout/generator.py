"""One step's trajectories, on every producer (a rank that drives engines): a step's prompts split
across the producers, the agent loop with tools, each producer scoring its own rows. Trajectories
stay where they were made: every rank learns only each row's size and counts (`RowSummary`), and
each row goes point to point from the process that made it to the ranks of the one DP rank that
trains it (`RolloutGenerator.place`), whose first rank stores it once trained: nothing comes back.
Rows are numbered in the order one engine would have produced them; seeds come from (run seed, step,
row), so a run's samples do not depend on how many engines generate them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from rlfactory_megatron.actor.batch import RolloutBatch, dp_row_owners, pad_rows
from rlfactory_megatron.rollout.engines import SamplingConfig
from rlfactory_megatron.rollout.fleet import EngineFleet
from rlfactory_megatron.rollout.judge_turns import JudgeTurns
from rlfactory_megatron.rollout.prompts import PromptRecord, fit_prompt
from rlfactory_megatron.rollout.rows import (PendingRollout, Rollouts, RowData, RowSummary, TrainRows, tool_errors,
                                             with_engine_routes)
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
        self.tool_pool = self.reward_pool = self.judge = self.rollout_store = self.artifacts = None
        self.rule_validates = False  # validation scored by the rule alone, though a judge scores training
        self.tool_schemas: list[dict] | None = None
        # The ranks of each DP rank (all of its TP and PP ranks train on the same rows).
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        dp_of_rank = collectives.gather(self.dp_rank)
        self.ranks_of_dp = [[r for r, d in enumerate(dp_of_rank) if d == dp] for dp in range(self.dp_size)]
        # The rollout store: one shard per DP rank, written by its first rank (the rows it trained).
        writers = [ranks[0] for ranks in self.ranks_of_dp]
        writer_group = collectives.subgroup(writers)
        if cfg.cache.enable and layout.rank == writers[self.dp_rank]:
            from rlfactory_megatron.envs.storage import RolloutStore

            self.rollout_store = RolloutStore(self._cache_root() / "rollouts",
                                              topology=self._shard_topology(writers, self.dp_rank, writer_group))
        self.manager = get_tool_manager(cfg.tools.format, tokenizer)
        judge = cfg.reward.model
        self.judge_turns = JudgeTurns(fleet, judge.kind is not None and judge.placement == "colocated")
        if fleet.generates:
            self._start_services(tool_specs)
        # Asynchronous RL: batches generated ahead of training (pipeline.py); None: synchronous steps.
        self.pipeline = (RolloutPipeline(self, draw, cfg.trainer.max_staleness, cfg.trainer.partial_rollout,
                                         cfg.trainer.total_steps)
                         if cfg.trainer.max_staleness > 0 else None)

    def _start_services(self, tool_specs: list) -> None:
        from rlfactory_megatron.rewards import CombineSpec, RemoteRewardSpec, RewardFnSpec
        from rlfactory_megatron.rewards.pool import RewardPool
        from rlfactory_megatron.rewards.served_judge import start_judge

        cfg = self.cfg
        if cfg.cache.enable:
            self._open_artifacts()
        if cfg.tools.enable:
            self._start_tool_pool(tool_specs)
        self.combine = CombineSpec.from_config(cfg.reward.combine)
        # A judge on our engines scores on this process's event loop (as each trajectory ends); its
        # replies share the tool-result cache, under the judge's own name.
        self.judge = self.judge_turns.start(lambda: start_judge(cfg, self.fleet.layout, self.artifacts))
        # Held-out accuracy stays the rule's where the run names one: the judge's score trains,
        # the rule measures (a judge's mistakes would otherwise count as accuracy).
        self.rule_validates = self.judge is not None and bool(cfg.reward.scorer or cfg.reward.custom_function_path)
        if self.judge is None or self.combine.uses_rule or self.rule_validates:
            self.reward_pool = RewardPool(cfg.reward.manager, RewardFnSpec.from_config(cfg.reward),
                                          manager_options=dict(cfg.reward.manager_options),
                                          num_workers=cfg.reward.num_workers, sample_timeout_s=cfg.reward.timeout_s,
                                          remote=RemoteRewardSpec.from_config(cfg.reward),
                                          combine=self.combine if self.judge is None else None)

    def _cache_root(self) -> Path:
        """The run's HDF5 cache (cache.dir, default <output_dir>/cache): every step's trajectories
        as trained on (`rollouts/`, a shard per DP rank) and the tool artifacts the tool pool
        answers repeated calls from (`tool_artifacts/`, a shard per producer)."""
        return Path(self.cfg.cache.dir or self.output / "cache")

    def _shard_topology(self, ranks: list[int], index: int, group):
        """One shard per rank of `ranks` (this rank's is `index`): the training topology when
        they are every rank, else their own group's."""
        from rlfactory_megatron.envs.storage.topology import Topology, detect_topology

        if len(ranks) == self.collectives.world:
            return detect_topology()
        return Topology(rank=index, world=len(ranks), backend="torch",
                        allgather=lambda obj: self.collectives.gather(obj, group, len(ranks)))

    def _open_artifacts(self) -> None:
        from rlfactory_megatron.envs.storage import ToolArtifactCache

        layout = self.fleet.layout
        self.artifacts = ToolArtifactCache(self._cache_root() / "tool_artifacts",
                                           topology=self._shard_topology(layout.owners, layout.producer, self.owner_group),
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
        local, summaries, engines, versions, judged = (pending.generation.result() if pending.generation is not None
                                                       else ({}, [], [], {}, {}))
        gathered = self.collectives.gather((summaries, engines))
        every_row = sorted((row for part, _ in gathered for row in part), key=lambda r: r.row)
        records = pending.records
        rollouts = Rollouts(every_row, [records[i // n] for i in range(len(records) * n)], n,
                            [stats for _, part in gathered for stats in part], local, versions)
        if local:
            from rlfactory_megatron.rewards.combine import CombinedFuture

            samples = self._reward_samples(rollouts, sorted(local))
            if not self._judges(pending.greedy):
                rollouts.reward_future = self.reward_pool.submit(samples)
            else:
                rule = self.reward_pool.submit(samples) if self.combine.uses_rule else None
                rollouts.reward_future = CombinedFuture(samples, rule, [judged[row] for row in sorted(local)],
                                                        self.combine.load())
        return rollouts

    async def _generate(self, pending: PendingRollout):
        """This process's rows of a phase: (trajectories + text, summaries, engine stats, token
        versions, the judge's model scores)."""
        from rlfactory_megatron.envs.agent_loop import TURN_SCHEDULES, AgentLoopConfig, run_agent_loop

        records, step, greedy, first_row = pending.records, pending.step, pending.greedy, pending.first_row
        n = self.samples_per_prompt(greedy)
        layout, router = self.fleet.layout, self.fleet.router
        share = layout.share(len(records), layout.producer)
        mine = [i * n + k for i in share for k in range(n)]

        cfg = self.cfg
        loop_cfg = AgentLoopConfig(max_turns=cfg.tools.max_turns if cfg.tools.enable else 1,
                                   max_response_tokens=cfg.rollout.max_response_tokens,
                                   tool_response_max_tokens=cfg.tools.tool_response_max_tokens)
        sampling = SamplingConfig.from_rollout_config(cfg.rollout, greedy, stop_token_ids=self.manager.stop_token_ids())
        prompts = {i: fit_prompt(self.manager.render_prompt(records[i].messages, self.tool_schemas),
                                 cfg.rollout.max_prompt_tokens, cfg.rollout.truncation, records[i].origin)
                   for i in sorted({row // n for row in mine})}
        run_tool = self.tool_pool.call if self.tool_pool is not None else None

        await self.judge_turns.before_generation()
        sessions = {row: router.session() for row in mine}  # each trajectory stays on one engine
        fronts = router.fronts
        busy_before = [front.busy_s for front in fronts]
        barrier = TURN_SCHEDULES.get(cfg.tools.turn_schedule)(len(mine))
        judging: dict[int, asyncio.Future] = {}  # placement own: each trajectory judged as soon as it ends

        async def trajectory(row: int):
            traj = await run_agent_loop(
                prompts[row // n], sessions[row], self.manager, run_tool,
                sampling if greedy else dataclasses.replace(sampling, seed=self.sample_seed(step, first_row + row)),
                loop_cfg, barrier)
            if self._judges(greedy) and self.judge.spec.overlaps_generation:
                judging[row] = asyncio.ensure_future(self._judged(_reward_sample(records[row // n], traj,
                                                                                 self._text(traj))))
            return traj

        trajectories = await asyncio.gather(*(trajectory(row) for row in mine))
        judged = {}
        if self._judges(greedy):
            judged = await self._judge_phase({row: _reward_sample(records[row // n], traj, self._text(traj))
                                              for row, traj in zip(mine, trajectories) if row not in judging}, judging)
        local, summaries, versions = {}, [], {}
        generated = [0] * len(fronts)
        # Counted from this phase's own calls: with batches generating ahead (asynchronous RL) an
        # engine's counters also move for the other batches in flight.
        requests = [0] * len(fronts)
        newest = [-1] * len(fronts)  # the newest weights each engine generated this phase's tokens with
        for row, traj in zip(mine, trajectories):
            local[row] = (traj, self._text(traj))
            versions[row] = sessions[row].token_versions(sum(traj.loss_mask))
            summaries.append(RowSummary(row, layout.producer, len(traj.prompt_ids), len(traj.response_ids),
                                        len(traj.turns), sum(len(turn.tool_calls) for turn in traj.turns),
                                        tool_errors(traj), {v: versions[row].count(v) for v in sorted(set(versions[row]))},
                                        traj.stop_reason))
            for index, version, tokens in sessions[row].calls:
                generated[index] += tokens
                requests[index] += 1
                newest[index] = max(newest[index], version)
        stats = [{"requests": float(calls), "generated_tokens": float(tokens),
                  "busy_s": front.busy_s - busy,
                  "weight_version": float(version if version >= 0 else router.version),
                  "failed": float(index in router.failed)}
                 for index, (front, busy, calls, tokens, version)
                 in enumerate(zip(fronts, busy_before, requests, generated, newest))]
        return local, summaries, stats, versions, judged

    def _judges(self, greedy: bool) -> bool:
        """Whether the judge scores a phase's trajectories (greedy: validation's)."""
        return self.judge is not None and not (greedy and self.rule_validates)

    def _text(self, traj) -> str:
        """A trajectory's response as text: the tokens the policy generated (observations left out)."""
        return self.tokenizer.decode([t for t, m in zip(traj.response_ids, traj.loss_mask) if m])

    async def _judged(self, sample):
        """The judge's score of `sample` and when it came."""
        score = await self.judge.score(sample)
        return score, time.monotonic()

    async def _judge_phase(self, rest: dict, judging: dict[int, asyncio.Future]) -> dict:
        """Every row's model score, once the phase's trajectories have ended: those judged meanwhile
        (placement own) awaited, the `rest` (row -> sample) judged now (colocated: the policy
        engine put to sleep and the judge woken for them, then put back to sleep). Each score's
        `wait_s`: how long after the last trajectory ended it came."""
        ended = time.monotonic()
        async with self.judge_turns.judging(self.judge):
            for row, sample in rest.items():
                judging[row] = asyncio.ensure_future(self._judged(sample))
            outcomes = dict(zip(judging, await asyncio.gather(*judging.values())))
            # own: its new actors start while the next phase generates; colocated: in its turn, to sleep with it
            if self.judge.router.failed:
                await self.judge.replace_failed()
        for score, came in outcomes.values():
            score.wait_s = max(0.0, came - ended)
        return {row: score for row, (score, _) in outcomes.items()}

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
        return TrainRows(with_engine_routes(batch, rows), engine_log_probs, engine_versions, rollouts, rows)

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
        return [_reward_sample(rollouts.records[row], *rollouts.local[row]) for row in rows]

    def record(self, rows: TrainRows, batch: RolloutBatch, step: int) -> None:
        """The first rank of each DP rank writes the rows it trained, with the advantages `batch`
        (the trained batch) holds, to its own shard (one flushed batch); then the artifact
        cache's step-boundary sync among the producers."""
        if self.rollout_store is not None and rows.data:
            data = {d.row: d for d in rows.data}
            stored = []
            for i, row in enumerate(batch.step_rows.tolist()):
                start, length = len(data[row].prompt_ids), len(data[row].response_ids)
                stored.append(rows.rollouts.stored_record(data[row], step, batch.advantages[i, start:start + length].numpy()))
            self.rollout_store.write(sorted(stored, key=lambda r: r.sample_id))
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
        if self.judge is not None:
            self.fleet.run(self.judge.close())
        for store in (self.rollout_store, self.artifacts):
            if store is not None:
                store.close()


def _reward_sample(record: PromptRecord, traj, text: str):
    """One finished trajectory as the reward side reads it: its task, response text and tool calls."""
    from rlfactory_megatron.rewards import RewardSample

    return RewardSample(record.data_source, text, record.ground_truth, response_length=len(traj.response_ids),
                        prompt=_user_text(record.messages),
                        tool_calls=[{"name": c.name, "arguments": c.arguments, "observation": c.observation}
                                    for turn in traj.turns for c in turn.tool_calls])


def _user_text(messages: list[dict]) -> str:
    """The task as the user asked it: the last user message's text (what a judge reads as the prompt)."""
    content = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    return content if isinstance(content, str) else str(content)


def _report_sandboxes(specs) -> None:
    """One start-up line per sandboxed tool: the isolation its programs run under on this node
    (each result's metadata carries it too)."""
    from rlfactory_megatron.envs.tools.registry import resolve_tool_class

    for spec in specs:
        cls = resolve_tool_class(spec.cls, spec.module_dirs)
        if hasattr(cls, "isolation"):
            isolation = cls(**spec.params).isolation()
            held = ", ".join(k for k, v in isolation.items() if v) or "none"
            missing = ", ".join(k for k, v in isolation.items() if not v)
            print(f"rlf-train: tool '{spec.cls}' runs programs isolated by: {held}"
                  + (f" (not: {missing})" if missing else ""), flush=True)
