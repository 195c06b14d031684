"""Rank bodies for the actor/critic tests (importable by spawned processes)."""
from __future__ import annotations

import torch

from rlfactory_megatron.actor.actor import Actor, Critic
from rlfactory_megatron.config import load_config
from rlfactory_megatron.models.builder import RECOMPUTE, BuildOptions, MoEOptions
from rlfactory_megatron.models.hf_arch import load_arch
from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed
from toy_rows import random_batch, toy_batch


def actor_config(**overrides):
    # adam_eps 1e-4: with the default 1e-8 Adam turns ~1e-10 rounding noise in near-zero gradients
    # into lr-sized steps, which would make layouts differ by rounding alone.
    base = {"actor.optim.lr": 1e-3, "actor.optim.adam_eps": 1e-4, "actor.optim.clip_grad": 100.0, "actor.mini_batch_size": 6,
            "actor.max_tokens_per_microbatch": 64, "actor.kl_loss_coef": 0.1, "actor.entropy_coeff": 0.01}
    base.update(overrides)
    return load_config(overrides=[f"{k}={v}" for k, v in base.items()])


def update_worker(hf_dir: str, tp: int, pp: int, overrides: dict, perturb_masked: bool = False,
                  checkpoint: str | None = None, resume_from: str | None = None, layer_spec: str = "auto",
                  cp: int = 1, ep: int = 1) -> dict:
    """Build an actor, compute old/ref log-probs, run one update (+ a second after save/load)."""
    init_distributed(ParallelSizes(tp, pp, cp=cp, ep=ep), seed=7)
    try:
        cfg = actor_config(**overrides)
        arch = load_arch(hf_dir)
        build = BuildOptions(layer_spec=layer_spec, moe=MoEOptions(**cfg.model.moe))
        actor = Actor(cfg.actor, arch, hf_dir, build, total_steps=10)
        batch = random_batch(arch.vocab_size)
        old = actor.compute_log_probs(batch, with_entropy=True)
        batch = batch.with_fields(old_log_probs=old["log_probs"] - 0.05, ref_log_probs=old["log_probs"] + 0.1)
        if perturb_masked:
            junk = torch.randn(batch.input_ids.shape) * 5
            off = batch.loss_mask == 0
            batch = batch.with_fields(old_log_probs=torch.where(off, junk, batch.old_log_probs),
                                      advantages=torch.where(off, junk, batch.advantages),
                                      ref_log_probs=torch.where(off, junk, batch.ref_log_probs))
        if resume_from is not None:
            actor.megatron.load(resume_from)
        metrics = actor.update(batch)
        if checkpoint is not None:
            actor.megatron.save(checkpoint)
            metrics = actor.update(batch)
        weights = dict(actor.megatron.iter_hf_weights())
        optimizers = getattr(actor.megatron.optimizer, "chained_optimizers", [actor.megatron.optimizer])
        return {"metrics": metrics, "weights": weights if torch.distributed.get_rank() == 0 else None,
                "old_log_probs": old["log_probs"], "entropy": old["entropy"],
                "optimizer": type(optimizers[0]).__name__,
                "expert_weights": sum(".local_experts." in name for chunk in actor.megatron.chunks
                                      for name, _ in chunk.named_parameters()),
                "parameters": sum(p.numel() for chunk in actor.megatron.modules() for p in chunk.parameters())}
    finally:
        destroy_distributed()


