"""The checks of the path a GPU run takes that the CPU suite cannot make: one line per check, a summary.

`scripts/gpu_check.sh` runs them on one CUDA GPU with the GPU stack (./install.sh --gpu), in at
most 10 minutes. `scripts/gpu_check.sh --cpu` runs each check's CPU counterpart where it has one
(the same code in fp32, megatron's local spec, the Triton kernel in its interpreter, under the
device discipline) and lists the GPU-only ones; the suite runs it, so that the script cannot rot.

A check is `@check def name(ctx)` (GPU only) or `@check(cpu=True)` (both modes; `ctx.gpu` says
which); it returns a one-line detail, raises to fail, or raises Skip when the machine lacks what
it needs. Each builds what it needs on a tiny random-weight model made here (no downloads).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

CPU_MODE = "--cpu" in sys.argv[1:]
if CPU_MODE:
    # Before torch and triton load: the kernel runs in Triton's interpreter, and every tensor
    # that would live on the GPU is marked, so that what a GPU refuses fails here too.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("RLF_DEVICE_DISCIPLINE", "1")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

CHECKS = []


class Skip(Exception):
    """The machine lacks what the check needs (e.g. a second GPU); neither a pass nor a failure."""


def check(fn=None, *, cpu: bool = False):
    """Registers a check; `cpu=True`: it also runs in --cpu mode, as its CPU counterpart."""
    def register(fn):
        fn.runs_on_cpu = cpu
        CHECKS.append(fn)
        return fn

    return register(fn) if fn is not None else register


def _prompts_and_samples(engine, seed: int):
    from rlfactory_megatron.rollout.engines import SamplingConfig

    prompts = [[5, 17, 42, 7], [100, 3, 9, 250], [61, 62]]
    return prompts, engine.generate(prompts, SamplingConfig(n=2, max_tokens=12, seed=seed))


def _batch(prompts, generations):
    """Rows = prompt + sample; loss mask on the sampled tokens; the engine's log-prob of each."""
    import torch

    from rlfactory_megatron.actor.batch import RolloutBatch

    rows = [(p, g) for p, gens in zip(prompts, generations) for g in gens]
    width = max(len(p) + len(g.token_ids) for p, g in rows)
    ids, mask, engine_lp = (torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width),
                            torch.zeros(len(rows), width))
    for i, (p, g) in enumerate(rows):
        ids[i, :len(p) + len(g.token_ids)] = torch.tensor(p + g.token_ids)
        mask[i, len(p):len(p) + len(g.token_ids)] = 1
        engine_lp[i, len(p):len(p) + len(g.token_ids)] = torch.tensor(g.log_probs)
    return RolloutBatch(ids, torch.tensor([len(p) + len(g.token_ids) for p, g in rows]), mask), engine_lp


