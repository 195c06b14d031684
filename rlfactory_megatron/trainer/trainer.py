"""One RL run, readable top to bottom: `Trainer.fit()` repeats `step()`:

rollout (agent loop on vLLM, tools in Ray) -> rewards (Ray pool, overlapped with log-probs)
-> old/ref log-probs, values -> advantages -> actor (+ critic) update -> weight sync -> log,
validate and checkpoint. Every rank runs this; rank 0 owns the engine, the tool pool and the
reward pool and broadcasts what it produces.
"""
from __future__ import annotations

import asyncio
import json
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
from rlfactory_megatron.trainer.presets import ALGORITHM_PRESETS
from rlfactory_megatron.trainer.tasks import BUILTIN_TASKS, calculator_demonstration

STATE_FILE = "trainer_state.json"


@dataclass
class Rollouts:
    """What rank 0 produced in one rollout phase, broadcast to every rank."""

    batch: RolloutBatch
    records: list[PromptRecord]  # one per row (a prompt repeated n times)
    responses: list[str]
    response_lengths: list[int]
    stats: dict[str, float]


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
        self.preset = ALGORITHM_PRESETS[cfg.trainer.algorithm]
        self.arch = load_arch(hf_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.output = Path(cfg.trainer.output_dir)
        self.is_leader = dist.get_rank() == 0
        build = BuildOptions(params_dtype=cfg.model.params_dtype, layer_spec=cfg.model.layer_spec,
                             recompute_activations=cfg.model.recompute_activations,
                             sequence_parallel=cfg.parallel.sequence_parallel)
        cfg.actor.policy_loss = self.preset.policy_loss
        total = cfg.trainer.total_steps * cfg.actor.ppo_epochs
        self.actor = Actor(cfg.actor, self.arch, hf_dir, build, total, norm_length=cfg.rollout.max_response_tokens)
        self.reference = (PolicyModel(self.arch, hf_dir, build, cfg.actor.max_tokens_per_microbatch,
                                      fused_logprob=cfg.actor.use_fused_logprob)
                          if cfg.actor.kl_loss_coef > 0 else None)
        self.critic = (Critic(cfg.critic, cfg.actor, self.arch, hf_dir, build, total)
                       if self.preset.use_critic or cfg.critic.enable else None)
        self.records = self._load_records()
        self.sampler = PromptSampler(len(self.records), cfg.trainer.seed)
        self.step_index = 0
        self.engine = self.tool_pool = self.reward_pool = self.transport = self.logger = None
        if self.is_leader:
            self._start_leader_services()

    # ------------------------------------------------------------------ set-up
    def _load_records(self) -> list[PromptRecord]:
        if self.cfg.trainer.data_path:
            return load_prompts(self.cfg.trainer.data_path)
        return BUILTIN_TASKS["calculator_arithmetic"](512, self.cfg.trainer.seed)

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

    def _start_tool_pool(self) -> None:
        from rlfactory_megatron.envs.tool_pool import ToolPool, ToolPoolConfig

        cfg = self.cfg.tools
        tools = cfg.config_path or [{"class": "calculator"}]
        pool_cfg = ToolPoolConfig.from_dict({"tools": tools, "num_actors": cfg.num_workers,
                                             "max_concurrency": cfg.max_concurrency, "call_timeout_s": cfg.call_timeout_s})
        self.tool_pool = ToolPool(pool_cfg)
        self._loop = asyncio.new_event_loop()
        self.tool_schemas = self._loop.run_until_complete(self.tool_pool.start())

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        indices = self.sampler.next(self.cfg.trainer.prompts_per_step)
        rollouts = _broadcast(self._rollout([self.records[i] for i in indices]) if self.is_leader else None)
        timings["time/generate_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        future = self.reward_pool.submit(self._reward_samples(rollouts)) if self.is_leader else None
        batch = rollouts.batch
        old = self.actor.compute_log_probs(batch, with_entropy=True)
        batch = batch.with_fields(old_log_probs=old["log_probs"])
        if self.reference is not None:
            batch = batch.with_fields(ref_log_probs=self.reference.compute_log_probs(batch)["log_probs"])
        if self.critic is not None:
            batch = batch.with_fields(values=self.critic.compute_values(batch))
        timings["time/logprob_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        reward = _broadcast(future.result() if self.is_leader else None)  # computed while log-probs ran
        timings["time/reward_wait_s"] = time.perf_counter() - clock
        token_rewards = _place_on_last_token(reward.scores, batch)
        advantages = compute_advantages(self.preset.advantage, token_rewards, batch.loss_mask,
                                        values=batch.values, group_index=batch.group_ids)
        batch = batch.with_fields(token_rewards=token_rewards, advantages=advantages.advantages,
                                  returns=advantages.returns)

        clock = time.perf_counter()
        metrics = self.actor.update(batch)
        if self.critic is not None:
            metrics.update(self.critic.update(batch))
        timings["time/update_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        from rlfactory_megatron.rollout.weight_sync import sync_weights

        sync_weights(self.actor.engine, self.transport, self.cfg.weight_sync.bucket_mb)
        timings["time/sync_s"] = time.perf_counter() - clock

        self.step_index += 1
        tokens = float(batch.lengths.sum())
        step_time = sum(timings.values())
        metrics.update(timings)
        metrics.update(reward.metrics())
        metrics.update(rollouts.stats)
        mask = batch.loss_mask > 0
        metrics["actor/entropy_old"] = float(old["entropy"][mask].mean()) if mask.any() else 0.0
        metrics["perf/tokens_per_s"] = tokens / max(step_time, 1e-9)
        metrics["perf/step_s"] = step_time
        return metrics

    def _rollout(self, records: list[PromptRecord], greedy: bool = False) -> Rollouts:
        """Rank 0: n agent-loop trajectories per prompt, one coroutine each."""
        from rlfactory_megatron.envs.agent_loop import AgentLoopConfig, run_agent_loop

        cfg = self.cfg
        n = 1 if greedy else cfg.rollout.n
        loop_cfg = AgentLoopConfig(max_turns=cfg.tools.max_turns if cfg.tools.enable else 1,
                                   max_response_tokens=cfg.rollout.max_response_tokens,
                                   tool_response_max_tokens=cfg.tools.tool_response_max_tokens)
        sampling = {"temperature": 0.0 if greedy else cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "top_k": cfg.rollout.top_k, "max_tokens": cfg.rollout.max_response_tokens,
                    "stop": list(cfg.rollout.stop), "stop_token_ids": self._stop_token_ids()}
        tools = self.tool_schemas if cfg.tools.enable else None
        prompts = [self.manager.render_prompt(r.messages, tools)[-cfg.rollout.max_prompt_tokens:] for r in records]
        run_tool = self.tool_pool.call if self.tool_pool is not None else None

        async def all_samples():
            jobs = [run_agent_loop(p, self.async_engine, self.manager, run_tool, sampling, loop_cfg)
                    for p in prompts for _ in range(n)]
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
        return Rollouts(batch, rows, responses, [len(t.response_ids) for t in trajectories], stats)

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
        records = self.records[: self.cfg.trainer.val_prompts]
        rollouts = self._rollout(records, greedy=True) if self.is_leader else None
        if not self.is_leader:
            return {}
        result = self.reward_pool.submit(self._reward_samples(rollouts)).result()
        return {"val/score_mean": float(np.mean(result.scores))}

    def sft_warm_start(self) -> None:
        """Supervised steps on the task's demonstrations (loss on assistant tokens only)."""
        from rlfactory_megatron.actor.batch import RolloutBatch

        rows = self.records[: self.cfg.trainer.prompts_per_step * self.cfg.rollout.n]
        ids_list, masks = [], []
        for record in rows:
            prompt = self.manager.render_prompt(record.messages, getattr(self, "tool_schemas", None)) \
                if self.is_leader else None
            ids, mask = _demonstration_tokens(self, record, prompt)
            ids_list.append(ids)
            masks.append(mask)
        ids_list, masks = _broadcast((ids_list, masks))
        batch = _pad_rows(ids_list, masks)
        total, start = self.cfg.trainer.sft_steps, time.perf_counter()
        for done in range(1, total + 1):
            metrics = self.actor.sft_update(batch)
            if self.is_leader and (done % 10 == 0 or done == total):
                elapsed = time.perf_counter() - start
                print(f"sft {done}/{total} | loss {metrics['sft/loss']:.3f} | {done / elapsed:.2f} steps/s "
                      f"| ETA {int(elapsed / done * (total - done))}s", flush=True)
        if self.is_leader:
            print(f"rlf-train: SFT warm-start done ({total} steps, loss {metrics['sft/loss']:.3f})")
        from rlfactory_megatron.rollout.weight_sync import sync_weights

        sync_weights(self.actor.engine, self.transport, self.cfg.weight_sync.bucket_mb)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        directory = self.output / "checkpoints" / f"step_{self.step_index:06d}"
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
        from rlfactory_megatron.rollout.weight_sync import sync_weights

        sync_weights(self.actor.engine, self.transport, self.cfg.weight_sync.bucket_mb)
        if self.is_leader:
            print(f"rlf-train: resumed from {directory} at step {self.step_index}")

    def close(self) -> None:
        if self.is_leader:
            if self.tool_pool is not None:
                self._loop.run_until_complete(self.tool_pool.close())
            self.reward_pool.shutdown()
            self.engine.close()
            self.logger.close()


def _demonstration_tokens(trainer: Trainer, record: PromptRecord, prompt: list[int] | None):
    """Prompt + demonstration turns as tokens, mask 1 on the assistant's tokens only (rank 0 only)."""
    if prompt is None:
        return None, None
    ids, mask = list(prompt), [0] * len(prompt)
    for turn in calculator_demonstration(record):
        if turn["role"] == "tool":
            piece = trainer.manager.render_observation([turn["content"]])
            ids += piece
            mask += [0] * len(piece)
        else:
            eot = trainer.tokenizer.eos_token or ""
            piece = trainer.tokenizer.encode(turn["content"] + eot, add_special_tokens=False)
            ids += piece
            mask += [1] * len(piece)
    return ids, mask


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


def _place_on_last_token(scores: list[float], batch: RolloutBatch) -> torch.Tensor:
    """Sequence scores -> [B, T] rewards on each row's last trained token (0 elsewhere)."""
    rewards = torch.zeros(batch.input_ids.shape)
    for row, score in enumerate(scores):
        trained = torch.nonzero(batch.loss_mask[row] > 0)
        if len(trained):
            rewards[row, int(trained[-1])] = float(score)
    return rewards