def on_policy_worker(hf_dir: str, tp: int, pp: int, mini_batch_size: int) -> dict:
    """The same update twice from the same start: with old log-probs from a separate forward pass,
    and with none (the update's own, detached); and whether the second form is refused."""
    init_distributed(ParallelSizes(tp, pp), seed=7)
    try:
        cfg = actor_config(**{"actor.kl_loss_coef": 0.0, "actor.entropy_coeff": 0.0,
                              "actor.mini_batch_size": mini_batch_size})
        arch = load_arch(hf_dir)
        out = {}
        for name in ("separate_pass", "own_forward"):
            actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10)
            batch = random_batch(arch.vocab_size)
            if name == "separate_pass":
                old = actor.compute_log_probs(batch, with_entropy=True)
                batch = batch.with_fields(old_log_probs=old["log_probs"])
                out["entropy_old"] = float(old["entropy"][batch.loss_mask > 0].mean())
                out["old_log_probs"] = old["log_probs"]
            try:
                metrics, update_log_probs = actor.update_with_log_probs(batch)
            except ValueError as err:
                out[name] = {"error": str(err)}
                continue
            out[name] = {"metrics": metrics, "weights": dict(actor.megatron.iter_hf_weights())}
            if name == "own_forward":
                out[name]["update_log_probs"] = update_log_probs
        out["on_policy"] = actor.updates_on_policy(batch.batch_size)
        if out["on_policy"]:
            out.update(_corrected_updates(cfg, arch, hf_dir))
        return out
    finally:
        destroy_distributed()


def _corrected_updates(cfg, arch, hf_dir: str) -> dict:
    """A token IS correction (cap 1.2) against engine log-probs off the trainer's, applied to the
    advantages before an update with a separate pass, and inside an on-policy update."""
    from rlfactory_megatron.algorithms.rollout_correction import rollout_correction

    out = {}
    for name in ("tis_before_update", "tis_in_update"):
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10)
        batch = random_batch(arch.vocab_size)
        old = actor.compute_log_probs(batch)["log_probs"]
        shift = 0.4 * torch.sin(torch.arange(old.numel(), dtype=torch.float32)).reshape(old.shape)
        engine = (old + shift) * batch.loss_mask  # an engine whose policy is not quite the trainer's
        if name == "tis_before_update":
            weights = rollout_correction(old, engine, batch.loss_mask, tis_cap=1.2).token_weights
            metrics = actor.update(batch.with_fields(old_log_probs=old, advantages=batch.advantages * weights))
        else:
            metrics = actor.update(batch.with_fields(engine_log_probs=engine), tis_cap=1.2)
        out[name] = {"metrics": metrics, "weights": dict(actor.megatron.iter_hf_weights())}
    return out


def sft_worker(hf_dir: str, temperature: float) -> dict:
    """The NLL an SFT step reports, and the same NLL from log-probs at temperature 1 (the model's own)."""
    init_distributed(ParallelSizes(1, 1), seed=7)
    try:
        cfg = actor_config()
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10, temperature=temperature)
        batch = random_batch(arch.vocab_size)
        mask = batch.loss_mask > 0
        actor.temperature = 1.0
        nll_t1 = -float(actor.compute_log_probs(batch)["log_probs"][mask].mean())
        actor.temperature = temperature
        nll_tempered = -float(actor.compute_log_probs(batch)["log_probs"][mask].mean())
        metrics = actor.sft_update(batch)
        return {"sft_loss": metrics["sft/loss"], "nll_t1": nll_t1, "nll_tempered": nll_tempered}
    finally:
        destroy_distributed()


def critic_worker(hf_dir: str, tp: int, pp: int, sequence_parallel: bool = False) -> dict:
    init_distributed(ParallelSizes(tp, pp), seed=7)
    try:
        cfg = actor_config(**{"critic.optim.lr": 1e-4})
        arch = load_arch(hf_dir)
        critic = Critic(cfg.critic, cfg.actor, arch, hf_dir, BuildOptions(sequence_parallel=sequence_parallel),
                        total_steps=10)
        batch = random_batch(arch.vocab_size)
        values = critic.compute_values(batch)
        returns = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
        batch = batch.with_fields(values=values, returns=returns)
        metrics = critic.update(batch)
        after = critic.compute_values(batch)
        return {"metrics": metrics, "values": values, "after": after}
    finally:
        destroy_distributed()


