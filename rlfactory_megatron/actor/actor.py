"""The policy (actor), its frozen reference, and the critic: log-probs, values and PPO-style updates.

Every loss is normalized over the whole mini-batch (all micro-batches, all DP ranks) before
megatron's schedule and DDP average it, so packing, token-budget cuts and the DP split never
change an update; tokens with loss_mask 0 contribute exactly nothing.
"""
from __future__ import annotations

import math
import time
from functools import partial
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from rlfactory_megatron.actor.batch import (MicroBatchPlan, PackedMicroBatch, RolloutBatch, local_cuts, pack_plan,
                                            plan_micro_batches)
from rlfactory_megatron.actor.model import MegatronModel
from rlfactory_megatron.actor.routing import RoutePass
from rlfactory_megatron.algorithms import clipped_value_loss, compute_policy_loss, kl_penalty
from rlfactory_megatron.algorithms.aggregation import aggregate_loss
from rlfactory_megatron.algorithms.rollout_correction import rollout_correction
from rlfactory_megatron.kernels.logprob import fused_logprob_entropy
from rlfactory_megatron.models.builder import BuildOptions, lm_output_weight
from rlfactory_megatron.models.hf_arch import ModelArch
from rlfactory_megatron.models.logprobs import vocab_parallel_entropy, vocab_parallel_log_probs

SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _parallel():
    from megatron.core import parallel_state as ps

    return ps


def _dp() -> tuple[int, int]:
    ps = _parallel()
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def _plan(batch: RolloutBatch, max_tokens: int) -> MicroBatchPlan:
    rank, size = _dp()
    # Context parallelism splits every sequence into 2 x cp chunks (its slot a multiple of that),
    # and sequence parallelism each CP rank's share of the pack over the TP ranks.
    ps = _parallel()
    cp = ps.get_context_parallel_world_size()
    align = 2 * cp if cp > 1 else 1
    multiple = math.lcm(8, align, cp * ps.get_tensor_model_parallel_world_size())
    if not batch.dp_local:  # the whole batch on every rank: each takes its share
        return plan_micro_batches(batch, max_tokens, rank, size, multiple, align)
    # This DP rank's rows only: the ranks agree on the count of micro-batches and their padded
    # length (max) and on the mini-batch's normalizers (sum), as if they had cut one batch.
    cuts, shape = local_cuts(batch, max_tokens, align)
    agreed = torch.tensor(shape, dtype=torch.int64)
    if size > 1:
        group = _parallel().get_data_parallel_group(with_context_parallel=False)
        maxed, summed = agreed[:2].clone(), agreed[2:].clone()
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(summed, group=group)
        agreed = torch.cat([maxed, summed])
    steps, longest, tokens, sequences = (int(v) for v in agreed)
    return pack_plan(batch, cuts, steps, longest, tokens, sequences, multiple, align)


def _agg_options(plan: MicroBatchPlan, mode: str, norm_length: int | None) -> dict[str, Any]:
    """Global normalizers: a micro-batch's aggregate is its share of the mini-batch's aggregate."""
    # At least 1: a mini-batch with nothing to train (every sample masked by the rollout
    # correction) contributes a zero loss, not 0 / 0.
    options: dict[str, Any] = {"num_units": max(1, plan.num_sequences if mode in SEQ_MODES else plan.num_tokens)}
    if mode == "seq-mean-token-sum-norm":
        options["norm_length"] = norm_length
    return options


def _undo_schedule_averaging(loss: torch.Tensor, plan: MicroBatchPlan) -> torch.Tensor:
    # megatron divides each micro-batch loss by their count, DDP averages gradients over DP ranks;
    # our losses are already globally normalized, so both divisions are undone here.
    return loss * len(plan.micro_batches) * _dp()[1]


