"""One RL run, readable top to bottom: `Trainer.fit()` repeats `step()`:

rollout on every engine (agent loop on vLLM, tools in Ray) -> each DP rank receives the rows it
trains on -> rewards (each engine's process scores its rows, overlapped with log-probs) ->
old/ref log-probs, values -> advantages -> actor (+ critic) update -> weight sync to every
engine -> log, validate and checkpoint. Every rank runs this on its DP rank's rows; statistics
over the step (advantage whitening, group baselines, metrics) are reduced across DP ranks. The
rollout side is rollout/: the engines (`EngineFleet`: start, weight updates, replacement, sleep)
and the rows they make (`RolloutGenerator`: agent loops, rows to DP ranks, rewards, the store).
"""
from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rlfactory_megatron.actor.actor import Actor, Critic, PolicyModel
from rlfactory_megatron.actor.batch import RolloutBatch
from rlfactory_megatron.algorithms import compute_advantages
from rlfactory_megatron.algorithms.rollout_correction import correction_settings, rollout_correction
from rlfactory_megatron.models.builder import BuildOptions
from rlfactory_megatron.models.hf_arch import load_arch
from rlfactory_megatron.rollout.fleet import EngineFleet
from rlfactory_megatron.rollout.generator import RolloutGenerator
from rlfactory_megatron.rollout.pipeline import AHEAD_FILE
from rlfactory_megatron.rollout.rows import Rollouts
from rlfactory_megatron.runtime.collectives import RankCollectives
from rlfactory_megatron.runtime.stop import StopRequest
from rlfactory_megatron.trainer.data import PromptRecord, PromptSampler, run_records
from rlfactory_megatron.trainer.logger import MetricsLogger, wandb_settings
from rlfactory_megatron.trainer.presets import apply_preset, trains_critic
from rlfactory_megatron.trainer.checkpoint import checkpoint_dir, load_checkpoint, resume_directory, save_checkpoint
from rlfactory_megatron.trainer.sft import demonstration_rows, sft_warm_start
from rlfactory_megatron.trainer.tasks import run_tool_specs
from rlfactory_megatron.trainer.warm_start_cache import WarmStartCache, warm_start_key

