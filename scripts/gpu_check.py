"""GPU-only checks that the CPU suite cannot run: one pass/fail line per check, exit 1 if any fails.

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
    engine.sleep()
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
    # float32 on both sides for a 1e-3 comparison: the local spec (TE has no float32 attention for
    # packed sequences; TE in bfloat16 is te_bfloat16_packed_update_from_the_defaults below).
    actor = Actor(cfg.actor, arch, ctx.hf_dir, BuildOptions(params_dtype="float32", layer_spec="local_sdpa"),
                  total_steps=4)
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


# ---------------------------------------------------------------- issue 41: GPU paths a CPU cannot run


def _issue41_batch(vocab: int):
    """Six rows of different lengths, loss on all but the first 4 tokens: packed as THD sequences."""
    import torch

    from rlfactory_megatron.actor.batch import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12 + 7 * i for i in range(6)])
    ids = torch.randint(0, vocab, (6, int(lengths.max())), generator=gen)
    mask = torch.zeros(ids.shape)
    for row, n in enumerate(lengths.tolist()):
        mask[row, 4:n] = 1
    return RolloutBatch(ids, lengths, mask, advantages=torch.randn(ids.shape, generator=gen))


def _issue41_actor(ctx, *overrides: str):
    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch

    cfg = load_config(overrides=["actor.optim.lr=1e-3", "actor.max_tokens_per_microbatch=256", *overrides])
    build = BuildOptions(params_dtype=cfg.model.params_dtype, layer_spec=cfg.model.layer_spec)
    return cfg, Actor(cfg.actor, load_arch(ctx.hf_dir), ctx.hf_dir, build, total_steps=4)


@check
def te_bfloat16_packed_update_from_the_defaults(ctx):
    """The defaults on a GPU (item 1): TE layers in bfloat16 (auto) take packed THD sequences through
    TE's attention, with TE's fused RoPE (item 11); log-probs near float32's, a finite update."""
    import torch

    cfg, actor = _issue41_actor(ctx)
    config = actor.engine.modules()[0].config
    assert cfg.model.params_dtype == "bfloat16" and actor.engine.thd_attention, cfg.model
    assert config.apply_rope_fusion and config.bias_activation_fusion, "fusions off on GPU"
    _, reference = _issue41_actor(ctx, "model.params_dtype=float32", "model.layer_spec=local_sdpa")
    batch = _issue41_batch(actor.engine.arch.vocab_size)
    mine = actor.compute_log_probs(batch)["log_probs"].float().cpu()
    theirs = reference.compute_log_probs(batch)["log_probs"].float().cpu()
    diff = (mine - theirs)[batch.loss_mask > 0].abs().max().item()
    assert diff < 0.1, f"TE bfloat16 vs float32 log-probs differ by {diff}"
    metrics = actor.update(batch.with_fields(old_log_probs=mine))
    assert metrics["actor/skipped_steps"] == 0 and 0 < metrics["actor/grad_norm"] < float("inf"), metrics
    return f"bfloat16 TE vs float32 log-probs max |diff| {diff:.1e}; grad norm {metrics['actor/grad_norm']:.3f}"


@check
def fp16_update_scales_its_loss(ctx):
    """fp16 (item 6) on TE layers: the loss is scaled by megatron's dynamic scale, so its grad norm
    is bfloat16's, not 2**16 times smaller."""
    grad_norms = {}
    for dtype in ("bfloat16", "float16"):
        _, actor = _issue41_actor(ctx, f"model.params_dtype={dtype}")
        batch = _issue41_batch(actor.engine.arch.vocab_size)
        old = actor.compute_log_probs(batch)["log_probs"]
        metrics = actor.update(batch.with_fields(old_log_probs=old - 0.05))
        grad_norms[dtype] = metrics["actor/grad_norm"]
        scale = float(actor.engine.optimizer.get_loss_scale())
    ratio = grad_norms["float16"] / grad_norms["bfloat16"]
    assert 0.9 < ratio < 1.1 and scale > 1, (grad_norms, scale)
    return f"grad norm fp16 / bf16 = {ratio:.3f}; loss scale {scale:g}"


@check
def distributed_optimizer_checkpoint_resumes_exactly(ctx):
    """The distributed optimizer (item 10) with TE's FusedAdam (the CPU suite runs torch's Adam):
    update, save, update equals load, update."""
    import torch

    with tempfile.TemporaryDirectory() as directory:
        weights = []
        for resume in (False, True):
            _, actor = _issue41_actor(ctx)
            assert actor.engine.distributed_optimizer
            batch = _issue41_batch(actor.engine.arch.vocab_size)
            batch = batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"] - 0.05)
            if resume:
                actor.engine.load(directory)
            else:
                actor.update(batch)
                actor.engine.save(directory)
            actor.update(batch)
            weights.append({name: t.float().cpu() for name, t in actor.engine.iter_hf_weights()})
    worst = max((weights[0][name] - weights[1][name]).abs().max().item() for name in weights[0])
    assert worst == 0.0, f"resumed weights differ by {worst}"
    return "bit-identical after resume"


@check
def batch_invariant_engines_sample_alike(ctx):
    """rollout.batch_invariant (item 7): two engines with vLLM's batch-invariant kernels draw the
    same seeded sample for a prompt alone and for it among other prompts of other lengths."""
    from rlfactory_megatron.rollout.engines import SamplingConfig, VLLMEngine

    prompt = [5, 17, 42, 7, 99, 3]
    others = [[11 + i] * (3 + 5 * i) for i in range(7)]
    sampling = SamplingConfig(max_tokens=48, temperature=1.0)
    before = os.environ.get("VLLM_BATCH_INVARIANT")
    engines = [VLLMEngine(ctx.hf_dir, dtype="bfloat16", max_model_len=256, memory_utilization=0.15, in_process=False,
                          batch_invariant=True) for _ in range(2)]
    try:
        alone = engines[0].generate([prompt], sampling, seeds=[1234])[0][0].token_ids
        batched = engines[1].generate(others[:3] + [prompt] + others[3:], sampling,
                                      seeds=[7] * 3 + [1234] + [7] * 4)[3][0].token_ids
    finally:
        for engine in engines:
            engine.close()
        if before is None:
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
    assert alone == batched, f"alone {alone}\nbatched {batched}"
    return f"the same {len(alone)} tokens alone (engine 0) and 4th of 8 (engine 1)"


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

    failed = 0
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
            except Exception as exc:
                failed += 1
                print(f"FAIL {fn.__name__} ({time.perf_counter() - start:.1f} s): {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=3, file=sys.stderr)
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
