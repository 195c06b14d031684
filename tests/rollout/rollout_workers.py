"""Rank bodies for the rollout/weight-sync tests (importable by spawned processes)."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch
import torch.distributed as dist

from rlfactory_megatron.actor.actor import Actor, PolicyModel
from rlfactory_megatron.config import load_config
from rlfactory_megatron.models.builder import BuildOptions
from rlfactory_megatron.models.hf_arch import load_arch
from rlfactory_megatron.rollout.engines import Generation, SamplingConfig, VLLMEngine
from rlfactory_megatron.rollout.weight_sync import InProcessTransport, WeightSyncError, sync_weights
from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed
from rlfactory_megatron.rollout.fleet import EngineFleet
from toy_rows import engine_batch

PROMPTS = [[5, 17, 42, 7], [100, 3, 9, 250, 11, 12], [61, 62], [300, 301, 302]]


def _generate_on_leader(engine, sampling):
    """Rank 0 generates; every rank receives the same generations."""
    payload = [engine.generate(PROMPTS, sampling) if engine is not None else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _leader_engine(hf_dir: str, ray_address: str | None, engine_tp: int = 1):
    """Rank 0's engine and transport: in this process, or in a Ray actor fed by broadcast (with
    `engine_tp` TP workers)."""
    if dist.get_rank() != 0:
        return None, None
    if ray_address is None:
        engine = VLLMEngine(hf_dir, max_model_len=128, max_num_seqs=8)
        return engine, InProcessTransport(engine)
    import ray

    from rlfactory_megatron.rollout.ray_engine import BroadcastTransport, RayVLLMEngine

    ray.init(address=ray_address, log_to_driver=False)
    engine = RayVLLMEngine(hf_dir, max_model_len=128, max_num_seqs=8, tensor_parallel_size=engine_tp)
    return engine, BroadcastTransport(engine)


class _WarningCount(logging.Handler):
    """Counts the warnings a logger (and its children) emit until closed."""

    def __init__(self, logger: str):
        super().__init__(logging.WARNING)
        self.logger, self.records = logging.getLogger(logger), []
        self.logger.addHandler(self)

    def emit(self, record):
        self.records.append(record.getMessage())

    def close(self):
        self.logger.removeHandler(self)
        return self.records


class _CutTransport:
    """Passes `buckets` buckets on to `transport`, then fails as a broken link would."""

    def __init__(self, transport, buckets: int):
        self.transport, self.left = transport, buckets

    @property
    def message_bytes(self):
        return self.transport.message_bytes

    def expected_weights(self):
        return self.transport.expected_weights()

    def send(self, bucket):
        if not self.left:
            raise ConnectionError("weight link went down")
        self.left -= 1
        self.transport.send(bucket)

    def finish(self):
        self.transport.finish()


def sync_worker(hf_dir: str, tp: int, pp: int, bucket_mb: float, steps: int = 1, break_sync: bool = False,
                ray_address: str | None = None, temperature: float = 1.0, cut_after_buckets: int | None = None,
                engine_tp: int = 1) -> dict:
    """Sync actor -> vLLM; compare vLLM's log-probs of its samples with the actor's, before/after updates."""
    init_distributed(ParallelSizes(tp, pp), seed=3)
    try:
        cfg = load_config(overrides=["actor.optim.lr=1e-3", "actor.optim.adam_eps=1e-4",
                                     "actor.max_tokens_per_microbatch=256", "actor.mini_batch_size=16"])
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10, temperature=temperature)
        engine, transport = _leader_engine(hf_dir, ray_address, engine_tp)
        initial = PolicyModel(arch, hf_dir, BuildOptions(), 256) if break_sync else None
        sampling = SamplingConfig(n=2, temperature=temperature, max_tokens=12, seed=11)
        report = {"max_diff": [], "mean_engine_lp": [], "sync": []}
        for step in range(steps + 1):
            if step > 0:  # an optimizer step, then a re-sync
                batch, engine_lp = engine_batch(PROMPTS, generations)
                batch = batch.with_fields(old_log_probs=engine_lp, advantages=torch.randn(batch.input_ids.shape))
                actor.update(batch)
                if break_sync and engine is not None:
                    real = engine.weight_names
                    engine.weight_names = lambda: {**real(), "model.layers.99.mlp.up_proj.weight": (256, 128)}
                if cut_after_buckets is not None:  # a sync cut short first: the engine must still serve
                    try:
                        sync_weights(actor.megatron, transport and _CutTransport(transport, cut_after_buckets), bucket_mb)
                    except ConnectionError as exc:
                        report["cut_error"] = str(exc)
                    report["served_after_cut"] = len(_generate_on_leader(engine, sampling) or [])
                warnings = _WarningCount("vllm.model_executor.model_loader.reload")
                try:
                    stats = sync_weights(actor.megatron, transport, bucket_mb)
                except WeightSyncError as exc:
                    report["sync_error"] = str(exc)
                    stats = None
                finally:
                    report["reload_warnings"] = warnings.close()
                if stats is not None:
                    report["sync"].append({"buckets": stats.buckets, "bytes": stats.bytes,
                                           "max_bucket_bytes": stats.max_bucket_bytes,
                                           "message_bytes": stats.message_bytes})
            generations = _generate_on_leader(engine, sampling)
            batch, engine_lp = engine_batch(PROMPTS, generations)
            actor_lp = actor.compute_log_probs(batch)["log_probs"]
            mask = batch.loss_mask > 0
            report["max_diff"].append((actor_lp - engine_lp)[mask].abs().max().item())
            report["mean_engine_lp"].append(engine_lp[mask].mean().item())
            if initial is not None:  # what the engine served before the refused sync
                initial_lp = initial.compute_log_probs(batch)["log_probs"]
                report.setdefault("max_diff_vs_initial", []).append((initial_lp - engine_lp)[mask].abs().max().item())
            if step == 0:
                report["first_generations"] = generations
                if temperature != 1.0:  # the same tokens' log-probs untempered: what a T-blind trainer would see
                    actor.temperature = 1.0
                    untempered = actor.compute_log_probs(batch)["log_probs"]
                    actor.temperature = temperature
                    report["max_diff_untempered"] = (untempered - engine_lp)[mask].abs().max().item()
        report["rank"] = dist.get_rank()
        if engine is not None:
            engine.close()
        return report
    finally:
        destroy_distributed()


class _UntouchedTransport:
    """Stand-in for the sending rank's broadcast transport: records every call (none may come)."""

    def __init__(self):
        self.calls, self.served_version = [], 0

    def __getattr__(self, name):
        self.calls.append(name)
        raise AssertionError(f"transport.{name} called by a refused sync")