@check
def driver_and_library_versions(ctx):
    """First, so that every other line is read against them: the NVIDIA driver (>= 580 for the CUDA
    13 build of torch, issue 53 item 7: what rlf-train checks at start) and the libraries' versions."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from rlfactory_megatron.runtime.cuda_driver import MIN_DRIVER, driver_version, unusable_gpu

    driver = driver_version()
    assert unusable_gpu() is None and driver is not None, unusable_gpu() or "nvidia-smi reports no GPU"
    assert int(driver.split(".")[0]) >= MIN_DRIVER, f"driver {driver} < {MIN_DRIVER}"

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "absent"

    return (f"driver {driver}, torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {installed('vllm')}, "
            f"megatron-core {installed('megatron-core')}, transformer-engine {installed('transformer-engine')}")


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


@check(cpu=True)
def layer_spec_log_probs_match_hf(ctx):
    """GPU: the Transformer-Engine layer spec in bf16, on a THD pack of sequences (as training
    runs), vs transformers in fp32: max |log-prob diff| <= 0.05 nats (bf16 rounds each layer's
    activations to 8 bits of mantissa). CPU: megatron's local spec in fp32, <= 1e-4."""
    import torch
    import transformers

    from rlfactory_megatron.actor.actor import PolicyModel
    from rlfactory_megatron.actor.batch import RolloutBatch
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch

    spec, dtype, tolerance = ("transformer_engine", "bfloat16", 0.05) if ctx.gpu else ("local_sdpa", "float32", 1e-4)
    arch = load_arch(ctx.hf_dir)
    model = PolicyModel(arch, ctx.hf_dir, BuildOptions(params_dtype=dtype, layer_spec=spec), max_tokens=512)
    lengths = [37, 64, 9, 120]
    ids = torch.randint(0, arch.vocab_size, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(ids.shape)
    for row, length in enumerate(lengths):
        mask[row, 1:length] = 1
    mine = model.compute_log_probs(RolloutBatch(ids, torch.tensor(lengths), mask))["log_probs"].float().cpu()
    hf = transformers.AutoModelForCausalLM.from_pretrained(ctx.hf_dir, dtype=torch.float32).to(ctx.device)
    worst = 0.0
    with torch.no_grad():
        for row, length in enumerate(lengths):
            row_ids = ids[row:row + 1, :length].to(ctx.device)
            reference = torch.log_softmax(hf(row_ids).logits[0, :-1].float(), -1).gather(-1, row_ids[0, 1:, None])[:, 0]
            worst = max(worst, (mine[row, 1:length] - reference.cpu()).abs().max().item())
    assert worst <= tolerance, f"{spec} in {dtype} vs transformers: max |log-prob diff| {worst:.2e} > {tolerance}"
    return f"{spec} in {dtype}: max |log-prob diff| {worst:.1e} (tolerance {tolerance}) on a pack of {len(lengths)}"


@check(cpu=True)
def triton_logprob_matches_torch(ctx):
    """The fused vocab-parallel log-prob and entropy: Triton kernel vs the PyTorch implementation,
    in fp32 (<= 1e-4: the kernel keeps IEEE fp32 products) and, on a GPU, in bf16 as training runs
    it (<= 1e-2: bf16 inputs, fp32 sums in another order). CPU: the kernel in Triton's interpreter."""
    import torch

    from rlfactory_megatron.kernels.logprob import fused_logprob_entropy
    from rlfactory_megatron.runtime.cpu_compat import compute_device

    tokens, hidden_size, vocab = (512, 128, 1000) if ctx.gpu else (64, 32, 200)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, tokens, hidden_size, generator=gen).to(compute_device())
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.05).to(compute_device())
    targets = torch.randint(0, vocab, (1, tokens), generator=gen).to(compute_device())
    details = []
    for dtype, tolerance in [(torch.float32, 1e-4)] + ([(torch.bfloat16, 1e-2)] if ctx.gpu else []):
        results = {impl: fused_logprob_entropy(hidden.to(dtype), weight.to(dtype), targets, impl=impl, vocab_size=vocab)
                   for impl in ("triton", "torch")}
        lp_diff = (results["triton"][0] - results["torch"][0]).abs().max().item()
        entropy_diff = (results["triton"][1] - results["torch"][1]).abs().max().item()
        assert max(lp_diff, entropy_diff) <= tolerance, \
            f"{dtype}: log-prob differs by {lp_diff:.1e}, entropy by {entropy_diff:.1e} (tolerance {tolerance})"
        details.append(f"{str(dtype).removeprefix('torch.')} max |diff| log-prob {lp_diff:.1e}, entropy {entropy_diff:.1e}")
    return "; ".join(details)


