"""One RL run, readable top to bottom: `Trainer.fit()` repeats `step()`:

rollout (agent loop on vLLM, tools in Ray) -> rewards (Ray pool, overlapped with log-probs)
-> old/ref log-probs, values -> advantages -> actor (+ critic) update -> weight sync -> log,
validate and checkpoint. Every rank runs this; rank 0 owns the engine, the tool pool and the
reward pool and broadcasts what it produces.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rlfactory_megatron.actor.actor import Actor, Critic, PolicyModel
from rlfactory_megatron.actor.batch import RolloutBatch
from rlfactory_megatron.algorithms import compute_advantages
from rlfactory_megatron.models.builder import BuildOptions
from rlfactory_megatron.models.hf_arch import load_arch
from rlfactory_megatron.trainer.data import PromptRecord, PromptSampler, load_prompts
from rlfactory_megatron.trainer.logger import MetricsLogger
from rlfactory_megatron.trainer.presets import apply_preset
from rlfactory_megatron.trainer.tasks import TASKS

STATE_FILE = "trainer_state.json"


@dataclass
class Rollouts:
    """What rank 0 produced in one rollout phase (the other ranks get `for_followers()`)."""

    batch: RolloutBatch
    records: list[PromptRecord]  # one per row (a prompt repeated n times)
    responses: list[str]
    response_lengths: list[int]
    stats: dict[str, float]
    trajectories: list[Any]  # envs.agent_loop.Trajectory, one per row

    def for_followers(self) -> "Rollouts":
        """What the other ranks need: the batch and the stats. The trajectories (every turn, tool
        call and observation), prompts and texts are the leader's alone (it scores, logs and
        stores them), so they are not pickled and broadcast every step."""
        return Rollouts(self.batch, [], [], [], self.stats, [])

    @staticmethod
    def of_rows(parts: list[tuple["Rollouts", list[int]]], n: int) -> "Rollouts":
        """The given rows of one or more rollouts, in order, as one (the batch is built once)."""
        picked = [(part, row) for part, rows in parts for row in rows]
        trajectories = [part.trajectories[r] for part, r in picked]
        stats = {k: float(np.mean([part.stats[k] for part, _ in parts])) for k in parts[0][0].stats}
        return Rollouts(_batch_from_trajectories(trajectories, n), [part.records[r] for part, r in picked],
                        [part.responses[r] for part, r in picked], [part.response_lengths[r] for part, r in picked],
                        stats, trajectories)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class Trainer:
    def __init__(self, cfg, hf_dir: str) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.hf_dir = str(hf_dir)
        self.preset, implied = apply_preset(cfg)
        self.arch = load_arch(hf_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.output = Path(cfg.trainer.output_dir)
        self.is_leader = dist.get_rank() == 0
        if implied and self.is_leader:
            print(f"rlf-train: {cfg.trainer.algorithm} implies {', '.join(implied)}")
        build = BuildOptions(params_dtype=cfg.model.params_dtype, layer_spec=cfg.model.layer_spec,
                             recompute_activations=cfg.model.recompute_activations,
                             sequence_parallel=cfg.parallel.sequence_parallel)
        total = cfg.trainer.total_steps * cfg.actor.ppo_epochs
        # Log-probs of the distribution the rollout samples from (rollout.temperature 0 = greedy
        # sampling, which RL cannot learn from; its log-probs are taken at 1).
        temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.actor = Actor(cfg.actor, self.arch, hf_dir, build, total, norm_length=cfg.rollout.max_response_tokens,
                           temperature=temperature)
        self.reference = (PolicyModel(self.arch, hf_dir, build, cfg.actor.max_tokens_per_microbatch,
                                      fused_logprob=cfg.actor.use_fused_logprob, temperature=temperature)
                          if cfg.actor.kl_loss_coef > 0 else None)
        self.critic = (Critic(cfg.critic, cfg.actor, self.arch, hf_dir, build, total)
                       if self.preset.use_critic or cfg.critic.enable else None)
        self.records, self.val_records = self._load_records()
        if cfg.trainer.sft_steps > 0 and not any(r.demonstration for r in self.records):
            raise ValueError(f"trainer.sft_steps={cfg.trainer.sft_steps} needs demonstrations: give "
                             f"trainer.data_path rows a 'demonstration' column, or set trainer.sft_steps=0")
        self.sampler = PromptSampler(len(self.records), cfg.trainer.seed)
        self.step_index = 0
        self.engine = self.tool_pool = self.reward_pool = self.transport = self.logger = None
        self.rollout_store = self.artifacts = None
        self.tool_schemas: list[dict] | None = None
        if self.is_leader:
            self._start_leader_services()

    # ------------------------------------------------------------------ set-up
    def _load_records(self) -> tuple[list[PromptRecord], list[PromptRecord]]:
        """Training prompts and held-out validation prompts (never trained on)."""
        cfg = self.cfg.trainer
        if cfg.data_path:
            records = load_prompts(cfg.data_path)
            if cfg.val_data_path:
                return records, load_prompts(cfg.val_data_path)[: cfg.val_prompts]
            held = min(cfg.val_prompts, len(records) // 2)
            return records[: len(records) - held], records[len(records) - held:]
        task = TASKS.get(cfg.task)
        train = task.records(512, cfg.seed)
        seen = {json.dumps(r.messages) for r in train}
        fresh = [r for r in task.records(2 * cfg.val_prompts + 64, cfg.seed + 1) if json.dumps(r.messages) not in seen]
        return train, fresh[: cfg.val_prompts]

    def _start_leader_services(self) -> None:
        from rlfactory_megatron.envs.tool_manager import get_tool_manager
        from rlfactory_megatron.rewards import RewardFnSpec
        from rlfactory_megatron.rewards.pool import RewardPool
        from rlfactory_megatron.rollout.async_engine import AsyncBatchingEngine
        from rlfactory_megatron.rollout.engines import VLLMEngine
        from rlfactory_megatron.rollout.weight_sync import InProcessTransport

        cfg = self.cfg
        self.engine = VLLMEngine(self.hf_dir, dtype=cfg.model.params_dtype, tensor_parallel_size=cfg.rollout.tp,
                                 max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens,
                                 memory_utilization=cfg.rollout.gpu_memory_utilization, seed=cfg.trainer.seed)
        self.async_engine = AsyncBatchingEngine(self.engine)
        self.transport = InProcessTransport(self.engine)
        self.manager = get_tool_manager(cfg.tools.format, self.tokenizer)
        if cfg.cache.enable:
            self._open_cache()
        self._start_ray()
        if cfg.tools.enable:
            self._start_tool_pool()
        self.reward_pool = RewardPool(cfg.reward.manager, RewardFnSpec.from_config(cfg.reward),
                                      manager_options=dict(cfg.reward.manager_options),
                                      num_workers=cfg.reward.num_workers, sample_timeout_s=cfg.reward.timeout_s)
        self.logger = MetricsLogger(self.output, cfg.trainer.total_steps, cfg.logging.jsonl, cfg.logging.tensorboard,
                                    cfg.logging.wandb_project)

    def _start_ray(self) -> None:
        import os

        import ray

        if not ray.is_initialized():
            # One Ray per job: the sbatch script's (RAY_ADDRESS), else a local one started here,
            # with enough logical CPUs for every tool and reward actor to be scheduled at once.
            address = os.environ.get("RAY_ADDRESS")
            needed = self.cfg.tools.num_workers + self.cfg.reward.num_workers + 1
            ray.init(address=address, num_cpus=None if address else max(needed, os.cpu_count() or 2),
                     include_dashboard=False, log_to_driver=False)

    def _open_cache(self) -> None:
        """The run's HDF5 cache (cache.dir, default <output_dir>/cache): every step's trajectories
        as trained on, and the tool artifacts the tool pool answers repeated calls from. Rank 0
        alone generates, so it writes one shard (world 1) whatever the training world is."""
        from rlfactory_megatron.envs.storage import RolloutStore, ToolArtifactCache, single_process

        root = Path(self.cfg.cache.dir or self.output / "cache")
        self.rollout_store = RolloutStore(root / "rollouts", topology=single_process())
        self.artifacts = ToolArtifactCache(root / "tool_artifacts", topology=single_process(),
                                           max_bytes=self.cfg.cache.tool_cache_max_mb << 20,
                                           ttl_s=self.cfg.cache.tool_cache_ttl_s)

    def _start_tool_pool(self) -> None:
        from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig

        cfg = self.cfg.tools
        tools = cfg.config_path or [dict(tool) for tool in TASKS.get(self.cfg.trainer.task).tools]
        pool_cfg = ToolPoolConfig.from_dict({"tools": tools, "num_actors": cfg.num_workers,
                                             "max_concurrency": cfg.max_concurrency, "call_timeout_s": cfg.call_timeout_s,
                                             "channel": cfg.channel})
        self.tool_pool = ToolPool(pool_cfg, self.artifacts)
        self._loop = asyncio.new_event_loop()
        self.tool_schemas = self._loop.run_until_complete(self.tool_pool.start())

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        rollouts, reward = self._generate() if self.is_leader else (None, None)
        shared = _broadcast(rollouts.for_followers() if self.is_leader else None)
        rollouts = rollouts if self.is_leader else shared
        timings["time/generate_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        future = None
        if self.is_leader and reward is None:
            future = self.reward_pool.submit(self._reward_samples(rollouts))  # scored while log-probs run
        batch = rollouts.batch
        old = None
        if not self.actor.updates_on_policy(batch.batch_size):  # on-policy: the update's own forward gives them
            old = self.actor.compute_log_probs(batch, with_entropy=True)
            batch = batch.with_fields(old_log_probs=old["log_probs"])
        if self.reference is not None:
            batch = batch.with_fields(ref_log_probs=self.reference.compute_log_probs(batch)["log_probs"])
        if self.critic is not None:
            batch = batch.with_fields(values=self.critic.compute_values(batch))
        timings["time/logprob_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        reward = _broadcast((reward or future.result()) if self.is_leader else None)
        timings["time/reward_wait_s"] = time.perf_counter() - clock
        token_rewards = _place_on_last_token(reward.scores, batch)
        advantages = compute_advantages(self.preset.advantage, token_rewards, batch.loss_mask,
                                        values=batch.values, group_index=batch.group_ids)
        batch = batch.with_fields(token_rewards=token_rewards, advantages=advantages.advantages,
                                  returns=advantages.returns)
        if self.rollout_store is not None:
            self._record_step(rollouts, batch, reward)

        clock = time.perf_counter()
        metrics = self.actor.update(batch)
        if self.critic is not None:
            metrics.update(self.critic.update(batch))
        self._stop_if_diverging(metrics, reward)
        timings["time/update_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        self._sync_weights()
        timings["time/sync_s"] = time.perf_counter() - clock

        self.step_index += 1
        tokens = float(batch.lengths.sum())
        step_time = sum(timings.values())
        metrics.update(timings)
        metrics.update(reward.metrics())
        metrics.update(rollouts.stats)
        mask = batch.loss_mask > 0
        if old is not None:
            metrics["actor/entropy_old"] = float(old["entropy"][mask].mean()) if mask.any() else 0.0
            if self.is_leader:  # the trajectories (with the engine's log-probs) stay on the leader
                metrics.update(_rollout_logprob_gap(rollouts.trajectories, old["log_probs"], mask))
        else:  # the entropy of the same policy, from the update's forward pass
            metrics["actor/entropy_old"] = metrics["actor/entropy"]
        metrics["perf/tokens_per_s"] = tokens / max(step_time, 1e-9)
        metrics["perf/step_s"] = step_time
        return metrics

    def _stop_if_diverging(self, metrics: dict[str, float], reward) -> None:
        """Raise once trainer.max_skipped_updates optimizer steps in a row were skipped for
        non-finite numbers (each skip applied nothing): the run would otherwise go on untrained."""
        from rlfactory_megatron.actor.engine import NonFiniteError

        limit = self.cfg.trainer.max_skipped_updates
        for name, model in (("actor", self.actor), ("critic", self.critic)):
            if model is not None and model.engine.skipped_in_a_row >= limit:
                shown = {k: metrics[k] for k in (f"{name}/pg_loss", f"{name}/vf_loss", f"{name}/grad_norm") if k in metrics}
                raise NonFiniteError(
                    f"{name}: the last {model.engine.skipped_in_a_row} optimizer steps had a non-finite loss or "
                    f"gradient and were skipped ({', '.join(f'{k}={v:g}' for k, v in shown.items())}; this step's "
                    f"rewards {'are all finite' if np.isfinite(reward.scores).all() else 'hold non-finite values'}); "
                    f"lower actor.optim.lr or raise trainer.max_skipped_updates={limit}")

    def _sync_weights(self) -> None:
        """The actor's weights into the engine, once they are known to be finite."""
        from rlfactory_megatron.rollout.weight_sync import sync_weights

        self.actor.engine.check_finite("the weight sync")
        sync_weights(self.actor.engine, self.transport, self.cfg.weight_sync.bucket_mb)

    def _generate(self):
        """Rank 0: this step's rollouts, and None for their rewards (scored later, overlapped).

        With dynamic sampling (DAPO) the rewards are needed first: groups whose samples all scored
        the same have zero advantage and teach nothing, so they are dropped and further prompts
        rolled out (at most trainer.max_refill_rounds more times) until prompts_per_step groups
        are informative; the step then trains on those."""
        wanted, n = self.cfg.trainer.prompts_per_step, self.cfg.rollout.n
        rollouts = self._rollout([self.records[i] for i in self.sampler.next(wanted)])
        if not self.preset.drop_uniform_groups:
            return rollouts, None
        kept: list[tuple[Rollouts, list[int]]] = []
        kept_rewards: list[tuple[Any, list[int]]] = []
        groups = seen = rounds = 0
        while True:
            reward = self.reward_pool.submit(self._reward_samples(rollouts)).result()
            scores = np.asarray(reward.scores).reshape(-1, n)
            seen += len(scores)
            informative = [g for g in range(len(scores)) if np.ptp(scores[g]) > 0][: wanted - groups]
            if informative:
                rows = [g * n + k for g in informative for k in range(n)]
                kept.append((rollouts, rows))
                kept_rewards.append((reward, rows))
                groups += len(informative)
            if groups >= wanted or rounds >= self.cfg.trainer.max_refill_rounds:
                break
            rounds += 1
            extra = [self.records[i] for i in self.sampler.next(wanted)]
            rollouts = self._rollout(extra, first_row=seen * n)
        if not kept:  # nothing informative at all: train on the last draw (zero advantages)
            everything = list(range(len(rollouts.trajectories)))
            kept, kept_rewards = [(rollouts, everything)], [(reward, everything)]
        final = Rollouts.of_rows(kept, n)
        final.stats.update({"rollout/groups_kept": float(groups), "rollout/groups_seen": float(seen),
                            "rollout/refill_rounds": float(rounds)})
        return final, _reward_rows(kept_rewards)  # the scores already computed, not scored again

    def _rollout(self, records: list[PromptRecord], greedy: bool = False, first_row: int = 0) -> Rollouts:
        """Rank 0: n agent-loop trajectories per prompt, one coroutine each. `first_row` numbers
        the rows for their sampling seeds (refills must not repeat a step's earlier samples)."""
        from rlfactory_megatron.envs.agent_loop import AgentLoopConfig, run_agent_loop

        cfg = self.cfg
        n = 1 if greedy else cfg.rollout.n
        loop_cfg = AgentLoopConfig(max_turns=cfg.tools.max_turns if cfg.tools.enable else 1,
                                   max_response_tokens=cfg.rollout.max_response_tokens,
                                   tool_response_max_tokens=cfg.tools.tool_response_max_tokens)
        sampling = {"temperature": 0.0 if greedy else cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "top_k": cfg.rollout.top_k, "max_tokens": cfg.rollout.max_response_tokens,
                    "stop": list(cfg.rollout.stop), "stop_token_ids": self._stop_token_ids()}
        prompts = [self.manager.render_prompt(r.messages, self.tool_schemas)[-cfg.rollout.max_prompt_tokens:] for r in records]
        run_tool = self.tool_pool.call if self.tool_pool is not None else None

        async def all_samples():
            jobs = [run_agent_loop(p, self.async_engine, self.manager, run_tool,
                                   sampling if greedy else {**sampling, "seed": self._sample_seed(first_row + i * n + k)}, loop_cfg)
                    for i, p in enumerate(prompts) for k in range(n)]
            return await asyncio.gather(*jobs)

        loop = getattr(self, "_loop", None) or asyncio.new_event_loop()
        self._loop = loop
        trajectories = loop.run_until_complete(all_samples())
        rows = [records[i // n] for i in range(len(trajectories))]
        batch = _batch_from_trajectories(trajectories, n)
        responses = [self.tokenizer.decode([t for t, m in zip(tr.response_ids, tr.loss_mask) if m])
                     for tr in trajectories]
        calls = sum(len(turn.tool_calls) for tr in trajectories for turn in tr.turns)
        stats = {"rollout/response_tokens_mean": float(np.mean([len(t.response_ids) for t in trajectories])),
                 "rollout/turns_mean": float(np.mean([len(t.turns) for t in trajectories])),
                 "rollout/tool_calls_per_sample": calls / len(trajectories)}
        return Rollouts(batch, rows, responses, [len(t.response_ids) for t in trajectories], stats,
                        list(trajectories))

    def _record_step(self, rollouts: Rollouts, batch: RolloutBatch, reward) -> None:
        """Rank 0: this step's trajectories as trained on into the rollout store (one flushed
        batch), then the artifact cache's step-boundary sync."""
        from rlfactory_megatron.envs.storage import RolloutRecord

        step, records = self.step_index + 1, []
        for row, (traj, record) in enumerate(zip(rollouts.trajectories, rollouts.records)):
            start, count = len(traj.prompt_ids), len(traj.response_ids)
            calls = [{"turn": t, "name": c.name, "arguments": c.arguments, "observation": c.observation,
                      "is_error": c.is_error, "latency_s": c.latency_s}
                     for t, turn in enumerate(traj.turns) for c in turn.tool_calls]
            records.append(RolloutRecord(
                step, f"{row:05d}", np.asarray(traj.prompt_ids), np.asarray(traj.response_ids),
                np.asarray(traj.loss_mask), np.asarray(traj.logprobs),
                batch.advantages[row, start:start + count].numpy(), float(reward.scores[row]), calls,
                {"data_source": record.data_source, "ground_truth": str(record.ground_truth),
                 "group": row // self.cfg.rollout.n, "stop_reason": traj.stop_reason, "turns": len(traj.turns),
                 "reward_error": reward.errors[row]}))
        self.rollout_store.write(records)
        if self.artifacts is not None:
            self.artifacts.sync()

    def _sample_seed(self, row: int) -> int:
        """The sampling seed of one trajectory, from (run seed, step, row): a resumed run draws the
        same samples as an uninterrupted one, however requests are batched."""
        return int(np.random.SeedSequence([self.cfg.trainer.seed, self.step_index, row]).generate_state(1)[0] >> 1)

    def _stop_token_ids(self) -> list[int]:
        # The engine has no tokenizer and so no EOS: end-of-turn tokens must be given explicitly.
        ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        return ids

    def _reward_samples(self, rollouts: Rollouts):
        from rlfactory_megatron.rewards import RewardSample

        return [RewardSample(r.data_source, text, r.ground_truth, response_length=n)
                for r, text, n in zip(rollouts.records, rollouts.responses, rollouts.response_lengths)]

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, float]:
        self._maybe_resume()
        if self.cfg.trainer.sft_steps > 0 and self.step_index == 0:
            self.sft_warm_start()
        if self.cfg.trainer.val_every and self.step_index == 0:
            before = self.validate()  # the baseline the run's validation curve starts from
            if self.is_leader:
                self.logger.log(0, before, progress=False)
                print(f"rlf-train: validation before RL: score {before['val/score_mean']:.3f} "
                      f"on {len(self.val_records)} held-out prompts", flush=True)
        last: dict[str, float] = {}
        while self.step_index < self.cfg.trainer.total_steps:
            last = self.step()
            if self.cfg.trainer.val_every and self.step_index % self.cfg.trainer.val_every == 0:
                last.update(self.validate())
            if self.is_leader:
                self.logger.log(self.step_index, last)
            if self.cfg.trainer.save_every and self.step_index % self.cfg.trainer.save_every == 0:
                self.save_checkpoint()
        return last

    def validate(self) -> dict[str, float]:
        """Greedy rollouts on held-out prompts; mean score = accuracy for 0/1 scorers."""
        records = self.val_records
        rollouts = self._rollout(records, greedy=True) if self.is_leader else None
        if not self.is_leader:
            return {}
        result = self.reward_pool.submit(self._reward_samples(rollouts)).result()
        return {"val/score_mean": float(np.mean(result.scores))}

    def sft_warm_start(self) -> None:
        """Supervised steps on the prompts' demonstrations (loss on the assistant's tokens only) at
        the constant trainer.sft_lr, each on a fresh seeded draw of trainer.sft_batch_size prompts."""
        cfg = self.cfg.trainer
        rows = _broadcast(self._demonstration_rows() if self.is_leader else None)
        rng = random.Random(cfg.seed)
        start = time.perf_counter()
        with self.actor.engine.fixed_lr(cfg.sft_lr):
            for done in range(1, cfg.sft_steps + 1):
                ids, masks = zip(*(rows[rng.randrange(len(rows))] for _ in range(cfg.sft_batch_size)))
                metrics = self.actor.sft_update(_pad_rows(list(ids), list(masks)))
                if self.is_leader and (done % 10 == 0 or done == cfg.sft_steps):
                    elapsed = time.perf_counter() - start
                    print(f"sft {done}/{cfg.sft_steps} | loss {metrics['sft/loss']:.3f} | {done / elapsed:.2f} steps/s "
                          f"| ETA {int(elapsed / done * (cfg.sft_steps - done))}s", flush=True)
        if self.is_leader:
            print(f"rlf-train: SFT warm-start done ({cfg.sft_steps} steps, loss {metrics['sft/loss']:.3f})")
        self._sync_weights()

    def _demonstration_rows(self) -> list[tuple[list[int], list[int]]]:
        """Rank 0: prompt + demonstration tokens of every record that has one, mask 1 on the
        assistant's tokens only (tool responses are rendered as the agent loop renders them)."""
        eot = self.tokenizer.eos_token or ""
        rows = []
        for record in self.records:
            if not record.demonstration:
                continue
            ids = self.manager.render_prompt(record.messages, self.tool_schemas)
            ids = ids[-self.cfg.rollout.max_prompt_tokens:]
            mask = [0] * len(ids)
            for turn in record.demonstration:
                if turn["role"] == "tool":
                    piece, trained = self.manager.render_observation([turn["content"]]), 0
                else:
                    piece, trained = self.tokenizer.encode(turn["content"] + eot, add_special_tokens=False), 1
                ids += piece
                mask += [trained] * len(piece)
            rows.append((ids, mask))
        return rows

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        directory = self.output / "checkpoints" / f"step_{self.step_index:06d}"
        self.actor.engine.check_finite("the checkpoint")
        self.actor.engine.save(directory / "actor")
        if self.critic is not None:
            self.critic.engine.save(directory / "critic")
        if self.is_leader:
            state = {"step": self.step_index, "sampler": self.sampler.state_dict()}
            (directory / STATE_FILE).write_text(json.dumps(state))
            kept = sorted((self.output / "checkpoints").glob("step_*"))
            for old in kept[: -self.cfg.trainer.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return directory

    def _maybe_resume(self) -> None:
        choice = self.cfg.trainer.resume
        if choice == "never":
            return
        if choice == "auto":
            done = [d for d in sorted((self.output / "checkpoints").glob("step_*")) if (d / STATE_FILE).is_file()]
            if not done:
                return
            directory = done[-1]
        else:
            directory = Path(choice)
            if not (directory / STATE_FILE).is_file():
                raise ValueError(f"trainer.resume='{choice}' is not a checkpoint folder (no {STATE_FILE})")
        state = json.loads((directory / STATE_FILE).read_text())
        self.actor.engine.load(directory / "actor")
        if self.critic is not None:
            self.critic.engine.load(directory / "critic")
        self.step_index = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self._sync_weights()
        if self.is_leader:
            self.logger.rewind(self.step_index)
            print(f"rlf-train: resumed from {directory} at step {self.step_index}")

    def close(self) -> None:
        if self.is_leader:
            if getattr(self, "_loop", None) is not None:
                self._loop.run_until_complete(self.async_engine.close())  # its batching task ends with the loop
            if self.tool_pool is not None:
                self._loop.run_until_complete(self.tool_pool.close())
            self.reward_pool.shutdown()
            self.engine.close()
            self.logger.close()
            for store in (self.rollout_store, self.artifacts):
                if store is not None:
                    store.close()


def _reward_rows(parts):
    """The given rows of one or more RewardResults, in order, as one."""
    from rlfactory_megatron.rewards.records import RewardResult

    picked = [(result, row) for result, rows in parts for row in rows]
    return RewardResult([r.scores[i] for r, i in picked], [r.response_lengths[i] for r, i in picked],
                        [r.extras[i] for r, i in picked], [r.errors[i] for r, i in picked])


def _pad_rows(ids_list: list[list[int]], masks: list[list[int]], group_size: int = 1) -> RolloutBatch:
    width = max(len(ids) for ids in ids_list)
    ids = torch.zeros(len(ids_list), width, dtype=torch.long)
    mask = torch.zeros(len(ids_list), width)
    for row, (seq, m) in enumerate(zip(ids_list, masks)):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(m)] = torch.tensor(m, dtype=torch.float32)
    lengths = torch.tensor([len(seq) for seq in ids_list])
    groups = torch.arange(len(ids_list)) // group_size
    return RolloutBatch(ids, lengths, mask, group_ids=groups)


def _batch_from_trajectories(trajectories, group_size: int) -> RolloutBatch:
    ids = [t.prompt_ids + t.response_ids for t in trajectories]
    masks = [[0] * len(t.prompt_ids) + list(t.loss_mask) for t in trajectories]
    return _pad_rows(ids, masks, group_size)


def _rollout_logprob_gap(trajectories, trainer_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs of the sampled tokens are from the trainer's on the
    same weights: ~0 when the weights synced and the token alignment holds; a gap that grows
    means the engine samples from another policy than the one trained (off-policy drift)."""
    rollout = torch.zeros_like(trainer_log_probs)
    for row, traj in enumerate(trajectories):
        start = len(traj.prompt_ids)
        rollout[row, start:start + len(traj.logprobs)] = torch.tensor(traj.logprobs, dtype=rollout.dtype)
    if not mask.any():
        return {}
    gap = (trainer_log_probs - rollout).abs()[mask]
    return {"rollout/logprob_gap_mean": float(gap.mean()), "rollout/logprob_gap_max": float(gap.max())}


def _place_on_last_token(scores: list[float], batch: RolloutBatch) -> torch.Tensor:
    """Sequence scores -> [B, T] rewards on each row's last trained token (0 elsewhere)."""
    rewards = torch.zeros(batch.input_ids.shape)
    for row, score in enumerate(scores):
        trained = torch.nonzero(batch.loss_mask[row] > 0)
        if len(trained):
            rewards[row, int(trained[-1])] = float(score)
    return rewards