class _SenderThatCannotReplace:
    """The fleet's state EngineFleet.update_weights reads, on a disaggregated run: rank 0 holds the
    pool and the transport; its replacement of a dead engine fails with `refusal`."""

    def __init__(self, cfg, refusal: str):
        self.cfg, self.output, self._loop_thread, self.router = cfg, "unused", None, None
        sender = dist.get_rank() == 0
        self.pool = ["engine 0"] if sender else []
        self.transport = _UntouchedTransport() if sender else None
        self.refusal = refusal

    def _replace_failed_engines(self):
        raise RuntimeError(self.refusal)


def refused_sync_worker(hf_dir: str, refusal: str) -> dict:
    """EngineFleet.update_weights on two data-parallel ranks whose sender cannot replace its engines: every
    rank must raise the sender's reason, not wait in the export's collectives."""
    init_distributed(ParallelSizes(1, 1), seed=3, timeout_s=60)
    try:
        cfg = load_config(overrides=["actor.max_tokens_per_microbatch=256"])
        actor = Actor(cfg.actor, load_arch(hf_dir), hf_dir, BuildOptions(), total_steps=10)
        fleet = _SenderThatCannotReplace(cfg, refusal)
        report = {"rank": dist.get_rank()}
        try:
            EngineFleet.update_weights(fleet, actor.megatron, version=1)
        except WeightSyncError as exc:
            report["error"] = str(exc)
        if fleet.transport is not None:
            report["transport_calls"] = fleet.transport.calls
            report["served_version"] = fleet.transport.served_version
        return report
    finally:
        destroy_distributed()


class SignallingEngine:
    """`engine` whose step sets `reached` (in the event loop running it) once it has made `after`
    steps, so that a test acts while requests are mid-decode."""

    def __init__(self, engine, after: int):
        import asyncio

        self.engine, self.after, self.steps = engine, after, 0
        self.loop = asyncio.get_running_loop()
        self.reached = asyncio.Event()

    def step(self):
        finished = self.engine.step()
        self.steps += 1
        if self.steps == self.after:
            self.loop.call_soon_threadsafe(self.reached.set)
        return finished

    def __getattr__(self, name):  # submit, abort, interrupt
        return getattr(self.engine, name)