@check(cpu=True)
def engine_in_its_own_process_fed_by_handles_matches_actor(ctx):
    """How every multi-rank run's colocated engines live, forced here at world size 1: the engine
    core in a process of its own, each bucket staged in CUDA IPC (host: shared) memory and handed
    over by handle. Its log-probs after a sync vs the actor's (both fp32, local spec): <= 1e-3 on
    a GPU (two kernel libraries), <= 1e-4 on CPU; what crossed the pipe < 1% of the model."""
    import torch

    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.rollout.engines import VLLMEngine
    from rlfactory_megatron.rollout.weight_sync import InProcessTransport, sync_weights

    cfg = load_config(overrides=["actor.optim.lr=1e-3", "actor.optim.adam_eps=1e-4",
                                 "actor.max_tokens_per_microbatch=256", "actor.mini_batch_size=16"])
    actor = Actor(cfg.actor, load_arch(ctx.hf_dir), ctx.hf_dir, BuildOptions(layer_spec="local_sdpa"), total_steps=4)
    engine = VLLMEngine(ctx.hf_dir, dtype="float32", max_model_len=256, max_num_seqs=8, memory_utilization=0.2,
                        in_process=False)
    try:
        batch, engine_lp = _batch(*_prompts_and_samples(engine, seed=1))
        actor.update(batch.with_fields(old_log_probs=engine_lp, advantages=torch.randn(batch.input_ids.shape)))
        stats = sync_weights(actor.megatron, InProcessTransport(engine), 0.5, version=1)
        batch, engine_lp = _batch(*_prompts_and_samples(engine, seed=2))
        gap = (actor.compute_log_probs(batch)["log_probs"].cpu() - engine_lp)[batch.loss_mask > 0].abs().max().item()
    finally:
        engine.close()
    tolerance = 1e-3 if ctx.gpu else 1e-4
    assert gap <= tolerance, f"engine vs actor log-probs differ by {gap:.2e} > {tolerance}"
    share = stats.message_bytes / stats.bytes
    assert share < 0.01, f"{stats.message_bytes} of the {stats.bytes} model bytes crossed the engine's pipe"
    return (f"{stats.buckets} buckets in {stats.seconds:.2f} s, {stats.message_bytes} B of messages for "
            f"{stats.bytes / 2**20:.1f} MiB ({share:.2%}); engine vs actor max |diff| {gap:.1e}")


@check
def sleep_frees_and_wake_restores_engine_memory(ctx):
    """vLLM's sleep mode on the engine a colocated rank holds: device memory measured with
    torch.cuda.mem_get_info (the whole device, every process) before the engine, awake, asleep,
    woken. Sleep must give back at least 80% of what the engine took; wake must take it again."""
    import torch

    from rlfactory_megatron.rollout.engines import SamplingConfig

    free_before = torch.cuda.mem_get_info()[0]
    engine = ctx.engine()
    engine.generate([[5, 6, 7, 8]], SamplingConfig(max_tokens=8, seed=3))
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(level=1)  # weights kept in host memory: the engine serves the same model after waking
    free_asleep = torch.cuda.mem_get_info()[0]
    engine.wake_up()
    free_woken = torch.cuda.mem_get_info()[0]
    served = engine.generate([[5, 6, 7, 8]], SamplingConfig(max_tokens=8, seed=3))[0][0].token_ids
    held, freed, retaken = free_before - free_awake, free_asleep - free_awake, free_asleep - free_woken
    gib = 2**30
    assert freed >= 0.8 * held, f"sleep freed {freed / gib:.2f} of the {held / gib:.2f} GiB the engine holds"
    assert retaken >= 0.8 * freed, f"wake-up took back {retaken / gib:.2f} of the {freed / gib:.2f} GiB sleep freed"
    assert served, "the woken engine generated nothing"
    return f"engine holds {held / gib:.2f} GiB; sleep freed {freed / gib:.2f}, wake took {retaken / gib:.2f}"


# The scale-to-small settings of the suite's rlf-train runs (tests/trainer/rlf_train_cli.py): no behaviour key.
RLF_TRAIN_SMALL = ["trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_response_tokens=48",
                   "trainer.val_every=0", "trainer.save_every=0", "trainer.sft_steps=2", "trainer.sft_batch_size=4",
                   "tools.num_workers=1", "trainer.total_steps=3", "actor.mini_batch_size=2"]