def non_finite_worker(hf_dir: str, tp: int, pp: int, poison: str) -> dict:
    """One update whose advantages (or old log-probs) hold a NaN on a trained token, then a clean
    one: the first must leave every weight as it was, the second must move them."""
    from rlfactory_megatron.actor.model import NonFiniteError

    init_distributed(ParallelSizes(tp, pp), seed=7)
    try:
        cfg = actor_config(**{"actor.kl_loss_coef": 0.0})
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10)
        batch = random_batch(arch.vocab_size)
        batch = batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"])
        field = {"advantage": "advantages", "old_log_prob": "old_log_probs"}[poison]
        bad = getattr(batch, field).clone()
        bad[1, 5] = float("nan")
        before = {k: v.clone() for k, v in actor.megatron.iter_hf_weights()}
        lr_before = actor.megatron.optimizer.param_groups[0]["lr"]
        skipped = actor.update(batch.with_fields(**{field: bad}))
        after_skip = dict(actor.megatron.iter_hf_weights())
        unchanged = all(torch.equal(before[k], after_skip[k]) for k in before)
        in_a_row = actor.megatron.skipped_in_a_row
        actor.megatron.check_finite("the test's sync")
        taken = actor.update(batch)
        moved = max((v - before[k]).abs().max().item() for k, v in actor.megatron.iter_hf_weights())
        # Poisoned weights are refused before they are served or saved.
        next(p for p in actor.megatron.modules()[0].parameters()).data[0].fill_(float("nan"))
        try:
            actor.megatron.check_finite("the weight sync")
            refused = ""
        except NonFiniteError as exc:
            refused = str(exc)
        return {"skipped": skipped["actor/skipped_steps"], "unchanged": unchanged, "in_a_row": in_a_row,
                "lr_kept": actor.megatron.optimizer.param_groups[0]["lr"] == lr_before,
                "taken": taken["actor/skipped_steps"], "moved": moved, "reset": actor.megatron.skipped_in_a_row,
                "refused": refused}
    finally:
        destroy_distributed()


def dp_local_update_worker(hf_dir: str, mini_batch_size: int) -> dict:
    """update_worker's update with each DP rank holding only the rows it trains on
    (`dp_row_owners`), as the trainer hands them: a DP-local batch."""
    from megatron.core import parallel_state

    from rlfactory_megatron.actor.batch import dp_row_owners

    init_distributed(ParallelSizes(1, 1), seed=7)
    try:
        cfg = actor_config(**{"actor.mini_batch_size": mini_batch_size})
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10)
        full = random_batch(arch.vocab_size)
        owners = dp_row_owners(full.lengths.tolist(), mini_batch_size, parallel_state.get_data_parallel_world_size())
        mine = [row for row, owner in enumerate(owners) if owner == parallel_state.get_data_parallel_rank()]
        batch = full.with_fields(step_rows=torch.arange(full.batch_size), step_size=full.batch_size).select(mine)
        old = actor.compute_log_probs(batch, with_entropy=True)
        batch = batch.with_fields(old_log_probs=old["log_probs"] - 0.05, ref_log_probs=old["log_probs"] + 0.1)
        metrics = actor.update(batch)
        weights = dict(actor.megatron.iter_hf_weights())
        return {"metrics": metrics, "weights": weights if torch.distributed.get_rank() == 0 else None,
                "rows": mine, "old_log_probs": old["log_probs"]}
    finally:
        destroy_distributed()