def sync_mid_decode_worker(hf_dir: str) -> dict:
    """Partial rollout's weight update between two decode steps: a request is cut after a few
    steps, the actor's new weights are synced in, and it goes on. The engine's log-probs of its
    tokens vs the policy that generated each: the initial one before the cut, the actor after."""
    import asyncio

    from rlfactory_megatron.rollout.fronts import StreamingFront
    from rlfactory_megatron.rollout.router import EngineRouter

    init_distributed(ParallelSizes(1, 1), seed=3)
    try:
        cfg = load_config(overrides=["actor.optim.lr=1e-3", "actor.optim.adam_eps=1e-4",
                                     "actor.max_tokens_per_microbatch=256", "actor.mini_batch_size=16"])
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(), total_steps=10)
        initial = PolicyModel(arch, hf_dir, BuildOptions(), 256)
        engine = VLLMEngine(hf_dir, max_model_len=128, max_num_seqs=8)
        transport = InProcessTransport(engine)
        generations = engine.generate(PROMPTS, SamplingConfig(n=2, max_tokens=12, seed=11))
        batch, engine_lp = engine_batch(PROMPTS, generations)
        actor.update(batch.with_fields(old_log_probs=engine_lp, advantages=torch.randn(batch.input_ids.shape)))

        async def generate_across_the_update():
            stepped = SignallingEngine(engine, after=6)
            router = EngineRouter([StreamingFront(stepped)])
            session = router.session()
            try:
                request = asyncio.ensure_future(session.generate(PROMPTS[1], SamplingConfig(max_tokens=60, seed=5)))
                await stepped.reached.wait()
                await router.pause(interrupt=True)
                cut_before_done = not request.done()
                await asyncio.to_thread(sync_weights, actor.megatron, transport, 0.5, version=1)
                await router.resume(transport.served_version)
                ids, log_probs = await request
                return ids, log_probs, session.calls, cut_before_done
            finally:
                await router.fronts[0].close()

        ids, log_probs, calls, cut_before_done = asyncio.run(generate_across_the_update())
        batch, engine_lp = engine_batch([PROMPTS[1]], [[Generation(ids, log_probs)]])
        start = len(PROMPTS[1])
        before = calls[0][2]
        gaps = {}
        for name, policy in (("initial", initial), ("actor", actor)):
            gap = (policy.compute_log_probs(batch)["log_probs"] - engine_lp)[0, start:start + len(ids)].abs()
            gaps[name] = (gap[:before].max().item(), gap[before:].max().item())
        engine.close()
        return {"calls": calls, "tokens": len(ids), "gaps": gaps, "cut_before_done": cut_before_done}
    finally:
        destroy_distributed()


def moe_sync_worker(hf_dir: str, ep: int, fresh_dir: str) -> dict:
    """A MoE actor with its experts over `ep` ranks: one update, a sync into rank 0's engine (in
    0.1 MB buckets), then the same seeded requests on that engine and on a fresh one started from
    the actor's weights written as a HF folder."""
    from rlfactory_megatron.models.builder import MoEOptions
    from rlfactory_megatron.models.hf_checkpoint import write_hf_folder

    init_distributed(ParallelSizes(ep=ep), seed=3)
    try:
        cfg = load_config(overrides=["actor.optim.lr=1e-3", "actor.optim.adam_eps=1e-4",
                                     "actor.max_tokens_per_microbatch=256", "actor.mini_batch_size=16"])
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(moe=MoEOptions(**cfg.model.moe)), total_steps=10)
        engine, transport = _leader_engine(hf_dir, None)
        sampling = SamplingConfig(n=2, max_tokens=12, seed=11)
        seeds = list(range(len(PROMPTS)))
        generations = _generate_on_leader(engine, sampling)
        batch, engine_lp = engine_batch(PROMPTS, generations)
        actor.update(batch.with_fields(old_log_probs=engine_lp, advantages=torch.randn(batch.input_ids.shape)))
        stats = sync_weights(actor.megatron, transport, 0.1)
        write_hf_folder(actor.megatron.iter_hf_weights(), fresh_dir, hf_dir, arch.hf_config, writer=dist.get_rank() == 0)
        synced = [engine.generate(PROMPTS, sampling, seeds) if engine is not None else None]
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(synced, src=0)
        batch, synced_lp = engine_batch(PROMPTS, synced[0])
        actor_lp = actor.compute_log_probs(batch)["log_probs"]
        report = {"rank": dist.get_rank(), "synced": synced[0],
                  "actor_gap": (actor_lp - synced_lp)[batch.loss_mask > 0].abs().max().item()}
        if engine is not None:
            engine.close()
            fresh = VLLMEngine(fresh_dir, max_model_len=128, max_num_seqs=8)
            report.update(fresh=fresh.generate(PROMPTS, sampling, seeds), buckets=stats.buckets)
            fresh.close()
        return report
    finally:
        destroy_distributed()


