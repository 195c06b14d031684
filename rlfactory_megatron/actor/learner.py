"""The training side of an RL step, on one DP rank's rows: old and reference log-probs, values,
advantages, the off-policy correction, the actor (+ critic) update; it returns what the trainer
logs. Statistics over the step (advantage whitening, group baselines, metrics) are reduced
across DP ranks."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rlfactory_megatron.actor.actor import Actor, Critic, PolicyModel
from rlfactory_megatron.actor.batch import RolloutBatch
from rlfactory_megatron.algorithms import compute_advantages
from rlfactory_megatron.algorithms.rollout_correction import correction_settings, rollout_correction
from rlfactory_megatron.models.builder import BuildOptions
from rlfactory_megatron.models.hf_arch import ModelArch


@dataclass
class TrainResult:
    """One step's training: its metrics (the same on every rank) and the trained rows with the
    advantages computed for them (before any correction: what the rollout store keeps)."""

    metrics: dict[str, float]
    batch: RolloutBatch


class Learner:
    """The actor, its frozen reference (actor.kl_loss_coef > 0) and the critic (`with_critic`), and
    one RL step's training of them. `advantage`: the estimator's name (algorithms/advantages.py);
    `asynchronous`: batches are generated ahead of training (trainer.max_staleness > 0)."""

    def __init__(self, cfg, arch: ModelArch, hf_dir: str, build: BuildOptions, advantage: str, with_critic: bool,
                 asynchronous: bool) -> None:
        self.cfg, self.advantage, self.asynchronous = cfg, advantage, asynchronous
        total = cfg.trainer.total_steps * cfg.actor.ppo_epochs
        # Log-probs of the distribution the rollout samples from (rollout.temperature 0 = greedy
        # sampling, which RL cannot learn from; its log-probs are taken at 1).
        temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.actor = Actor(cfg.actor, arch, hf_dir, build, total, norm_length=cfg.rollout.max_response_tokens,
                           temperature=temperature, compare_routes=bool(cfg.rollout.record_routes))
        # Under R3 the reference replays the engines' routes too; under R2 it routes for itself.
        self.reference = (PolicyModel(arch, hf_dir, build, cfg.actor.max_tokens_per_microbatch,
                                      fused_logprob=cfg.actor.use_fused_logprob, temperature=temperature,
                                      routing_replay="R3" if cfg.actor.moe.routing_replay == "R3" else "none")
                          if cfg.actor.kl_loss_coef > 0 else None)
        self.critic = (Critic(cfg.critic, cfg.actor, arch, hf_dir, build, total, norm_length=cfg.rollout.max_response_tokens)
                       if with_critic else None)
        self.correction = correction_settings(cfg.actor.rollout_correction, asynchronous=asynchronous)
        # The models whose state waits in host memory while colocated engines generate
        # (actor.offload: the actor and its reference; critic.offload).
        self.offloaded = [model.megatron for model, on in ((self.actor, cfg.actor.offload),
                                                         (self.reference, cfg.actor.offload),
                                                         (self.critic, cfg.critic.offload)) if model is not None and on]

    def to_host(self, keep_actor_params: bool = False) -> None:
        """The state the offload keys name goes to host memory (the device is about to be the
        engines'); `keep_actor_params`: the actor's parameters stay for a weight sync."""
        for megatron in self.offloaded:
            megatron.offload(keep_params=keep_actor_params and megatron is self.actor.megatron)

    def train(self, batch: RolloutBatch, engine_log_probs: torch.Tensor, engine_versions: torch.Tensor,
              scores: Callable[[], Sequence[float]], version: int) -> TrainResult:
        """Train on this DP rank's rows (`batch`, DP-local) with the engines' log-probs of them and
        the weight version that generated each token; `scores()` gives every row's reward of the
        step (waited for once the log-probs are done: scoring overlaps them); `version`: the
        weights being trained."""
        timings: dict[str, float] = {}
        clock = time.perf_counter()
        correction = self.correction
        on_policy = self.actor.updates_on_policy(batch.total_rows)
        # A token IS correction alone on an on-policy update is applied inside it, from its own
        # forward pass (the log-probs a separate pass would give); a sequence mask must shape the
        # batch before the update.
        tis_in_update = on_policy and set(correction) == {"tis_cap"}
        old = None
        engine_routes_agreement = None  # the trainer's router against the engines' routes (recorded ones)
        # On-policy, the update's own forward gives them; a correction needs them before the update.
        if (correction and not tis_in_update) or not on_policy:
            old = self.actor.compute_log_probs(batch, with_entropy=True)
            engine_routes_agreement = old.pop("routing_agreement", None)
            batch = batch.with_fields(old_log_probs=old["log_probs"], routes=old.get("routes", batch.routes))
        if self.reference is not None:
            batch = batch.with_fields(ref_log_probs=self.reference.compute_log_probs(batch)["log_probs"])
        if self.critic is not None:
            batch = batch.with_fields(values=self.critic.compute_values(batch))
        timings["time/logprob_s"] = time.perf_counter() - clock

        clock = time.perf_counter()
        step_scores = scores()
        timings["time/reward_wait_s"] = time.perf_counter() - clock
        token_rewards = _place_on_last_token([step_scores[row] for row in batch.step_rows.tolist()], batch)
        advantages = compute_advantages(self.advantage, token_rewards, batch.loss_mask,
                                        values=batch.values, group_index=batch.group_ids, dp_group=_dp_group())
        batch = batch.with_fields(token_rewards=token_rewards, advantages=advantages.advantages,
                                  returns=advantages.returns)
        advantaged = batch
        trained_mask = batch.loss_mask > 0  # the rows' own, for the metrics below
        metrics: dict[str, float] = _spread_over_dp("train/advantages", advantages.advantages, trained_mask)
        if self.critic is not None:  # without one the returns are the advantages
            metrics.update(_spread_over_dp("train/returns", advantages.returns, trained_mask))
        if correction and not tis_in_update:
            corrected = rollout_correction(old["log_probs"], engine_log_probs, batch.loss_mask, **correction)
            advantages_used, loss_mask = corrected.apply(batch.advantages, batch.loss_mask)
            batch = batch.with_fields(advantages=advantages_used, loss_mask=loss_mask)
            metrics.update(_rollout_correction_metrics(corrected, trained_mask))

        clock = time.perf_counter()
        if tis_in_update:
            update, own = self.actor.update_with_log_probs(batch.with_fields(engine_log_probs=engine_log_probs),
                                                           tis_cap=correction["tis_cap"])
            old = {"log_probs": own}  # what the weights were computed from
            corrected = rollout_correction(own, engine_log_probs, batch.loss_mask, **correction)
            metrics.update(_rollout_correction_metrics(corrected, trained_mask))
        else:
            update = self.actor.update(batch)
        metrics.update(update)
        if self.actor.routing_replay == "R3" or self.actor.compare_routes:
            # Measured in the forward on the weights that sampled the batch: the old-log-prob pass,
            # or on-policy the update's single forward (both replay the engines' routes under R3,
            # compare with them otherwise).
            agreement = engine_routes_agreement if not tis_in_update and old is not None else update.get(
                "moe/routing_agreement")
            if agreement is not None:
                metrics["rollout/routing_agreement"] = agreement
        if self.critic is not None:
            metrics.update(self.critic.update(batch))
        self._stop_if_diverging(metrics, step_scores)
        timings["time/update_s"] = time.perf_counter() - clock

        metrics.update(timings)
        if self.asynchronous and old is not None:
            # The gap on the tokens of the weights just trained: ~0, as in a synchronous step.
            fresh = trained_mask & (engine_versions == version)
            gap = _rollout_logprob_gap(engine_log_probs, old["log_probs"], fresh)
            metrics.update({f"{k}_fresh": v for k, v in gap.items()})
        if old is not None:
            # The entropy of the policy trained from: a separate pass's, or the on-policy update's own.
            metrics["actor/entropy_old"] = (_over_dp(old["entropy"], trained_mask)[0] if "entropy" in old
                                            else metrics["actor/entropy"])
            metrics.update(_rollout_logprob_gap(engine_log_probs, old["log_probs"], trained_mask))
        else:  # the entropy of the same policy, from the update's own forward pass
            metrics["actor/entropy_old"] = metrics["actor/entropy"]
        metrics.update(_dp_shares(batch))
        return TrainResult(metrics, advantaged)

    def _stop_if_diverging(self, metrics: dict[str, float], scores: Sequence[float]) -> None:
        """Raise once trainer.max_skipped_updates optimizer steps in a row were skipped for
        non-finite numbers (each skip applied nothing): the run would otherwise go on untrained."""
        from rlfactory_megatron.actor.model import NonFiniteError

        limit = self.cfg.trainer.max_skipped_updates
        for name, model in (("actor", self.actor), ("critic", self.critic)):
            if model is not None and model.megatron.skipped_in_a_row >= limit:
                shown = {k: metrics[k] for k in (f"{name}/pg_loss", f"{name}/vf_loss", f"{name}/grad_norm") if k in metrics}
                raise NonFiniteError(
                    f"{name}: the last {model.megatron.skipped_in_a_row} optimizer steps had a non-finite loss or "
                    f"gradient and were skipped ({', '.join(f'{k}={v:g}' for k, v in shown.items())}; this step's "
                    f"rewards {'are all finite' if np.isfinite(scores).all() else 'hold non-finite values'}); "
                    f"lower actor.optim.lr or raise trainer.max_skipped_updates={limit}")


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


def _spread_over_dp(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`name`/mean, /min and /max of `values` on the masked tokens of every DP rank's rows."""
    mean, highest = _over_dp(values, mask)
    _, negated_lowest = _over_dp(-values, mask)
    return {f"{name}/mean": mean, f"{name}/min": -negated_lowest, f"{name}/max": highest}


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