def offload_worker(hf_dir: str, tp: int, pp: int, dtype: str, distributed_optimizer: bool,
                   round_trips: tuple[str, ...]) -> dict:
    """Twins of each model in `round_trips` (actor, critic, reference) from the same start: one
    goes to host memory and back between two updates, the other stays. Returns, per model,
    whether the offload emptied every device storage, whether everything came back bit for bit,
    and whether the next update matched the twin's; and the actor's and the critic's parameters
    on this rank against the memory plan's count."""
    from megatron.core import parallel_state

    from rlfactory_megatron.actor.actor import PolicyModel
    from rlfactory_megatron.actor.offload import megatron_state

    init_distributed(ParallelSizes(tp, pp), seed=7)
    try:
        cfg = actor_config(**{"actor.optim.use_distributed_optimizer": distributed_optimizer,
                              "critic.optim.use_distributed_optimizer": distributed_optimizer, "critic.optim.lr": 1e-4})
        arch = load_arch(hf_dir)
        build = BuildOptions(params_dtype=dtype)
        batch = random_batch(arch.vocab_size)
        returns = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(3))

        def build_model(name):
            if name == "actor":
                return Actor(cfg.actor, arch, hf_dir, build, total_steps=10)
            if name == "critic":
                torch.manual_seed(0)  # the value head starts random: twins alike
                return Critic(cfg.critic, cfg.actor, arch, hf_dir, build, total_steps=10)
            return PolicyModel(arch, hf_dir, build, 64)

        def forward(name, model) -> torch.Tensor:
            return model.compute_values(batch) if name == "critic" else model.compute_log_probs(batch)["log_probs"]

        def train(name, model) -> torch.Tensor:
            if name == "actor":
                old = forward(name, model)
                model.update(batch.with_fields(old_log_probs=old - 0.05, ref_log_probs=old + 0.1))
            elif name == "critic":
                model.update(batch.with_fields(values=forward(name, model), returns=returns))
            return forward(name, model)

        def snapshot(engine) -> list[torch.Tensor]:
            state = megatron_state(engine.chunks, engine.optimizer)
            return [t.detach().clone() for kind in ("params", "optimizer") for t in state.get(kind, ())]

        def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
            return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))

        out = {}
        for name in round_trips:
            moved, kept = build_model(name), build_model(name)
            for model in (moved, kept):
                train(name, model)  # Adam's moments exist from here on
            engine, before = moved.megatron, snapshot(moved.megatron)
            result = {"bytes": engine.host.resident_bytes()}
            engine.offload(keep_params=True)
            result["kept_params"] = engine.host.resident_bytes(("params",)) == kept.megatron.host.resident_bytes(("params",))
            result["freed_rest"] = engine.host.resident_bytes(("grads", "optimizer")) == 0
            result["freed"] = engine.offload() > 0 and engine.host.resident_bytes() == 0
            forward(name, moved)  # a forward pass brings the parameters back alone; an update the rest
            result["params_only"] = engine.host.resident_bytes(("params",)) > 0 and (
                name == "reference" or engine.host.offloaded("optimizer"))
            engine.host.onload()
            result["exact"] = same(before, snapshot(engine))
            result["next_update_same"] = (torch.equal(train(name, moved), train(name, kept))
                                          and same(snapshot(engine), snapshot(kept.megatron)))
            out[name] = result
        stage = parallel_state.get_pipeline_model_parallel_rank()
        out["parameters"] = {
            name: (sum(p.numel() for module in build_model(name).megatron.modules() for p in module.parameters()),
                   arch.parameter_count(tp, pp, stage, value_head=name == "critic")) for name in ("actor", "critic")}
        return out
    finally:
        destroy_distributed()