def _from_last_stages(tensor: torch.Tensor, over_dp: bool = True) -> torch.Tensor:
    """Sum over DP ranks (unless not `over_dp`) of values held by each DP rank's last pipeline
    stage, then share with all stages."""
    ps = _parallel()
    if over_dp and ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(tensor, group=ps.get_data_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        last = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
        dist.broadcast(tensor, src=last, group=ps.get_pipeline_model_parallel_group())
    return tensor


def _slice(tensor: torch.Tensor, rows: list[int], width: int, device: torch.device) -> torch.Tensor:
    """The rows of a micro-batch from a [B, T] batch tensor, on the model's device."""
    return tensor[rows, :width].to(device, non_blocking=True)


def gather_routes(batch: RolloutBatch, recorded: torch.Tensor) -> torch.Tensor:
    """[B, T, layers, top-k] routes of the batch's tokens from every rank's share (its stage's
    layers, its DP rank's rows): the one rank that ran a layer for a row holds them, others NO_ROUTE."""
    ps = _parallel()
    groups = [ps.get_pipeline_model_parallel_group()] if ps.get_pipeline_model_parallel_world_size() > 1 else []
    if not batch.dp_local and ps.get_data_parallel_world_size() > 1:
        groups.append(ps.get_data_parallel_group())
    for group in groups:
        dist.all_reduce(recorded, op=dist.ReduceOp.MAX, group=group)
    return recorded.to(torch.int16)  # experts < 2**15; a quarter of int64's host memory


def gather_token_values(batch: RolloutBatch, outputs: list[dict[str, Any]], key: str) -> torch.Tensor:
    """[B, T] tensor from the per-micro-batch outputs, on every rank that holds the batch (each
    row computed by one DP rank: its DP rank alone holds a DP-local batch's rows)."""
    result = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for out in outputs:
        values = out[key]
        result[out["rows"], : values.shape[1]] = values.float().cpu()
    return _from_last_stages(result, over_dp=not batch.dp_local) * (batch.loss_mask > 0)


def mini_batches(batch: RolloutBatch, size: int) -> list[tuple[list[int], RolloutBatch]]:
    """Consecutive `size` rows of the step's batch (their indices in `batch`, and them); of a
    DP-local batch, this rank's rows of each (possibly none: every DP rank takes part in every
    optimizer step)."""
    if batch.dp_local:
        rows = [torch.nonzero((batch.step_rows >= i) & (batch.step_rows < i + size)).flatten().tolist()
                for i in range(0, batch.step_size, size)]
    else:
        rows = [list(range(i, min(i + size, batch.batch_size))) for i in range(0, batch.batch_size, size)]
    return [(part, batch.select(part)) for part in rows]


def policy_loss_options(actor_cfg) -> dict[str, float]:
    """The clip settings the config gives (null ones left to the loss variant: GSPO's 3e-4/4e-4
    bounds, dual-clip's c, clip-higher's 0.28)."""
    options = {option: getattr(actor_cfg, key) for option, key in (
        ("clip_low", "clip_ratio_low"), ("clip_high", "clip_ratio_high"), ("clip_ratio_c", "clip_ratio_c"))
        if getattr(actor_cfg, key) is not None}
    if "clip_ratio_c" in options and actor_cfg.policy_loss != "dual-clip":
        del options["clip_ratio_c"]  # only dual-clip has the lower bound c
    return options


class PolicyModel:
    """Log-probs (+ entropy) of a causal LM over packed micro-batches; the actor and the reference.

    fused_logprob (actor.use_fused_logprob): the model returns its final hidden states and the
    kernels' fused log-prob computes from them and the output weight, never holding fp32
    [tokens, vocab] logits; otherwise megatron's vocab-parallel logits go through models.logprobs.
    """

    def __init__(self, arch: ModelArch, hf_dir: str | None, build: BuildOptions, max_tokens: int,
                 optim_cfg=None, total_steps: int = 1, fused_logprob: bool = True, temperature: float = 1.0,
                 routing_replay: str = "none", compare_routes: bool = False) -> None:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the sampling temperature the log-probs are of), got {temperature}")
        self.arch = arch
        self.max_tokens = max_tokens
        self.fused_logprob = fused_logprob
        self.temperature = temperature
        # actor.moe.routing_replay: R2, the actor's log-prob pass records the routes the update
        # replays; R3, every pass replays the engines' routes the batch carries.
        self.routing_replay = routing_replay
        # rollout.record_routes under none or R2: the log-prob pass counts how often this model's
        # router agrees with the engines' routes the batch carries, and takes its own.
        self.compare_routes = compare_routes and routing_replay != "R3"
        build = replace(build, output_hidden_states=fused_logprob)
        self.megatron = MegatronModel(arch, hf_dir, build, optim_cfg, total_steps)

    def _token_outputs(self, mb: PackedMicroBatch, output: torch.Tensor, entropy: bool,
                       temperature: float | None = None) -> dict[str, torch.Tensor]:
        """Per-token log-probs (+ entropy) from the last stage's output: hidden states or vocab-parallel logits.

        Both are of softmax(logits / temperature), by default the distribution the rollout engine
        samples from (and reports log-probs of), so ratios and gradients are those of the policy
        that acted; supervised steps pass 1.0 (the model's own distribution)."""
        temperature = self.temperature if temperature is None else temperature
        vocab = self.arch.vocab_size  # megatron's padding rows/columns past it get no probability
        if self.fused_logprob:
            # This runs on the last pipeline stage, whose last model chunk produced `output`.
            log_probs, entropies = fused_logprob_entropy(
                output, lm_output_weight(self.megatron.modules()[-1]), mb.targets,
                tp_group=_parallel().get_tensor_model_parallel_group(), vocab_size=vocab,
                temperature=temperature,
            )
        else:
            if temperature != 1.0:
                output = output / temperature
            log_probs = vocab_parallel_log_probs(output, mb.targets, vocab)
            entropies = vocab_parallel_entropy(output, vocab) if entropy else None
        out = {"log_probs": mb.unpack(log_probs)}
        if entropy:
            out["entropy"] = mb.unpack(entropies)
        return out

    def compute_log_probs(self, batch: RolloutBatch, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Per-token log-probs (+ entropy) [B, T]; under R2 also the routes the tokens took
        ("routes", [B, T, layers, top-k]) for the update to replay; under R3 (the batch's, the
        engines', routes replayed) or with compare_routes (compared, not replayed), the share of
        trained token-layer routes on which this model's own router agreed with the engines'
        ("routing_agreement", None if none was compared)."""
        plan = _plan(batch, self.max_tokens)

        def loss_fn(mb: PackedMicroBatch, output: torch.Tensor):
            out = self._token_outputs(mb, output, with_entropy)
            return torch.zeros(()), {"rows": mb.rows, **out}

        taps = self.megatron.router_taps
        # Decided by config, the same on every rank: a collective follows.
        replay = taps is not None and self.routing_replay == "R3"
        record = taps is not None and self.routing_replay == "R2"
        compare = taps is not None and self.compare_routes
        routes = None
        if replay or compare:
            taps.reset_metrics()
        if replay:
            routes = RoutePass(replay=batch.routes, compared_on=batch.loss_mask > 0)
        elif record or compare:
            routes = RoutePass(record=record, compare=batch.routes if compare else None,
                               compared_on=batch.loss_mask > 0 if compare else None)
        outputs = self.megatron.run(plan, loss_fn, forward_only=True, routes=routes)
        keys = ["log_probs"] + (["entropy"] if with_entropy else [])
        result = {key: gather_token_values(batch, outputs, key) for key in keys}
        if record:
            result["routes"] = gather_routes(batch, taps.recorded(tuple(batch.input_ids.shape)))
        if replay or compare:
            result["routing_agreement"] = taps.take_metrics().get("moe/routing_agreement")
        return result


class Actor(PolicyModel):
    """The trained policy: PPO-family update over `ppo_epochs` x mini-batches."""

    def __init__(self, actor_cfg, arch: ModelArch, hf_dir: str | None, build: BuildOptions, total_steps: int,
                 norm_length: int | None = None, temperature: float = 1.0, compare_routes: bool = False) -> None:
        super().__init__(arch, hf_dir, build, actor_cfg.max_tokens_per_microbatch, actor_cfg.optim, total_steps,
                         fused_logprob=actor_cfg.use_fused_logprob, temperature=temperature,
                         routing_replay=actor_cfg.moe.routing_replay, compare_routes=compare_routes)
        self.cfg = actor_cfg
        self.norm_length = norm_length

    def _loss_fn(self, mini: RolloutBatch, plan: MicroBatchPlan, tis_cap: float | None = None):
        cfg = self.cfg
        agg = _agg_options(plan, cfg.loss_agg_mode, self.norm_length)
        on_policy = mini.old_log_probs is None  # see updates_on_policy
        need_entropy = cfg.entropy_coeff != 0.0 or on_policy  # on-policy: also the step's entropy metric
        clip = policy_loss_options(cfg)

        def loss_fn(mb: PackedMicroBatch, output: torch.Tensor):
            if not mb.rows:  # a padding-only micro-batch of a DP rank with fewer cuts
                return (output.sum() * 0.0), {"rows": []}
            width = mb.gather_index.shape[1]
            rows = mb.rows
            take = partial(_slice, rows=rows, width=width, device=output.device)
            mask = take(mini.loss_mask)
            out = self._token_outputs(mb, output, need_entropy)
            old_log_probs = out["log_probs"].detach() if on_policy else take(mini.old_log_probs)
            advantages = take(mini.advantages)
            if tis_cap is not None:  # on-policy: the weights from this very forward (= a separate pass's)
                advantages = advantages * rollout_correction(old_log_probs, take(mini.engine_log_probs), mask,
                                                             tis_cap=tis_cap).token_weights
            policy = compute_policy_loss(cfg.policy_loss, out["log_probs"], old_log_probs, advantages,
                                         mask, agg_mode=cfg.loss_agg_mode, **clip, **agg)
            loss = policy.loss
            metrics = {f"actor/{k}": v for k, v in policy.metrics.items()}
            metrics["log_probs"] = out["log_probs"].detach()  # per token, for update_with_log_probs
            metrics["actor/pg_loss"] = policy.loss.detach()
            if cfg.kl_loss_coef > 0:
                kl = kl_penalty(cfg.kl_penalty, out["log_probs"], take(mini.ref_log_probs), mask)
                kl_loss = aggregate_loss(kl, mask, cfg.loss_agg_mode, **agg)
                loss = loss + cfg.kl_loss_coef * kl_loss
                metrics["actor/kl_loss"] = kl_loss.detach()
            if need_entropy:
                entropy = aggregate_loss(out["entropy"], mask, cfg.loss_agg_mode, **agg)
                loss = loss - cfg.entropy_coeff * entropy
                metrics["actor/entropy"] = entropy.detach()
            metrics["tokens"] = mask.sum().detach()
            return _undo_schedule_averaging(loss, plan), {"rows": rows, **metrics}

        return loss_fn

    def updates_on_policy(self, rows: int) -> bool:
        """Whether an update of `rows` rows is one optimizer step over all of them (one epoch, one
        mini-batch): the policy being updated is then the one that sampled the batch, its old
        log-probs are the update's own forward pass (detached; ratio exactly 1), and the separate
        log-prob pass can be skipped (update() accepts old_log_probs=None)."""
        return self.cfg.ppo_epochs == 1 and self.cfg.mini_batch_size >= rows

    def update(self, batch: RolloutBatch, tis_cap: float | None = None) -> dict[str, float]:
        """One PPO update; returns averaged metrics (same on every rank). `tis_cap`: an on-policy
        update (no old_log_probs, see updates_on_policy) weights each token's advantage by the
        truncated IS ratio of its own forward's log-probs to batch.engine_log_probs, the
        correction a separate log-prob pass would give, without the pass. With routes on the
        batch (routing replay), every forward of the update routes each token as recorded."""
        return self._update(batch, tis_cap, token_outputs=None)

    def update_with_log_probs(self, batch: RolloutBatch,
                              tis_cap: float | None = None) -> tuple[dict[str, float], torch.Tensor]:
        """`update`, and the log-probs of each row's first forward in it ([B, T]; on-policy the
        policy the batch was trained from)."""
        token_outputs: list[dict[str, Any]] = []
        metrics = self._update(batch, tis_cap, token_outputs)
        return metrics, gather_token_values(batch, token_outputs, "log_probs")

    def _update(self, batch: RolloutBatch, tis_cap: float | None, token_outputs: list | None) -> dict[str, float]:
        if batch.advantages is None:
            raise ValueError("actor update needs advantages on the batch")
        if tis_cap is not None and (batch.old_log_probs is not None or batch.engine_log_probs is None):
            raise ValueError("a correction inside the update (tis_cap) is for on-policy updates with engine_log_probs "
                             "on the batch; otherwise weight the advantages beforehand (rollout_correction)")
        if batch.old_log_probs is None and not self.updates_on_policy(batch.total_rows):
            raise ValueError(f"actor update needs old_log_probs on the batch: {batch.total_rows} rows take more than "
                             f"one optimizer step (actor.ppo_epochs={self.cfg.ppo_epochs}, "
                             f"actor.mini_batch_size={self.cfg.mini_batch_size})")
        if self.cfg.kl_loss_coef > 0 and batch.ref_log_probs is None:
            raise ValueError("actor.kl_loss_coef > 0 needs ref_log_probs on the batch")
        taps = self.megatron.router_taps
        if taps is not None:
            taps.reset_metrics()
        metrics = _run_updates(self.megatron, batch, self.cfg.ppo_epochs, self.cfg.mini_batch_size, self.max_tokens,
                               partial(self._loss_fn, tis_cap=tis_cap), prefix="actor", token_outputs=token_outputs,
                               replay_routes=self.routing_replay != "none", compare_routes=self.compare_routes)
        if taps is not None:
            metrics.update(taps.take_metrics())
        return metrics

    def _sft_loss_fn(self, mini: RolloutBatch, plan: MicroBatchPlan):
        agg = _agg_options(plan, "token-mean", None)

        def loss_fn(mb: PackedMicroBatch, output: torch.Tensor):
            if not mb.rows:
                return output.sum() * 0.0, {"rows": []}
            width = mb.gather_index.shape[1]
            mask = _slice(mini.loss_mask, mb.rows, width, output.device)
            log_probs = self._token_outputs(mb, output, False, temperature=1.0)["log_probs"]
            nll = aggregate_loss(-log_probs, mask, "token-mean", **agg)
            return _undo_schedule_averaging(nll, plan), {"rows": mb.rows, "sft/loss": nll.detach(),
                                                         "tokens": mask.sum()}

        return loss_fn

    def sft_update(self, batch: RolloutBatch) -> dict[str, float]:
        """One supervised optimizer step on the whole batch: token-mean NLL of the loss-mask tokens."""
        return _run_updates(self.megatron, batch, 1, batch.batch_size, self.max_tokens,
                            self._sft_loss_fn, prefix="sft")


class Critic:
    """Value model (LM trunk + [hidden -> 1] head) with the clipped value loss."""

    def __init__(self, critic_cfg, actor_cfg, arch: ModelArch, hf_dir: str | None, build: BuildOptions,
                 total_steps: int, norm_length: int | None = None) -> None:
        self.cfg = critic_cfg
        self.actor_cfg = actor_cfg
        self.norm_length = norm_length  # seq-mean-token-sum-norm's constant (the actor's)
        self.max_tokens = actor_cfg.max_tokens_per_microbatch
        self.megatron = MegatronModel(arch, hf_dir, replace(build, value_head=True), critic_cfg.optim, total_steps)

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        plan = _plan(batch, self.max_tokens)

        def loss_fn(mb: PackedMicroBatch, values: torch.Tensor):
            return torch.zeros(()), {"rows": mb.rows, "values": mb.unpack(values[..., 0])}

        return gather_token_values(batch, self.megatron.run(plan, loss_fn, forward_only=True), "values")

    def _loss_fn(self, mini: RolloutBatch, plan: MicroBatchPlan):
        mode = self.actor_cfg.loss_agg_mode
        # A constant length for seq-mean-token-sum-norm: a mini-batch's own width differs between
        # DP ranks holding different rows.
        if mode == "seq-mean-token-sum-norm" and self.norm_length is None and mini.dp_local:
            raise ValueError("Critic(norm_length=...) is needed for seq-mean-token-sum-norm on DP-local batches")
        length = self.norm_length or mini.input_ids.shape[1]
        agg = _agg_options(plan, mode, None if mode != "seq-mean-token-sum-norm" else length)

        def loss_fn(mb: PackedMicroBatch, values: torch.Tensor):
            if not mb.rows:
                return values.sum() * 0.0, {"rows": []}
            width = mb.gather_index.shape[1]
            rows = mb.rows
            take = partial(_slice, rows=rows, width=width, device=values.device)
            result = clipped_value_loss(mb.unpack(values[..., 0]), take(mini.values),
                                        take(mini.returns), take(mini.loss_mask),
                                        clip_range=self.cfg.cliprange_value, agg_mode=mode, **agg)
            metrics = {f"critic/{k}": v for k, v in result.metrics.items()}
            metrics["critic/vf_loss"] = result.loss.detach()
            metrics["tokens"] = take(mini.loss_mask).sum()
            return _undo_schedule_averaging(result.loss, plan), {"rows": rows, **metrics}

        return loss_fn

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        if batch.values is None or batch.returns is None:
            raise ValueError("critic update needs values (from compute_values) and returns on the batch")
        return _run_updates(self.megatron, batch, self.cfg.ppo_epochs, self.actor_cfg.mini_batch_size,
                            self.max_tokens, self._loss_fn, prefix="critic")


# Loss parts are globally normalized shares (they add up over micro-batches and DP ranks);
# every other metric is a per-micro-batch mean, averaged weighted by loss tokens.
_SHARE_METRICS = ("pg_loss", "kl_loss", "entropy", "vf_loss", "sft/loss")


def _run_updates(megatron: MegatronModel, batch: RolloutBatch, epochs: int, mini_size: int, max_tokens: int,
                 make_loss_fn, prefix: str, token_outputs: list | None = None,
                 replay_routes: bool = False, compare_routes: bool = False) -> dict[str, float]:
    """Optimizer steps over `epochs` x mini-batches; returns the metrics averaged over tokens
    (loss-like ones over steps). Per-token outputs of the loss (tensors [rows, T]) go to
    `token_outputs`, one {"rows", name: values} per micro-batch."""
    sums: dict[str, float] = {}
    grad_norms = []
    tokens = 0.0
    real = computed = 0  # this rank's sequence tokens and packed positions (padding included) run
    updates = skipped = 0
    start = time.perf_counter()
    for epoch in range(epochs):
        for batch_rows, mini in mini_batches(batch, mini_size):
            plan = _plan(mini, max_tokens)
            real += sum(int(mini.lengths[r]) for mb in plan.micro_batches for r in mb.rows)
            computed += len(plan.micro_batches) * plan.padded_length
            # Routes on the batch: each token takes them in every forward (routing replay), or
            # the router's own choices are counted against them (compare_routes).
            routes = None
            if mini.routes is not None and replay_routes:
                routes = RoutePass(replay=mini.routes)
            elif mini.routes is not None and compare_routes:
                routes = RoutePass(compare=mini.routes, compared_on=mini.loss_mask > 0)
            step = megatron.train_step(plan, make_loss_fn(mini, plan), routes)
            updates += 1
            if step["skipped"]:
                skipped += 1
            else:
                grad_norms.append(step["grad_norm"])
            for out in step["outputs"]:
                if not out["rows"]:
                    continue
                weight = float(out["tokens"])
                tokens += weight
                for key, value in out.items():
                    if isinstance(value, torch.Tensor) and value.dim() == 2:
                        if token_outputs is not None and epoch == 0:  # each row's first forward
                            token_outputs.append({"rows": [batch_rows[r] for r in out["rows"]], key: value})
                    elif key not in ("rows", "tokens"):
                        shared = key.endswith(_SHARE_METRICS)
                        sums[key] = sums.get(key, 0.0) + float(value) * (1.0 if shared else weight)
    ps = _parallel()
    keys = [sorted(sums)]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        last = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[-1]
        dist.broadcast_object_list(keys, src=last, group=ps.get_pipeline_model_parallel_group())
    if ps.get_data_parallel_world_size() > 1:  # a DP rank that held no rows has no metrics of its own
        every: list = [None] * ps.get_data_parallel_world_size()
        dist.all_gather_object(every, keys[0], group=ps.get_data_parallel_group())
        keys = [sorted(set().union(*every))]
    values = _from_last_stages(torch.tensor([sums.get(k, 0.0) for k in keys[0]] + [tokens, real, computed],
                                            dtype=torch.float64))
    total_tokens = float(values[-3])
    metrics = {k: float(v) / (updates if k.endswith(_SHARE_METRICS) else max(total_tokens, 1.0))
               for k, v in zip(keys[0], values[:-3])}
    # What the packing saves: sequence tokens vs positions computed (all steps, all DP ranks).
    metrics[f"{prefix}/real_tokens"], metrics[f"{prefix}/computed_tokens"] = float(values[-2]), float(values[-1])
    # Over the optimizer steps taken: a skipped one's norm is not finite (see MegatronModel.train_step).
    metrics[f"{prefix}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics[f"{prefix}/skipped_steps"] = float(skipped)
    metrics[f"{prefix}/lr"] = megatron.optimizer.param_groups[0]["lr"]
    metrics[f"{prefix}/tokens_per_s"] = total_tokens / (time.perf_counter() - start)
    return metrics
