"""One RL run, readable top to bottom: `Trainer.fit()` repeats `step()`:

rollout on every engine (agent loop on vLLM, tools in Ray) -> each DP rank receives the rows it
trains on -> rewards (each engine's process scores its rows, overlapped with log-probs) ->
old/ref log-probs, values -> advantages -> actor (+ critic) update -> weight sync to every
engine -> log, validate and checkpoint. Every rank runs this on its DP rank's rows. The rollout
side is rollout/: the engines (`EngineFleet`: start, weight updates, replacement, sleep) and the
rows they make (`RolloutGenerator`: agent loops, rows to DP ranks, rewards, the store); the
training side is `Learner` (actor/learner.py: log-probs, advantages, correction, updates).
"""
from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from rlfactory_megatron.actor.learner import Learner
from rlfactory_megatron.models.builder import BuildOptions, MoEOptions
from rlfactory_megatron.models.hf_arch import load_arch
from rlfactory_megatron.rollout.fleet import EngineFleet
from rlfactory_megatron.rollout.generator import RolloutGenerator
from rlfactory_megatron.rollout.pipeline import AHEAD_FILE
from rlfactory_megatron.rollout.prompts import PromptRecord
from rlfactory_megatron.runtime.collectives import RankCollectives
from rlfactory_megatron.runtime.stop import StopRequest
from rlfactory_megatron.trainer.data import PromptSampler, run_records
from rlfactory_megatron.trainer.logger import MetricsLogger, wandb_settings
from rlfactory_megatron.trainer.memory_plan import device_memory, resolve_recompute
from rlfactory_megatron.trainer.presets import ALGORITHM_PRESETS, trains_critic
from rlfactory_megatron.trainer.checkpoint import (CONFIG_FILE, HF_DIR, checkpoint_dir, load_checkpoint,
                                                   resume_directory, save_checkpoint)
from rlfactory_megatron.trainer.sft import demonstration_rows, sft_warm_start
from rlfactory_megatron.trainer.tasks import run_tool_specs
from rlfactory_megatron.trainer.warm_start_cache import WarmStartCache, warm_start_key

# Validation trajectories shown as text in TensorBoard at each validation.
VALIDATION_TEXTS = 3
# The phases of a step, whose sum is its time (perf/step_s).
STEP_TIMES = ("time/generate_s", "time/logprob_s", "time/reward_wait_s", "time/update_s", "time/sync_s")


