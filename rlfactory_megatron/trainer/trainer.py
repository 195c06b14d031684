"""One RL run, readable top to bottom: `Trainer.fit()` repeats `step()`:

rollout on every engine (agent loop on vLLM, tools in Ray) -> rewards (each engine's process
scores its rows, overlapped with log-probs) -> old/ref log-probs, values -> advantages -> actor
(+ critic) update -> weight sync to every engine -> log, validate and checkpoint. Every rank
runs this; the rollout side (engines, their placement, the split of prompts and the gather of
rows) is `RolloutPlane` in rollouts.py.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

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
from rlfactory_megatron.trainer.rollouts import RolloutPlane, Rollouts, pad_rows
from rlfactory_megatron.trainer.tasks import TASKS

STATE_FILE = "trainer_state.json"


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
        self.logger = None
        self.plane = RolloutPlane(cfg, self.hf_dir, self.tokenizer, self.output)
        if self.is_leader:
            self.logger = MetricsLogger(self.output, cfg.trainer.total_steps, cfg.logging.jsonl,
                                        cfg.logging.tensorboard, cfg.logging.wandb_project)

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

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        rollouts = self._generate()
        self.plane.sleep()  # the engines' device memory goes to training until the next sync
        batch = rollouts.batch
        timings["time/generate_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
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
        reward = self.plane.rewards(rollouts)  # scored while the log-probs ran
        timings["time/reward_wait_s"] = time.perf_counter() - clock
        token_rewards = _place_on_last_token(reward.scores, batch)
        advantages = compute_advantages(self.preset.advantage, token_rewards, batch.loss_mask,
                                        values=batch.values, group_index=batch.group_ids)
        batch = batch.with_fields(token_rewards=token_rewards, advantages=advantages.advantages,
                                  returns=advantages.returns)
        self.plane.record(rollouts, batch, self.step_index + 1)

        clock = time.perf_counter()
        metrics = self.actor.update(batch)
        if self.critic is not None:
            metrics.update(self.critic.update(batch))
        self._stop_if_diverging(metrics, reward)
        timings["time/update_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        self.step_index += 1
        self._sync_weights()
        timings["time/sync_s"] = time.perf_counter() - clock

        tokens = float(batch.lengths.sum())
        step_time = sum(timings.values())
        metrics.update(timings)
        metrics.update(reward.metrics())
        metrics.update(rollouts.stats())
        mask = batch.loss_mask > 0
        if old is not None:
            metrics["actor/entropy_old"] = float(old["entropy"][mask].mean()) if mask.any() else 0.0
            metrics.update(_rollout_logprob_gap(rollouts.engine_log_probs(batch.input_ids.shape), old["log_probs"], mask))
        else:  # the entropy of the same policy, from the update's own forward pass
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
        """The actor's weights into every engine, once they are known to be finite; each engine
        then reports serving version `step_index`."""
        self.actor.engine.check_finite("the weight sync")
        self.plane.wake_up()
        self.plane.sync(self.actor.engine, self.step_index)

    def _generate(self) -> Rollouts:
        """This step's rollouts on every engine; their rewards are gathered later (overlapped).

        With dynamic sampling (DAPO) the rewards are needed first: groups whose samples all scored
        the same have zero advantage and teach nothing, so they are dropped and further prompts
        rolled out (at most trainer.max_refill_rounds more times) until prompts_per_step groups
        are informative; the step then trains on those."""
        wanted, n = self.cfg.trainer.prompts_per_step, self.cfg.rollout.n
        step = self.step_index
        rollouts = self.plane.rollout([self.records[i] for i in self.sampler.next(wanted)], step)
        if not self.preset.drop_uniform_groups:
            return rollouts
        kept: list[tuple[Rollouts, list[int]]] = []
        groups = seen = rounds = 0
        while True:
            scores = np.asarray(self.plane.rewards(rollouts).scores).reshape(-1, n)  # the same on every rank
            seen += len(scores)
            informative = [g for g in range(len(scores)) if np.ptp(scores[g]) > 0][: wanted - groups]
            if informative:
                kept.append((rollouts, [g * n + k for g in informative for k in range(n)]))
                groups += len(informative)
            if groups >= wanted or rounds >= self.cfg.trainer.max_refill_rounds:
                break
            rounds += 1
            extra = [self.records[i] for i in self.sampler.next(wanted)]
            rollouts = self.plane.rollout(extra, step, first_row=seen * n)
        if not kept:  # nothing informative at all: train on the last draw (zero advantages)
            kept = [(rollouts, list(range(len(rollouts.rows))))]
        final = Rollouts.of_rows(kept)  # with the rewards already computed, not scored again
        final.extra_stats.update({"rollout/groups_kept": float(groups), "rollout/groups_seen": float(seen),
                                  "rollout/refill_rounds": float(rounds)})
        return final

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
        """Greedy rollouts on held-out prompts, on every engine; mean score = accuracy for 0/1 scorers."""
        rollouts = self.plane.rollout(self.val_records, self.step_index, greedy=True)
        return {"val/score_mean": float(np.mean(self.plane.rewards(rollouts).scores))}

    def sft_warm_start(self) -> None:
        """Supervised steps on the prompts' demonstrations (loss on the assistant's tokens only) at
        the constant trainer.sft_lr, each on a fresh seeded draw of trainer.sft_batch_size prompts."""
        cfg = self.cfg.trainer
        rows = self.plane.broadcast(self._demonstration_rows() if self.is_leader else None)
        rng = random.Random(cfg.seed)
        start = time.perf_counter()
        with self.actor.engine.fixed_lr(cfg.sft_lr):
            for done in range(1, cfg.sft_steps + 1):
                ids, masks = zip(*(rows[rng.randrange(len(rows))] for _ in range(cfg.sft_batch_size)))
                metrics = self.actor.sft_update(pad_rows(list(ids), list(masks)))
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
        eot = self.plane.manager.turn_end  # as the agent loop and the chat template end a turn
        rows = []
        for record in self.records:
            if not record.demonstration:
                continue
            ids = self.plane.manager.render_prompt(record.messages, self.plane.tool_schemas)
            ids = ids[-self.cfg.rollout.max_prompt_tokens:]
            mask = [0] * len(ids)
            for turn in record.demonstration:
                if turn["role"] == "tool":
                    piece, trained = self.plane.manager.render_observation([turn["content"]]), 0
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
        self.plane.close()
        if self.logger is not None:
            self.logger.close()


def _rollout_logprob_gap(rollout: torch.Tensor, trainer_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engines' log-probs of the sampled tokens are from the trainer's on the
    same weights: ~0 when the weights synced and the token alignment holds; a gap that grows
    means the engine samples from another policy than the one trained (off-policy drift)."""
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
