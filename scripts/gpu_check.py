"""GPU-only checks that the CPU suite cannot run: one pass/fail (or skip) line per check, exit 1 if any fails.

Run by scripts/gpu_check.sh on a machine with one CUDA GPU and the GPU stack (./install.sh --gpu).
Each check builds what it needs on a tiny random-weight model made here (no downloads).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


@check
def cuda_and_nccl(ctx):
    import torch
    import torch.distributed as dist

    from megatron.core import parallel_state

    assert torch.cuda.is_available(), "no CUDA device"
    tensor = torch.ones(4, device="cuda")
    dist.all_reduce(tensor)
    assert "nccl" in dist.get_backend() and tensor.sum().item() == 4
    # The trainer's host-tensor reductions (plan shapes, metrics) on megatron's groups: gloo.
    host = torch.ones(2, dtype=torch.float64)
    dist.all_reduce(host, group=parallel_state.get_data_parallel_group())
    assert host.device.type == "cpu" and host.sum().item() == 2
    return f"{torch.cuda.get_device_name(0)}, backend {dist.get_backend()}, world of {dist.get_world_size()}"


@check
def triton_logprob_kernel(ctx):
    import torch

    from rlfactory_megatron.kernels.logprob import fused_logprob_entropy

    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, 512, 128, device="cuda", generator=gen)
    weight = torch.randn(1000, 128, device="cuda", generator=gen) * 0.05
    targets = torch.randint(0, 1000, (1, 512), device="cuda", generator=gen)
    lp, _ = fused_logprob_entropy(hidden, weight, targets, impl="triton", vocab_size=1000)
    logits = (hidden.float() @ weight.float().T)
    ref = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    diff = (lp - ref).abs().max().item()
    assert diff < 1e-3, f"log-prob differs by {diff}"
    return f"max |diff| {diff:.1e}"


@check
def engine_sleep_frees_memory_and_wakes(ctx):
    import torch

    from rlfactory_megatron.rollout.engines import SamplingConfig

    engine = ctx.engine()
    sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=3)
    before = engine.generate([[5, 6, 7, 8]], sampling)[0][0].token_ids
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(level=1)  # weights kept in host memory: the engine serves the same model after waking
    free_asleep = torch.cuda.mem_get_info()[0]
    engine.wake_up()
    after = engine.generate([[5, 6, 7, 8]], sampling)[0][0].token_ids
    freed = (free_asleep - free_awake) / 2**30
    assert freed > 0.1, f"sleep freed only {freed:.2f} GiB"
    assert before == after, "a seeded sample changed across sleep/wake"
    return f"sleep freed {freed:.2f} GiB; same seeded sample after wake-up"


@check
def cuda_weight_sync_matches_actor(ctx):
    import torch

    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.actor.batch import RolloutBatch
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.rollout.engines import SamplingConfig
    from rlfactory_megatron.rollout.weight_sync import InProcessTransport, sync_weights

    cfg = load_config(overrides=["actor.optim.lr=1e-3", "actor.max_tokens_per_microbatch=256"])
    arch = load_arch(ctx.hf_dir)
    actor = Actor(cfg.actor, arch, ctx.hf_dir, BuildOptions(), total_steps=4)
    engine = ctx.engine()
    prompts = [[5, 17, 42, 7], [100, 3, 9, 250]]
    gens = engine.generate(prompts, SamplingConfig(n=2, max_tokens=12, seed=1))
    rows = [(p, g) for p, gs in zip(prompts, gens) for g in gs]
    width = max(len(p) + len(g.token_ids) for p, g in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width)
    for i, (p, g) in enumerate(rows):
        ids[i, : len(p) + len(g.token_ids)] = torch.tensor(p + g.token_ids)
        mask[i, len(p): len(p) + len(g.token_ids)] = 1
    batch = RolloutBatch(ids, torch.tensor([len(p) + len(g.token_ids) for p, g in rows]), mask)
    actor.update(batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"],
                                   advantages=torch.randn(ids.shape)))
    start = time.perf_counter()
    sync_weights(actor.engine, InProcessTransport(engine), 64, version=1)
    seconds = time.perf_counter() - start
    gens = engine.generate(prompts, SamplingConfig(n=2, max_tokens=12, seed=2))
    worst = 0.0
    for p, gs in zip(prompts, gens):
        for g in gs:
            row = RolloutBatch(torch.tensor([p + g.token_ids]), torch.tensor([len(p) + len(g.token_ids)]),
                               torch.tensor([[0.0] * len(p) + [1.0] * len(g.token_ids)]))
            mine = actor.compute_log_probs(row)["log_probs"][0, len(p):]
            worst = max(worst, (mine.cpu() - torch.tensor(g.log_probs)).abs().max().item())
    assert worst <= 1e-3, f"engine vs actor log-probs differ by {worst}"
    return f"sync {seconds:.2f} s; engine vs actor max |diff| {worst:.1e}"


# ---- Memory (issues 39 and 41): offload to host and back, the memory plan against a measured
# peak, and an engine's level-2 sleep woken in vLLM's weight-update order.
def _random_batch(vocab: int, rows: int, length: int):
    import torch

    from rlfactory_megatron.actor.batch import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, length)
    mask[:, :8] = 0  # a prompt
    return RolloutBatch(torch.randint(0, vocab, (rows, length), generator=gen), torch.full((rows,), length), mask,
                        advantages=torch.randn(rows, length, generator=gen))


def _trained_actor(hf_dir: str, max_tokens: int, rows: int, length: int, dtype: str = "bfloat16", **build):
    """An actor after one update (Adam's moments exist) on rows x length random tokens."""
    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch

    cfg = load_config(overrides=["actor.optim.lr=1e-4", f"actor.max_tokens_per_microbatch={max_tokens}",
                                 f"actor.mini_batch_size={rows}"])
    arch = load_arch(hf_dir)
    actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(params_dtype=dtype, **build), total_steps=4)
    batch = _random_batch(arch.vocab_size, rows, length)
    actor.update(batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"]))
    return cfg, arch, actor, batch


@check
def offload_round_trip_frees_the_device_and_is_bit_exact(ctx):
    import torch

    from rlfactory_megatron.actor.offload import megatron_state

    _, _, actor, _ = _trained_actor(ctx.hf_dir, 256, 4, 48)
    engine = actor.engine
    state = megatron_state(engine.chunks, engine.optimizer)
    before = [t.detach().clone() for kind in ("params", "optimizer") for t in state[kind]]
    allocated = torch.cuda.memory_allocated()
    start = time.perf_counter()
    freed = engine.offload()
    out_s = time.perf_counter() - start
    dropped = allocated - torch.cuda.memory_allocated()
    assert freed > 0 and dropped >= freed, f"offload freed {dropped} of {freed} bytes on the device"
    start = time.perf_counter()
    engine.host.onload()
    in_s = time.perf_counter() - start
    state = megatron_state(engine.chunks, engine.optimizer)
    after = [t.detach() for kind in ("params", "optimizer") for t in state[kind]]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the state changed on its way to host and back"
    return f"{freed / 2**20:.1f} MiB to host in {out_s:.3f} s and back in {in_s:.3f} s, bit-exact"


@check
def memory_plan_bounds_the_measured_training_peak(ctx):
    """A 0.3B-parameter Qwen2 shape, one micro-batch at the token budget: the plan's training terms
    (weights, gradients, optimizer, activations; not the runtime allowance) against
    torch.cuda.max_memory_allocated, with and without recompute."""
    import torch

    from rlfactory_megatron.models.tiny import make_tiny_hf_model
    from rlfactory_megatron.trainer.memory_plan import memory_plan

    hf_dir = str(make_tiny_hf_model("qwen2", os.path.join(os.path.dirname(ctx.hf_dir), "qwen2-mid"), hidden_size=1024,
                                    intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                                    num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=8192))
    reports = []
    for recompute in (False, True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cfg, arch, actor, _ = _trained_actor(hf_dir, 8192, 2, 4096, recompute_activations=recompute)
        measured = torch.cuda.max_memory_allocated() - base
        cfg.model.params_dtype, cfg.model.recompute_activations = "bfloat16", recompute
        plan = memory_plan(cfg, arch, 1)
        planned = sum(t.bytes for t in plan.terms("training") if not t.name.startswith("CUDA"))
        reports.append(f"recompute={recompute}: measured {measured / 2**30:.2f} GiB, planned {planned / 2**30:.2f} GiB "
                       f"({measured / planned:.2f}x)")
        del actor
        assert measured <= 1.1 * planned, "the plan underestimates: " + reports[-1]
    return "; ".join(reports)


@check
def engine_level2_sleep_wakes_weights_then_kv_cache_and_serves_the_synced_weights(ctx):
    import torch

    from rlfactory_megatron.actor.batch import RolloutBatch
    from rlfactory_megatron.rollout.engines import SamplingConfig
    from rlfactory_megatron.rollout.weight_sync import InProcessTransport, sync_weights

    # fp32 (bf16 log-probs drift by tenths of a nat); megatron's local spec: TE refuses fp32 THD batches.
    _, _, actor, _ = _trained_actor(ctx.hf_dir, 256, 4, 48, dtype="float32", layer_spec="local_sdpa")
    engine = ctx.engine()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(2)
    torch.cuda.empty_cache()
    freed = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
    engine.wake_up(["weights"])
    sync_weights(actor.engine, InProcessTransport(engine), 64, version=1)
    engine.wake_up(["kv_cache"])
    prompts = [[5, 17, 42, 7], [100, 3, 9, 250]]
    worst = 0.0
    for p, gens in zip(prompts, engine.generate(prompts, SamplingConfig(n=2, max_tokens=12, seed=2))):
        for g in gens:
            row = RolloutBatch(torch.tensor([p + g.token_ids]), torch.tensor([len(p) + len(g.token_ids)]),
                               torch.tensor([[0.0] * len(p) + [1.0] * len(g.token_ids)]))
            mine = actor.compute_log_probs(row)["log_probs"][0, len(p):]
            worst = max(worst, (mine.cpu() - torch.tensor(g.log_probs)).abs().max().item())
    assert freed > 0.1, f"a level-2 sleep freed only {freed:.2f} GiB"
    assert worst <= 1e-3, f"after a level-2 sleep and a sync, engine vs actor log-probs differ by {worst}"
    return f"level-2 sleep freed {freed:.2f} GiB; woken and synced, engine vs actor max |diff| {worst:.1e}"


# ---- Context parallelism (issue 46): Transformer-Engine's CP attention against CP = 1.
def _context_parallel_run(hf_dir: str, cp: int) -> dict:
    """A bf16 actor (TE layer spec) on a CP group of `cp` ranks, one GPU each: log-probs and
    entropy of packed multi-turn rows (tool observations masked), and one update's grad norm."""
    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.bench.long_trajectory import trajectory_batch
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed

    init_distributed(ParallelSizes(cp=cp), seed=0)
    try:
        cfg = load_config(overrides=[f"parallel.cp={cp}", "actor.max_tokens_per_microbatch=1024",
                                     "actor.mini_batch_size=4", "actor.optim.lr=1e-5"])
        arch = load_arch(hf_dir)
        actor = Actor(cfg.actor, arch, hf_dir, BuildOptions(params_dtype="bfloat16"), total_steps=4)
        batch = trajectory_batch(4, 1000, 200, arch.vocab_size)
        old = actor.compute_log_probs(batch, with_entropy=True)
        metrics = actor.update(batch.with_fields(old_log_probs=old["log_probs"]))
        return {"log_probs": old["log_probs"], "entropy": old["entropy"], "grad_norm": metrics["actor/grad_norm"],
                "mask": batch.loss_mask}
    finally:
        destroy_distributed()


@check
def te_context_parallel_attention_equals_cp1(ctx):
    import torch

    from rlfactory_megatron.runtime.distributed import spawn_local_workers

    if torch.cuda.device_count() < 2:
        raise Skipped(f"a CP group of 2 needs 2 GPUs (NCCL takes one rank per device); this machine has "
                      f"{torch.cuda.device_count()}")
    one = spawn_local_workers(_context_parallel_run, 1, ctx.hf_dir, 1)[0]
    two = spawn_local_workers(_context_parallel_run, 2, ctx.hf_dir, 2)
    trained = one["mask"] > 0
    worst = max((r[key] - one[key])[trained].abs().max().item() for r in two for key in ("log_probs", "entropy"))
    norm = abs(two[0]["grad_norm"] - one["grad_norm"]) / one["grad_norm"]
    # bf16: TE's CP attention sums its ring's steps in another order than one rank's kernel
    assert worst <= 0.05, f"CP 2 vs CP 1 log-probs/entropy differ by {worst:.3f} nats"
    assert norm <= 0.02, f"CP 2 vs CP 1 grad norm differs by {norm:.1%}"
    return f"CP 2 vs CP 1 (bf16, TE): max |log-prob/entropy diff| {worst:.1e}, grad norm {norm:.1e} relative"


class Skipped(Exception):
    """A check this machine cannot run (the message says why); counted apart from failures."""


class Context:
    def __init__(self, root: str) -> None:
        from rlfactory_megatron.models.tiny import make_tiny_hf_model

        self.hf_dir = str(make_tiny_hf_model("qwen3", os.path.join(root, "qwen3"), tie_word_embeddings=True))
        self._engine = None

    def engine(self):
        from rlfactory_megatron.rollout.engines import VLLMEngine

        if self._engine is None:
            self._engine = VLLMEngine(self.hf_dir, dtype="float32", max_model_len=256, memory_utilization=0.2,
                                      enable_sleep_mode=True, in_process=True)
        return self._engine


def main() -> int:
    from rlfactory_megatron.runtime.distributed import ParallelSizes, init_distributed
    from rlfactory_megatron.runtime.launch_env import ALONE

    failed = skipped = 0
    try:
        init_distributed(ParallelSizes(1, 1), seed=0, launch=ALONE)
    except Exception as exc:
        print(f"FAIL set-up: {type(exc).__name__}: {exc}")
        return 1
    with tempfile.TemporaryDirectory() as root:
        ctx = Context(root)
        for fn in CHECKS:
            start = time.perf_counter()
            try:
                detail = fn(ctx)
                print(f"PASS {fn.__name__} ({time.perf_counter() - start:.1f} s): {detail}", flush=True)
            except Skipped as why:
                skipped += 1
                print(f"SKIP {fn.__name__}: {why}", flush=True)
            except Exception as exc:
                failed += 1
                print(f"FAIL {fn.__name__} ({time.perf_counter() - start:.1f} s): {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=3, file=sys.stderr)
    print(f"{len(CHECKS) - failed - skipped} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