def engine_routes_worker(hf_dir: str) -> dict:
    """A MoE engine recording its routes (R3's hook): its samples, with the experts it routed each
    token to, replayed in the actor (R2's replay, fed the engine's routes instead of its own)."""
    from rlfactory_megatron.actor.routing import NO_ROUTE
    from rlfactory_megatron.models.builder import MoEOptions

    init_distributed(ParallelSizes(), seed=3)
    try:
        cfg = load_config(overrides=["actor.max_tokens_per_microbatch=64", "actor.mini_batch_size=16",
                                     "actor.moe.routing_replay=R2"])
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(moe=MoEOptions(**cfg.model.moe)), total_steps=10)
        engine = VLLMEngine(hf_dir, max_model_len=128, max_num_seqs=8, record_routes=True)
        generations = engine.generate(PROMPTS, SamplingConfig(n=2, max_tokens=12, seed=11))
        batch, engine_lp = engine_batch(PROMPTS, generations)
        samples = [g for gens in generations for g in gens]
        # aligned like the log-probs: at token t the routes of position t - 1, which predicts it
        routes = torch.full((*batch.input_ids.shape, arch.num_layers, arch.moe.top_k), NO_ROUTE,
                            dtype=torch.int16)
        for row, sample in enumerate(samples):
            routes[row, 1: 1 + len(sample.routes)] = torch.from_numpy(sample.routes)
        own = actor.compute_log_probs(batch)
        replayed = batch.with_fields(old_log_probs=own["log_probs"], ref_log_probs=own["log_probs"],
                                     routes=routes, advantages=torch.randn(batch.input_ids.shape))
        metrics, first_forward = actor.update_with_log_probs(replayed)
        mask = batch.loss_mask > 0
        # rollout.record_routes under none: a model that compares its router with the engine's
        # routes and takes its own; routes shifted by one expert agree nowhere, and change nothing.
        watcher = PolicyModel(arch, hf_dir, BuildOptions(moe=MoEOptions(**cfg.model.moe)), 64, compare_routes=True)
        shifted = torch.where(routes >= 0, (routes + 1) % arch.moe.num_experts, routes)
        compared = {name: watcher.compute_log_probs(batch.with_fields(routes=these))
                    for name, these in (("engine", routes), ("shifted", shifted))}
        # The streaming path (submit / step, as the agent loop's front drives it) takes the same routes.
        single = SamplingConfig(n=1, max_tokens=12)
        whole = [gens[0] for gens in engine.generate(PROMPTS, single, seeds=[21, 22, 23, 24])]
        for index, prompt in enumerate(PROMPTS):
            engine.submit(f"stream-{index}", prompt, dataclasses.replace(single, seed=21 + index))
        streamed = {}
        while len(streamed) < len(PROMPTS):
            streamed.update(engine.step())
        streamed = [streamed[f"stream-{index}"] for index in range(len(PROMPTS))]
        engine.close()
        return {"streamed_equal": [(a.token_ids == b.token_ids and np.array_equal(a.routes, b.routes)
                                    and (a.routes >= 0).all()) for a, b in zip(whole, streamed)],
                "routes": routes, "own_routes": own["routes"], "mask": mask, "metrics": metrics,
                "replayed_gap": (first_forward - engine_lp)[mask].abs().max().item(),
                "compared": {name: (c["routing_agreement"], torch.equal(c["log_probs"], own["log_probs"]))
                             for name, c in compared.items()},
                "shapes": [s.routes.shape for s in samples], "lengths": batch.lengths.tolist()}
    finally:
        destroy_distributed()