def _rlf_train(ctx, run: str, *overrides: str) -> str:
    """A 3-step `rlf-train` in bf16 with the calculator tool, in a process of its own; returns a
    one-line summary of its metrics. On CPU, only its config is loaded and checked (the CPU runs
    of the same command are the suite's end-to-end tests)."""
    out_dir = os.path.join(ctx.root, run)
    command = [sys.executable, "-m", "rlfactory_megatron.cli.train", *RLF_TRAIN_SMALL, "model.params_dtype=bfloat16",
               f"trainer.output_dir={out_dir}", *overrides] + ([] if ctx.gpu else ["--print-config"])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, env=env)
    assert done.returncode == 0, f"rlf-train exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
    if not ctx.gpu:
        assert "params_dtype: bfloat16" in done.stdout
        return "config loads and checks (--print-config)"
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    assert [r["step"] for r in steps] == [1, 2, 3], [r["step"] for r in steps]
    last = steps[-1]
    assert "rollout/tool_calls_per_sample" in last and last["rollout/engine_0_weight_version"] == 2
    return (f"3 steps, tool calls/sample {last['rollout/tool_calls_per_sample']:.2f}, engine vs actor "
            f"max |log-prob diff| {last.get('rollout/logprob_gap_max', float('nan')):.2f} (bf16 on both sides)")


@check(cpu=True)
def rlf_train_bf16_colocated(ctx):
    return _rlf_train(ctx, "colocated")