def saved_activations_worker(hf_dir: str, tokens: int, cp: int = 1) -> dict:
    """Bytes the actor's update keeps for its backward pass (every tensor autograd saves, the
    parameters aside) on one micro-batch of exactly `tokens` tokens (this rank's share of it
    under context parallelism), against the memory plan's activation term (its per-layer count;
    the log-prob's transient buffers aside)."""
    from rlfactory_megatron.kernels.logprob.fused import default_chunk_size
    from rlfactory_megatron.trainer.memory_plan import _activations

    init_distributed(ParallelSizes(cp=cp), seed=7)
    try:
        cfg = load_config(overrides=[f"actor.max_tokens_per_microbatch={tokens}", "actor.mini_batch_size=2",
                                     "actor.kl_loss_coef=0", f"parallel.cp={cp}"])
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=4)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, arch.vocab_size, (2, tokens // 2), generator=gen).tolist()
        batch = toy_batch([row[:4] for row in ids], [row[4:] for row in ids])
        batch = batch.with_fields(advantages=torch.randn(2, tokens // 2, generator=gen))
        batch = batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"])
        params = {p.untyped_storage().data_ptr() for module in actor.megatron.modules() for p in module.parameters()}
        saved: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            actor.update(batch)
        vocab = arch.padded_vocab_size(1)
        buffers = 2 * min(default_chunk_size(vocab), tokens // cp) * vocab * 4  # transient, not saved
        return {"saved": sum(saved.values()), "planned": _activations(cfg, arch, 0, 4).bytes - buffers}
    finally:
        destroy_distributed()


def context_parallel_worker(hf_dir: str, tp: int, cp: int, distributed_optimizer: bool) -> dict:
    """On random_batch's packed multi-turn rows (tool tokens masked): the logits of every trained
    token, the actor's gradients of one PPO update (KL and entropy terms, a sequence-level
    aggregation), the critic's values and the gradients of its update, as this rank's TP shard.
    With the distributed optimizer a rank's main_grad is whole only in its own shard."""
    from rlfactory_megatron.actor.actor import PolicyModel, _plan

    init_distributed(ParallelSizes(tp, 1, cp=cp), seed=7)
    try:
        cfg = actor_config(**{"actor.loss_agg_mode": "seq-mean-token-mean", "critic.optim.lr": 1e-4,
                              "actor.optim.use_distributed_optimizer": distributed_optimizer,
                              "critic.optim.use_distributed_optimizer": distributed_optimizer})
        arch = load_arch(hf_dir)
        batch = random_batch(arch.vocab_size)
        # Vocab-parallel logits of every position, as the model's last stage returns them (no fused log-prob).
        policy = PolicyModel(arch, hf_dir, BuildOptions(), cfg.actor.max_tokens_per_microbatch, fused_logprob=False)
        logits = torch.zeros(*batch.input_ids.shape, arch.padded_vocab_size(tp) // tp)

        def keep_logits(mb, output):
            whole = output[0] if mb.context is None else mb.context.gather(output[0])
            logits[mb.rows, : mb.gather_index.shape[1]] = (whole[mb.gather_index] * mb.token_valid[..., None]).cpu()
            return torch.zeros(()), {"rows": mb.rows}

        policy.megatron.run(_plan(batch, cfg.actor.max_tokens_per_microbatch), keep_logits, forward_only=True)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10)
        old = actor.compute_log_probs(batch, with_entropy=True)
        batch = batch.with_fields(old_log_probs=old["log_probs"] - 0.05, ref_log_probs=old["log_probs"] + 0.1)
        metrics = actor.update(batch)
        torch.manual_seed(0)  # the value head starts random: alike in every run
        critic = Critic(cfg.critic, cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10)
        values = critic.compute_values(batch)
        returns = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(3))
        critic_metrics = critic.update(batch.with_fields(values=values, returns=returns))

        def gradients(engine):
            # What the update's optimizer step applied: the DP x CP all-reduced gradients it leaves in main_grad.
            return {name: p.main_grad.detach().clone() for name, p in engine.modules()[0].named_parameters()}

        return {"logits": logits, "log_probs": old["log_probs"], "entropy": old["entropy"], "metrics": metrics,
                "actor_grads": gradients(actor.megatron), "values": values, "critic_metrics": critic_metrics,
                "critic_grads": gradients(critic.megatron)}
    finally:
        destroy_distributed()


def loss_scale_worker(hf_dir: str) -> dict:
    """One update of the same actor in float32 and in float16 (megatron's fp16 optimizer with its
    dynamic loss scale): grad norm, loss scale and how far the weights moved, per dtype."""
    init_distributed(ParallelSizes(1, 1), seed=7)
    try:
        cfg = actor_config(**{"actor.kl_loss_coef": 0.0})
        arch = load_arch(hf_dir)
        out = {}
        for dtype in ("float32", "float16"):
            actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(params_dtype=dtype), total_steps=10)
            batch = random_batch(arch.vocab_size)
            before = {k: v.float() for k, v in actor.megatron.iter_hf_weights()}
            old = actor.compute_log_probs(batch)["log_probs"]
            metrics = actor.update(batch.with_fields(old_log_probs=old - 0.05))
            moved = max((v.float() - before[k]).abs().max().item() for k, v in actor.megatron.iter_hf_weights())
            out[dtype] = {"grad_norm": metrics["actor/grad_norm"], "skipped": metrics["actor/skipped_steps"],
                          "loss_scale": float(actor.megatron.optimizer.get_loss_scale()), "moved": moved}
        return out
    finally:
        destroy_distributed()


def recompute_worker(hf_dir: str) -> dict:
    """One update of the same actor under each model.recompute (megatron's selective and full
    recompute save and restore every RNG state): grad norm, loss and weights after."""
    init_distributed(ParallelSizes(1, 1), seed=7)
    try:
        cfg = actor_config(**{"actor.kl_loss_coef": 0.0})
        arch = load_arch(hf_dir)
        out = {}
        for recompute in RECOMPUTE:
            actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(recompute=recompute), total_steps=10)
            batch = random_batch(arch.vocab_size)
            old = actor.compute_log_probs(batch)["log_probs"]
            metrics = actor.update(batch.with_fields(old_log_probs=old - 0.05))
            out[recompute] = {"grad_norm": metrics["actor/grad_norm"], "pg_loss": metrics["actor/pg_loss"],
                              "weights": {k: v.clone() for k, v in actor.megatron.iter_hf_weights()}}
        return out
    finally:
        destroy_distributed()


def routing_replay_worker(hf_dir: str, pp: int, recompute: bool, mini_batch_size: int = 3,
                          layer_spec: str = "auto", ep: int = 1) -> dict:
    """Routing replay (actor.moe.routing_replay=R2) at a layout: the old-log-prob pass's routes,
    then two updates from the same start over 2 mini-batches: replaying the recorded routes, and
    replaying routes no router would choose (each recorded expert + 1), which only a replay
    keyed by micro-batch and layer applies alike at every layout. `ep`: as many data-parallel
    ranks, each holding experts / ep."""
    init_distributed(ParallelSizes(1, pp, ep=ep), seed=7)
    try:
        cfg = actor_config(**{"actor.moe.routing_replay": "R2", "actor.mini_batch_size": mini_batch_size,
                              "actor.max_tokens_per_microbatch": 32})
        arch = load_arch(hf_dir)
        build = BuildOptions(layer_spec=layer_spec, recompute="full" if recompute else "none", moe=MoEOptions(**cfg.model.moe))
        out = {}
        for name in ("recorded", "shifted"):
            actor = Actor(cfg.actor, arch, hf_dir, build, total_steps=10)
            batch = random_batch(arch.vocab_size)
            old = actor.compute_log_probs(batch)
            routes = old["routes"]
            if name == "shifted":
                routes = torch.where(routes >= 0, (routes + 1) % arch.moe.num_experts, routes)
            batch = batch.with_fields(old_log_probs=old["log_probs"], ref_log_probs=old["log_probs"], routes=routes)
            metrics, first_forward = actor.update_with_log_probs(batch)
            out[name] = {"metrics": metrics, "update_log_probs": first_forward, "old_log_probs": old["log_probs"],
                         "routes": old["routes"]}
        return out
    finally:
        destroy_distributed()