class Trainer:
    def __init__(self, cfg, hf_dir: str) -> None:
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.hf_dir = str(hf_dir)
        self.preset = ALGORITHM_PRESETS.get(cfg.trainer.algorithm)  # applied to cfg at load
        self.arch = load_arch(hf_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.output = Path(cfg.trainer.output_dir)
        self.is_leader = dist.get_rank() == 0
        # rlf-train resolved model.recompute=auto before writing config.yaml; a Trainer made from a
        # loaded config directly (rlf-bench e2e, tests) resolves it the same way here.
        resolve_recompute(cfg, self.arch, dist.get_world_size(), device_memory())
        build = BuildOptions(params_dtype=cfg.model.params_dtype, layer_spec=cfg.model.layer_spec,
                             recompute=cfg.model.recompute,
                             sequence_parallel=cfg.parallel.sequence_parallel, moe=MoEOptions(**cfg.model.moe))
        self.learner = Learner(cfg, self.arch, hf_dir, build, self.preset.advantage, trains_critic(cfg),
                               asynchronous=cfg.trainer.max_staleness > 0)
        self.learner.to_host()  # the engines start with the offloaded state in host memory
        self.records, self.val_records = run_records(cfg)  # checked at load (data_checks.py)
        self.sampler = PromptSampler(len(self.records), cfg.trainer.seed)
        self.step_index = 0
        self.stopped_by: int | None = None  # the signal that stopped the run early (runtime/stop.py)
        self.last_validation: tuple[int, float] | None = None  # (step, held-out score) of the latest validation
        self.last_checkpoint: Path | None = None
        self.logger = None
        self.collectives = RankCollectives()
        self.fleet = EngineFleet(cfg, self.hf_dir, self.output, self.collectives)
        self.generator = RolloutGenerator(cfg, self.fleet, self.collectives, self.tokenizer, self.output,
                                          run_tool_specs(cfg), self._draw, self.preset.drop_uniform_groups)
        if self.is_leader:
            self.logger = MetricsLogger(self.output, cfg.trainer.total_steps, cfg.logging.jsonl,
                                        cfg.logging.tensorboard, wandb_settings(cfg),
                                        progress_every=cfg.logging.log_every)

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[str, float]:
        """Generate -> train -> update_weights, on this DP rank's rows of the step."""
        clock = time.perf_counter()
        rows = self.generator.generate(self.step_index)  # this DP rank's rows, and only those
        self.fleet.sleep()  # the engines' device memory goes to training until the next sync
        generate_s = time.perf_counter() - clock
        # Scored while the log-probs run: the learner waits for the rewards only then.
        trained = self.learner.train(rows.batch, rows.engine_log_probs, rows.engine_versions,
                                     lambda: self.generator.rewards(rows.rollouts).scores, version=self.step_index)
        self.generator.record(rows, trained.batch, self.step_index + 1)
        clock = time.perf_counter()
        self.step_index += 1
        waited = self._sync_weights()
        metrics = {**trained.metrics, "time/generate_s": generate_s + waited,  # waited: for generation, asynchronous
                   "time/sync_s": time.perf_counter() - clock - waited}
        metrics.update(self.fleet.sync_metrics())
        metrics.update(self.generator.metrics(rows.rollouts, version=self.step_index - 1))
        step_time = sum(metrics[k] for k in STEP_TIMES)
        metrics["perf/tokens_per_s"] = sum(r.tokens for r in rows.rollouts.summaries) / max(step_time, 1e-9)
        metrics["perf/step_s"] = step_time
        return metrics

    def _sync_weights(self) -> float:
        """The actor's weights into every engine, once they are known to be finite; each engine
        then reports serving version `step_index`; asynchronous, the batches it allows start.
        Engines asleep since training wake in vLLM's order for a weight update: the offloaded
        state leaves the device (the actor's parameters after the sync, which reads them), the
        allocator's cached blocks go back, the engines' weights wake, the weights load, and only
        then the KV cache wakes. Returns the seconds spent waiting for batches in flight first
        (asynchronous, no partial rollout)."""
        self.learner.actor.megatron.check_finite("the weight sync")
        self.learner.to_host(keep_actor_params=True)
        torch.cuda.empty_cache()  # what training cached, for vLLM to map its weights into
        self.fleet.wake_up(["weights"])
        clock = time.perf_counter()
        self.generator.before_sync()
        waited = time.perf_counter() - clock
        self.fleet.update_weights(self.learner.actor.megatron, self.step_index)
        self.learner.to_host()
        torch.cuda.empty_cache()
        self.fleet.wake_up(["kv_cache"])
        self.generator.after_sync(self.step_index)
        return waited

    @contextlib.contextmanager
    def _state_on_device(self):
        """For work that reads the whole training state outside training (a checkpoint): with
        some of it in host memory, the engines sleep keeping their weights (level 1) while it
        is back, and wake once it is away again."""
        if not self.learner.offloaded:
            yield
            return
        self.fleet.sleep(level=1)
        try:
            yield
        finally:
            self.learner.to_host()
            torch.cuda.empty_cache()
            self.fleet.wake_up()

    def _draw(self) -> list[PromptRecord]:
        return [self.records[i] for i in self.sampler.next(self.cfg.trainer.prompts_per_step)]

    # ------------------------------------------------------------------ the run
    def fit(self) -> dict[str, float]:
        # A stop signal from here on (runtime/stop.py) ends the run after the RL step under way.
        with StopRequest() as stop:
            self._maybe_resume()
            first: dict[str, float] = {}  # step 0's record: the warm-start's loss, validation before RL
            if self.cfg.trainer.sft_steps > 0 and self.step_index == 0:
                first.update(self.sft_warm_start())
            if self.cfg.trainer.val_every and self.step_index == 0:
                first.update(self.validate())  # the baseline the run's validation curve starts from
                if self.is_leader:
                    print(f"rlf-train: validation before RL: score {first['val/score_mean']:.3f} "
                          f"on {len(self.val_records)} held-out prompts", flush=True)
            if first and self.is_leader:
                self.logger.log(0, first, progress=False)
            last: dict[str, float] = {}
            while self.step_index < self.cfg.trainer.total_steps:
                last = self.step()
                if self.cfg.trainer.val_every and self.step_index % self.cfg.trainer.val_every == 0:
                    last.update(self.validate())
                if self.is_leader:
                    self.logger.log(self.step_index, last)
                every = self.cfg.trainer.save_every
                # The last step too (save_every 0: no checkpoints): a run never ends unsaved.
                saved = every > 0 and (self.step_index % every == 0 or self.step_index == self.cfg.trainer.total_steps)
                if saved:
                    self.save_checkpoint()
                if self._stopped(stop, saved):
                    break
            if self.cfg.trainer.total_steps == 0:  # the warm-start is the run's result
                directory = self.save_checkpoint()
                if self.is_leader:
                    model = directory / HF_DIR if self.cfg.trainer.save_hf else directory
                    print(f"rlf-train: no RL steps (trainer.total_steps=0); the warm-started model: {model}", flush=True)
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
        metrics = {"val/score_mean": float(np.mean(scores))}
        by_source: dict[str, list[float]] = {}
        for record, score in zip(rollouts.records, scores):
            by_source.setdefault(record.data_source, []).append(score)
        metrics.update({f"val/{source}/score_mean": float(np.mean(s)) for source, s in sorted(by_source.items())})
        self.last_validation = (self.step_index, metrics["val/score_mean"])
        if self.logger is not None and rollouts.local:
            from rlfactory_megatron.envs.storage.text import render

            shown = sorted(rollouts.local)[:VALIDATION_TEXTS]
            text = "\n\n".join(render(rollouts.stored_record(rollouts.row_data(row), self.step_index, np.zeros(0)),
                                      self.tokenizer, prompt_chars=300) for row in shown)
            self.logger.text("val/trajectories", text, self.step_index)
        return metrics

    def sft_warm_start(self) -> dict[str, float]:
        """Supervised steps on the prompts' demonstrations (sft.py), then the weights to the engines;
        returns the warm-start's last loss, for step 0's record."""
        rows = self.collectives.broadcast(demonstration_rows(self.records, self.generator.manager,
                                                             self.generator.tool_schemas, self.cfg.rollout.max_prompt_tokens,
                                                             self.cfg.rollout.truncation)
                                          if self.is_leader else None)
        cache = (WarmStartCache(self.cfg.trainer.sft_cache, warm_start_key(self.cfg, self.hf_dir, rows), self.output)
                 if self.cfg.trainer.sft_cache else None)
        self.fleet.sleep()  # as before any training; the sync below wakes the engines
        metrics = sft_warm_start(self.learner.actor, rows, self.cfg.trainer, verbose=self.is_leader, cache=cache)
        self._sync_weights()
        return {"sft/loss": metrics["sft/loss"]}  # (a warm-start loaded from trainer.sft_cache knows only its loss)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        ahead = self.generator.state()
        files = {CONFIG_FILE: OmegaConf.to_yaml(self.cfg).encode()}  # what a resume is compared with
        if ahead is not None:
            files[AHEAD_FILE] = ahead
        learner = self.learner
        with self._state_on_device():
            self.last_checkpoint = save_checkpoint(
                self.output, self.step_index, learner.actor, learner.critic, self.sampler, self.cfg.trainer.keep_last,
                self.hf_dir, self.cfg.trainer.save_hf, files=files,
                wandb_run_id=self.logger.wandb_run_id if self.logger is not None else None)
        return self.last_checkpoint

    def _maybe_resume(self) -> None:
        directory = resume_directory(self.cfg.trainer.resume, self.output)
        if directory is None:
            return
        self.fleet.sleep()  # loading fills the training state; the sync below wakes the engines
        learner = self.learner
        self.step_index, wandb_run_id = load_checkpoint(directory, learner.actor, learner.critic, self.sampler)
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