@check(cpu=True)
def rlf_train_bf16_disaggregated_over_nccl(ctx):
    """A disaggregated engine (a Ray actor) fed by the NCCL broadcast group. It needs a GPU of its
    own: NCCL refuses two ranks of one group on the same device ("Duplicate GPU detected")."""
    if ctx.gpu:
        import torch

        if torch.cuda.device_count() < 2:
            raise Skip("needs 2 GPUs: NCCL refuses a broadcast group with two ranks on one device")
    return _rlf_train(ctx, "disaggregated", "rollout.mode=disaggregated", "rollout.num_engines=1")


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
    engine = actor.megatron
    state = megatron_state(engine.chunks, engine.optimizer)
    before = [t.detach().clone() for kind in ("params", "optimizer") for t in state[kind]]
    allocated = torch.cuda.memory_allocated()
    grads = engine.host.resident_bytes(("grads",))  # freed, not copied
    cached_pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    start = time.perf_counter()
    freed = engine.offload()
    out_s = time.perf_counter() - start
    dropped = allocated - torch.cuda.memory_allocated()
    assert freed > 0 and dropped >= freed, f"offload freed {dropped} of {freed} bytes on the device"
    # Issue 53 item 6: one pinned buffer per kind at the state's exact size, none from torch's
    # (power-of-two rounding) pinned cache.
    buffers = engine.host.host_buffers()
    assert all(b.is_pinned() for b in buffers.values()), "a host buffer is not pinned"
    assert sum(b.numel() for b in buffers.values()) == freed - grads, (freed - grads, buffers.keys())
    grown = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - cached_pinned
    assert grown == 0, f"torch's pinned cache grew by {grown} bytes during offload"
    start = time.perf_counter()
    engine.host.onload()
    in_s = time.perf_counter() - start
    state = megatron_state(engine.chunks, engine.optimizer)
    after = [t.detach() for kind in ("params", "optimizer") for t in state[kind]]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the state changed on its way to host and back"
    return (f"{freed / 2**20:.1f} MiB to host in {out_s:.3f} s and back in {in_s:.3f} s, bit-exact; pinned host "
            f"buffers {', '.join(f'{k} {b.numel() / 2**20:.1f} MiB' for k, b in buffers.items())}")


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
    for recompute in ("none", "selective", "full"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        cfg, arch, actor, _ = _trained_actor(hf_dir, 8192, 2, 4096, recompute=recompute)
        measured = torch.cuda.max_memory_allocated() - base
        cfg.model.params_dtype, cfg.model.recompute = "bfloat16", recompute
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
    sync_weights(actor.megatron, InProcessTransport(engine), 64, version=1)
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
    cfg, actor = _issue41_actor(ctx)
    config = actor.megatron.modules()[0].config
    assert cfg.model.params_dtype == "bfloat16" and actor.megatron.thd_attention, cfg.model
    assert config.apply_rope_fusion and config.bias_activation_fusion, "fusions off on GPU"
    _, reference = _issue41_actor(ctx, "model.params_dtype=float32", "model.layer_spec=local_sdpa")
    batch = _issue41_batch(actor.megatron.arch.vocab_size)
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
        batch = _issue41_batch(actor.megatron.arch.vocab_size)
        old = actor.compute_log_probs(batch)["log_probs"]
        metrics = actor.update(batch.with_fields(old_log_probs=old - 0.05))
        grad_norms[dtype] = metrics["actor/grad_norm"]
        scale = float(actor.megatron.optimizer.get_loss_scale())
    ratio = grad_norms["float16"] / grad_norms["bfloat16"]
    assert 0.9 < ratio < 1.1 and scale > 1, (grad_norms, scale)
    return f"grad norm fp16 / bf16 = {ratio:.3f}; loss scale {scale:g}"


@check
def distributed_optimizer_checkpoint_resumes_exactly(ctx):
    """The distributed optimizer (item 10) with TE's FusedAdam (the CPU suite runs torch's Adam):
    update, save, update equals load, update."""
    with tempfile.TemporaryDirectory() as directory:
        weights = []
        for resume in (False, True):
            _, actor = _issue41_actor(ctx)
            assert actor.megatron.distributed_optimizer
            batch = _issue41_batch(actor.megatron.arch.vocab_size)
            batch = batch.with_fields(old_log_probs=actor.compute_log_probs(batch)["log_probs"] - 0.05)
            if resume:
                actor.megatron.load(directory)
            else:
                actor.update(batch)
                actor.megatron.save(directory)
            actor.update(batch)
            weights.append({name: t.float().cpu() for name, t in actor.megatron.iter_hf_weights()})
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
    import torch

    major, minor = torch.cuda.get_device_capability()  # issue 53 item 12: the engine refuses below 8.0
    return f"the same {len(alone)} tokens alone (engine 0) and 4th of 8 (engine 1), compute capability {major}.{minor}"


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
        raise Skip(f"a CP group of 2 needs 2 GPUs (NCCL takes one rank per device); this machine has "
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


# ---- MoE engines (issue 53): R3's route hook on Model Runner V2 (item 2), and the MoE weight
# update into an engine whose CUDA graphs are captured (item 4).
def _tiny_moe(ctx):
    """A tiny Qwen3-MoE (8 experts, top 2), its arch, and the fp32 build of it (megatron's local spec).
    Its engines run in processes of their own: an in-process one takes this process's group as
    its world, and closing it ends the group."""
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.builder import BuildOptions, MoEOptions
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.models.tiny import make_tiny_hf_model

    hf_dir = str(make_tiny_hf_model("qwen3_moe", os.path.join(ctx.root, "qwen3_moe")))
    build = BuildOptions(params_dtype="float32", layer_spec="local_sdpa", moe=MoEOptions(**load_config().model.moe))
    return hf_dir, load_arch(hf_dir), build


@check
def moe_engine_records_routes_on_model_runner_v2(ctx):
    """rollout.record_routes (R3) on the runner vLLM picks on a GPU (V2, where Triton is): every
    position of every sample has its experts, and the trainer's router, shown them, agrees."""
    import torch

    from rlfactory_megatron.actor.actor import PolicyModel
    from rlfactory_megatron.rollout.engines import VLLMEngine

    hf_dir, arch, build = _tiny_moe(ctx)
    engine = VLLMEngine(hf_dir, dtype="float32", max_model_len=256, max_num_seqs=8, memory_utilization=0.15,
                        record_routes=True, in_process=False)
    try:
        runner = engine.llm.collective_rpc(lambda worker: type(worker.model_runner).__module__)[0]
        prompts, generations = _prompts_and_samples(engine, seed=4)
    finally:
        engine.close()
    assert runner == "vllm.v1.worker.gpu.model_runner", f"the engine ran {runner}, not Model Runner V2"
    batch, _ = _batch(prompts, generations)
    samples = [g for gens in generations for g in gens]
    routes = torch.full((*batch.input_ids.shape, arch.num_layers, arch.moe.top_k), -1, dtype=torch.int16)
    for row, (prompt, sample) in enumerate(zip([p for p in prompts for _ in range(2)], samples)):
        assert sample.routes.shape == (len(prompt) + len(sample.token_ids) - 1, arch.num_layers, arch.moe.top_k)
        assert ((sample.routes >= 0) & (sample.routes < arch.moe.num_experts)).all(), "a position without routes"
        routes[row, 1:1 + len(sample.routes)] = torch.from_numpy(sample.routes)
    model = PolicyModel(arch, hf_dir, build, 256, compare_routes=True)
    agreement = model.compute_log_probs(batch.with_fields(routes=routes))["routing_agreement"]
    assert agreement >= 0.99, f"the trainer's router agrees with the engine's routes on {agreement:.1%}"
    return f"{runner}: routes on every position of {len(samples)} samples, router agreement {agreement:.1%}"


@check
def moe_engine_synced_twice_after_cuda_graph_capture_equals_a_fresh_one(ctx):
    """An engine with CUDA graphs captured, synced twice (vLLM's weight update copies into the
    tensors the graphs read; nothing rebuilds the expert kernels), samples what a fresh engine
    started from the same weights does, token for token."""
    import torch

    from rlfactory_megatron.actor.actor import Actor
    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.hf_checkpoint import write_hf_folder
    from rlfactory_megatron.rollout.engines import SamplingConfig, VLLMEngine
    from rlfactory_megatron.rollout.weight_sync import InProcessTransport, sync_weights

    hf_dir, arch, build = _tiny_moe(ctx)
    # A seed per request: a seed for the call would be drawn per request from what the engine served before.
    prompts, sampling, seeds = [[5, 17, 42, 7], [100, 3, 9, 250]], SamplingConfig(n=2, max_tokens=12), [91, 92]
    cfg = load_config(overrides=["actor.optim.lr=1e-3", "actor.optim.adam_eps=1e-4",
                                 "actor.max_tokens_per_microbatch=256", "actor.mini_batch_size=16"])
    actor = Actor(cfg.actor, arch, hf_dir, build, total_steps=4)
    engine = VLLMEngine(hf_dir, dtype="float32", max_model_len=256, max_num_seqs=8, memory_utilization=0.15,
                        in_process=False)
    fresh_dir = os.path.join(ctx.root, "qwen3_moe_synced")
    try:
        eager = engine.llm.collective_rpc(lambda worker: worker.vllm_config.model_config.enforce_eager)[0]
        assert not eager, "the engine runs eagerly: no CUDA graphs to keep"
        for version in (1, 2):
            batch, engine_lp = _batch(*_prompts_and_samples(engine, seed=version))
            actor.update(batch.with_fields(old_log_probs=engine_lp, advantages=torch.randn(engine_lp.shape)))
            sync_weights(actor.megatron, InProcessTransport(engine), 0.1, version=version)
        synced = engine.generate(prompts, sampling, seeds=seeds)
    finally:
        engine.close()
    write_hf_folder(actor.megatron.iter_hf_weights(), fresh_dir, hf_dir, arch.hf_config, writer=True)
    fresh = VLLMEngine(fresh_dir, dtype="float32", max_model_len=256, max_num_seqs=8, memory_utilization=0.15,
                       in_process=False)
    try:
        reference = fresh.generate(prompts, sampling, seeds=seeds)
    finally:
        fresh.close()
    tokens = [[g.token_ids for g in gens] for gens in synced]
    assert tokens == [[g.token_ids for g in gens] for gens in reference], "the synced engine samples otherwise"
    gap = max(abs(a - b) for s, r in zip(synced, reference) for gs, gr in zip(s, r)
              for a, b in zip(gs.log_probs, gr.log_probs))
    assert gap <= 1e-4, f"synced vs fresh engine log-probs differ by {gap:.1e}"
    return f"two syncs after graph capture: the same {sum(map(len, sum(tokens, [])))} tokens, log-probs within {gap:.1e}"
@check
def device_discipline_indexing_is_what_cuda_refuses(ctx):
    """Issue 53 item 13: the device discipline's indexing rules (runtime/device_discipline.py, checked
    on CPU by tests/runtime/test_device_discipline.py) against CUDA itself: what it refuses, CUDA
    refuses; what it lets pass, CUDA runs."""
    import torch

    host, dev = torch.zeros(4, 3), torch.randn(4, 3, device="cuda")
    refused = {"GPU indices": lambda: host[torch.tensor([0, 2], device="cuda")],
               "GPU mask": lambda: host[dev[:, 0] > 0],
               "GPU values by index": lambda: host.__setitem__(torch.tensor([0, 1]), dev[:2])}
    allowed = {"element copy": lambda: host.__setitem__(0, dev[0]),
               "slice copy": lambda: host.__setitem__(slice(1, 3), dev[1:3]),
               "0-dim GPU value by index": lambda: host.__setitem__(torch.tensor([0, 2]), dev[0, 0]),
               "0-dim GPU index": lambda: host[torch.tensor(1, device="cuda")],
               "0-dim GPU bool index": lambda: host[torch.tensor(True, device="cuda")],
               "host mask for a GPU tensor": lambda: dev[host[:, 0] >= 0],
               "host indices for a GPU tensor": lambda: dev[torch.tensor([0, 2])]}
    wrong = []
    for name, call in refused.items():
        try:
            call()
            wrong.append(f"{name}: CUDA ran it")
        except (RuntimeError, IndexError):
            pass
    for name, call in allowed.items():
        try:
            call()
        except Exception as exc:
            wrong.append(f"{name}: {type(exc).__name__}: {exc}")
    torch.cuda.synchronize()
    assert not wrong, "the discipline's rules differ from CUDA's: " + "; ".join(wrong)
    return f"{len(refused)} refused and {len(allowed)} run, by CUDA as by the discipline"


class Context:
    def __init__(self, root: str, gpu: bool) -> None:
        import torch

        from rlfactory_megatron.models.tiny import make_tiny_hf_model

        self.root, self.gpu = root, gpu
        self.device = torch.device("cuda") if gpu else torch.device("cpu")
        self.hf_dir = str(make_tiny_hf_model("qwen3", os.path.join(root, "qwen3"), tie_word_embeddings=True))
        self._engine = None

    def engine(self):
        """One in-process engine with sleep mode, shared by the checks that ask for it."""
        from rlfactory_megatron.rollout.engines import VLLMEngine

        if self._engine is None:
            self._engine = VLLMEngine(self.hf_dir, dtype="float32", max_model_len=256, memory_utilization=0.2,
                                      enable_sleep_mode=True, in_process=True)
        return self._engine


def main() -> int:
    from rlfactory_megatron.runtime.distributed import ParallelSizes, init_distributed
    from rlfactory_megatron.runtime.launch_env import ALONE

    try:
        init_distributed(ParallelSizes(1, 1), seed=0, launch=ALONE)
    except Exception as exc:
        print(f"FAIL set-up: {type(exc).__name__}: {exc}")
        return 1
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    gpu_only = [fn.__name__ for fn in CHECKS if CPU_MODE and not fn.runs_on_cpu]
    with tempfile.TemporaryDirectory() as root:
        ctx = Context(root, gpu=not CPU_MODE)
        for fn in CHECKS:
            if fn.__name__ in gpu_only:
                continue
            start = time.perf_counter()
            try:
                verdict, detail = "PASS", fn(ctx)
            except Skip as exc:
                verdict, detail = "SKIP", str(exc)
            except Exception as exc:
                verdict, detail = "FAIL", f"{type(exc).__name__}: {exc}"
                traceback.print_exc(limit=4, file=sys.stderr)
            counts[verdict] += 1
            print(f"{verdict} {fn.__name__} ({time.perf_counter() - start:.1f} s): {detail}", flush=True)
    summary = f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
    if CPU_MODE:
        summary += f" on CPU; GPU-only: {', '.join(gpu_only) or 'none'}"
    print(summary)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