# Validation trajectories shown as text in TensorBoard at each validation.
VALIDATION_TEXTS = 3


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
        self.critic = (Critic(cfg.critic, cfg.actor, self.arch, hf_dir, build, total,
                              norm_length=cfg.rollout.max_response_tokens)
                       if trains_critic(cfg) else None)
        # The models whose state waits in host memory while colocated engines generate
        # (actor.offload: the actor and its reference; critic.offload); the engines start with it there.
        self.offloaded = [model.engine for model, on in ((self.actor, cfg.actor.offload),
                                                         (self.reference, cfg.actor.offload),
                                                         (self.critic, cfg.critic.offload)) if model is not None and on]
        self._to_host()
        self.records, self.val_records = run_records(cfg)  # checked at load (data_checks.py)
        self.sampler = PromptSampler(len(self.records), cfg.trainer.seed)
        self.step_index = 0
        self.stopped_by: int | None = None  # the signal that stopped the run early (runtime/stop.py)
        self.logger = None
        self.collectives = RankCollectives()
        self.fleet = EngineFleet(cfg, self.hf_dir, self.output, self.collectives)
        self.generator = RolloutGenerator(cfg, self.fleet, self.collectives, self.tokenizer, self.output,
                                          run_tool_specs(cfg), self._draw, self.preset.drop_uniform_groups)
        self.correction = correction_settings(cfg.actor.rollout_correction, asynchronous=cfg.trainer.max_staleness > 0)
        if self.is_leader:
            self.logger = MetricsLogger(self.output, cfg.trainer.total_steps, cfg.logging.jsonl,
                                        cfg.logging.tensorboard, wandb_settings(cfg),
                                        progress_every=cfg.logging.log_every)

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        rows = self.generator.generate(self.step_index)  # this DP rank's rows, and only those
        self.fleet.sleep()  # the engines' device memory goes to training until the next sync
        rollouts, batch = rows.rollouts, rows.batch
        timings["time/generate_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        old = None
        correction = self.correction
        on_policy = self.actor.updates_on_policy(batch.total_rows)
        # A token IS correction alone on an on-policy update is applied inside it, from its own
        # forward pass (the log-probs a separate pass would give); a sequence mask must shape the
        # batch before the update.
        tis_in_update = on_policy and set(correction) == {"tis_cap"}
        # On-policy, the update's own forward gives them; a correction needs them before the update.
        if (correction and not tis_in_update) or not on_policy:
            old = self.actor.compute_log_probs(batch, with_entropy=True)
            batch = batch.with_fields(old_log_probs=old["log_probs"])
        if self.reference is not None:
            batch = batch.with_fields(ref_log_probs=self.reference.compute_log_probs(batch)["log_probs"])
        if self.critic is not None:
            batch = batch.with_fields(values=self.critic.compute_values(batch))
        timings["time/logprob_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        reward = self.generator.rewards(rollouts)  # scored while the log-probs ran
        timings["time/reward_wait_s"] = time.perf_counter() - clock
        token_rewards = _place_on_last_token([reward.scores[row] for row in batch.step_rows.tolist()], batch)
        advantages = compute_advantages(self.preset.advantage, token_rewards, batch.loss_mask,
                                        values=batch.values, group_index=batch.group_ids, dp_group=_dp_group())
        batch = batch.with_fields(token_rewards=token_rewards, advantages=advantages.advantages,
                                  returns=advantages.returns)
        self.generator.record(rows, batch, self.step_index + 1)
        trained_mask = batch.loss_mask > 0  # the rows' own, for the metrics below
        correction_metrics = {}
        if correction and not tis_in_update:
            corrected = rollout_correction(old["log_probs"], rows.engine_log_probs, batch.loss_mask, **correction)
            advantages_used, loss_mask = corrected.apply(batch.advantages, batch.loss_mask)
            batch = batch.with_fields(advantages=advantages_used, loss_mask=loss_mask)
            correction_metrics = _rollout_correction_metrics(corrected, trained_mask)

        clock = time.perf_counter()
        if tis_in_update:
            metrics = self.actor.update(batch.with_fields(engine_log_probs=rows.engine_log_probs),
                                        tis_cap=correction["tis_cap"])
            old = {"log_probs": self.actor.update_log_probs}  # what the weights were computed from
            corrected = rollout_correction(old["log_probs"], rows.engine_log_probs, batch.loss_mask, **correction)
            correction_metrics = _rollout_correction_metrics(corrected, trained_mask)
        else:
            metrics = self.actor.update(batch)
        if self.critic is not None:
            metrics.update(self.critic.update(batch))
        self._stop_if_diverging(metrics, reward)
        timings["time/update_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        self.step_index += 1
        waited = self._sync_weights()
        timings["time/sync_s"] = time.perf_counter() - clock - waited
        timings["time/generate_s"] += waited  # the trainer's wait for generation, wherever it waited

        tokens = float(sum(r.tokens for r in rollouts.summaries))
        step_time = sum(timings.values())
        metrics.update(timings)
        metrics.update(self.fleet.sync_metrics())
        metrics.update(reward.metrics())
        metrics.update(rollouts.stats())
        metrics.update(correction_metrics)
        if self.generator.pipeline is not None:
            metrics.update(self._staleness(rollouts))
            if old is not None:  # the gap on the tokens of the weights just trained: ~0, as in a synchronous step
                fresh = trained_mask & (rows.engine_versions == self.step_index - 1)
                gap = _rollout_logprob_gap(rows.engine_log_probs, old["log_probs"], fresh)
                metrics.update({f"{k}_fresh": v for k, v in gap.items()})
        mask = trained_mask
        if old is not None:
            # The entropy of the policy trained from: a separate pass's, or the on-policy update's own.
            metrics["actor/entropy_old"] = _over_dp(old["entropy"], mask)[0] if "entropy" in old else metrics["actor/entropy"]
            metrics.update(_rollout_logprob_gap(rows.engine_log_probs, old["log_probs"], mask))
        else:  # the entropy of the same policy, from the update's own forward pass
            metrics["actor/entropy_old"] = metrics["actor/entropy"]
        metrics.update(_dp_shares(batch))
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

    def _staleness(self, rollouts: Rollouts) -> dict[str, float]:
        """How old the trained tokens' weights are (rollout/staleness_*); more than
        trainer.max_staleness would be a bug of the pipeline, so it stops the run."""
        metrics = rollouts.staleness(self.step_index - 1)  # this step's update started from that version
        if metrics["rollout/staleness_max"] > self.cfg.trainer.max_staleness:
            raise RuntimeError(f"step {self.step_index}: a trained token is {metrics['rollout/staleness_max']:g} "
                               f"weight versions old, over trainer.max_staleness={self.cfg.trainer.max_staleness}")
        return metrics

    def _sync_weights(self) -> float:
        """The actor's weights into every engine, once they are known to be finite; each engine
        then reports serving version `step_index`; asynchronous, the batches it allows start.
        Engines asleep since training wake in vLLM's order for a weight update: the offloaded
        state leaves the device (the actor's parameters after the sync, which reads them), the
        allocator's cached blocks go back, the engines' weights wake, the weights load, and only
        then the KV cache wakes. Returns the seconds spent waiting for batches in flight first
        (asynchronous, no partial rollout)."""
        self.actor.engine.check_finite("the weight sync")
        self._to_host(keep_actor_params=True)
        torch.cuda.empty_cache()  # what training cached, for vLLM to map its weights into
        self.fleet.wake_up(["weights"])
        clock = time.perf_counter()
        self.generator.before_sync()
        waited = time.perf_counter() - clock
        self.fleet.update_weights(self.actor.engine, self.step_index)
        self._to_host()
        torch.cuda.empty_cache()
        self.fleet.wake_up(["kv_cache"])
        self.generator.after_sync(self.step_index)
        return waited

    def _to_host(self, keep_actor_params: bool = False) -> None:
        """The state the offload keys name goes to host memory (the device is about to be the
        engines'); `keep_actor_params`: the actor's parameters stay for a weight sync."""
        for engine in self.offloaded:
            engine.offload(keep_params=keep_actor_params and engine is self.actor.engine)

    @contextlib.contextmanager
    def _state_on_device(self):
        """For work that reads the whole training state outside training (a checkpoint): with
        some of it in host memory, the engines sleep keeping their weights (level 1) while it
        is back, and wake once it is away again."""
        if not self.offloaded:
            yield
            return
        self.fleet.sleep(level=1)
        try:
            yield
        finally:
            self._to_host()
            torch.cuda.empty_cache()
            self.fleet.wake_up()

    def _draw(self) -> list[PromptRecord]:
        return [self.records[i] for i in self.sampler.next(self.cfg.trainer.prompts_per_step)]

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, float]:
        # A stop signal from here on (runtime/stop.py) ends the run after the RL step under way.
        with StopRequest() as stop:
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
                saved = self.cfg.trainer.save_every and self.step_index % self.cfg.trainer.save_every == 0
                if saved:
                    self.save_checkpoint()
                if self._stopped(stop, saved):
                    break
        return last

    def _stopped(self, stop: StopRequest, saved: bool) -> bool:
        """After a step: whether a stop signal reached any rank; if so, the run is checkpointed
        here (this step's checkpoint, if it has one)."""
        self.stopped_by = stop.agreed()
        if self.stopped_by is None or self.step_index >= self.cfg.trainer.total_steps:
            return False
        directory = checkpoint_dir(self.output, self.step_index) if saved else self.save_checkpoint()
        if self.is_leader:
            print(f"rlf-train: stopped by {signal.Signals(self.stopped_by).name} after step "
                  f"{self.step_index}/{self.cfg.trainer.total_steps}; checkpoint {directory}; rerun with "
                  f"trainer.resume=auto (the default) to continue from it", flush=True)
        return True

    def validate(self) -> dict[str, float]:
        """Greedy rollouts on held-out prompts, on every engine; mean score = accuracy for 0/1 scorers.
        A few of them go to TensorBoard as text (`val/trajectories`)."""
        rollouts = self.generator.rollout(self.val_records, self.step_index, greedy=True)
        scores = self.generator.rewards(rollouts).scores
        if self.logger is not None and rollouts.local:
            from rlfactory_megatron.envs.storage.text import render

            shown = sorted(rollouts.local)[:VALIDATION_TEXTS]
            text = "\n\n".join(render(rollouts.stored_record(row, self.step_index, np.zeros(0)), self.tokenizer,
                                      prompt_chars=300) for row in shown)
            self.logger.text("val/trajectories", text, self.step_index)
        return {"val/score_mean": float(np.mean(scores))}

    def sft_warm_start(self) -> None:
        """Supervised steps on the prompts' demonstrations (sft.py), then the weights to the engines."""
        rows = self.collectives.broadcast(demonstration_rows(self.records, self.generator.manager,
                                                             self.generator.tool_schemas, self.cfg.rollout.max_prompt_tokens,
                                                             self.cfg.rollout.truncation)
                                          if self.is_leader else None)
        cache = (WarmStartCache(self.cfg.trainer.sft_cache, warm_start_key(self.cfg, self.hf_dir, rows), self.output)
                 if self.cfg.trainer.sft_cache else None)
        self.fleet.sleep()  # as before any training; the sync below wakes the engines
        sft_warm_start(self.actor, rows, self.cfg.trainer, verbose=self.is_leader, cache=cache)
        self._sync_weights()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        ahead = self.generator.state()
        with self._state_on_device():
            return save_checkpoint(self.output, self.step_index, self.actor, self.critic, self.sampler,
                                   self.cfg.trainer.keep_last, self.hf_dir, self.cfg.trainer.save_hf,
                                   files={AHEAD_FILE: ahead} if ahead is not None else None,
                                   wandb_run_id=self.logger.wandb_run_id if self.logger is not None else None)

    def _maybe_resume(self) -> None:
        directory = resume_directory(self.cfg.trainer.resume, self.output)
        if directory is None:
            return
        self.fleet.sleep()  # loading fills the training state; the sync below wakes the engines
        self.step_index, wandb_run_id = load_checkpoint(directory, self.actor, self.critic, self.sampler)
        self.generator.restore(directory)
        self._sync_weights()
        if self.is_leader:
            self.logger.rewind(self.step_index, wandb_run_id)
            print(f"rlf-train: resumed from {directory} at step {self.step_index}")

    def close(self) -> None:
        self.generator.close()
        self.fleet.close()
        if self.logger is not None:
            self.logger.close()


def _dp_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def _over_dp(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of `values` on the masked tokens of every DP rank's rows (0, 0 if none)."""
    kept = values[mask].double()
    totals = torch.tensor([float(kept.sum()), float(len(kept))], dtype=torch.float64)
    highest = torch.tensor([float(kept.max()) if len(kept) else float("-inf")], dtype=torch.float64)
    group = _dp_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    if totals[1] == 0:
        return 0.0, 0.0
    return float(totals[0] / totals[1]), float(highest[0])


def _dp_shares(batch: RolloutBatch) -> dict[str, float]:
    """How the step's rows came to the DP ranks: fewest and most rows one trained on, and the
    token imbalance (most tokens / mean); from the rows each DP rank actually holds."""
    share = torch.tensor([[batch.batch_size, int(batch.lengths.sum())]], dtype=torch.float64)
    group = _dp_group()
    shares = [torch.zeros_like(share) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shares, share, group=group)
    rows, tokens = torch.cat(shares).T
    return {"train/dp_rows_min": float(rows.min()), "train/dp_rows_max": float(rows.max()),
            "train/dp_token_imbalance": float(tokens.max() / tokens.mean().clamp(min=1))}


def _rollout_logprob_gap(rollout: torch.Tensor, trainer_log_probs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engines' log-probs of the sampled tokens are from the trainer's on the
    same weights: ~0 when the weights synced and the token alignment holds; a gap that grows
    means the engine samples from another policy than the one trained (off-policy drift)."""
    mean, highest = _over_dp((trainer_log_probs - rollout).abs(), mask)
    return {"rollout/logprob_gap_mean": mean, "rollout/logprob_gap_max": highest}


def _rollout_correction_metrics(corrected, mask: torch.Tensor) -> dict[str, float]:
    """The engine-vs-trainer mismatch and what the correction did to it, over every DP rank:
    KL(engine || trainer) by the k3 estimator on the engine's samples, the IS weights' mean and
    max, and the share of samples left out."""
    ratio = corrected.log_ratio
    kl, _ = _over_dp(ratio.exp() - 1 - ratio, mask)
    weight_mean, weight_max = _over_dp(corrected.token_weights, mask)
    rows = mask.any(-1)
    counts = torch.tensor([float((~corrected.keep & rows).sum()), float(rows.sum())], dtype=torch.float64)
    group = _dp_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return {"rollout_correction/mismatch_kl": kl, "rollout_correction/is_weight_mean": weight_mean,
            "rollout_correction/is_weight_max": weight_max,
            "rollout_correction/masked_frac": float(counts[0] / counts[1].clamp(min=1))}


def _place_on_last_token(scores: list[float], batch: RolloutBatch) -> torch.Tensor:
    """Sequence scores -> [B, T] rewards on each row's last trained token (0 elsewhere)."""
    rewards = torch.zeros(batch.input_ids.shape)
    for row, score in enumerate(scores):
        trained = torch.nonzero(batch.loss_mask[row] > 0)
        if len(trained):
            rewards[row, int(trained[-1])] = float(score)
    return rewards
