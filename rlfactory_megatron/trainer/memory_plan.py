"""How much memory one training device needs, known at load: every term derived from the model's
shape and the config (docs/memory.md says how), summed per phase of a step, and a layout that
does not fit refused before anything starts."""
from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30
# CUDA context, NCCL and cuBLAS buffers and the caching allocator's slack: an allowance, not a
# derivation (scripts/gpu_check.py compares the plan with a measured peak).
RUNTIME_ALLOWANCE = 2 * GIB
ELEMENT_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    lowered_by: tuple[str, ...] = ()  # settings that make it smaller


@dataclass(frozen=True)
class Share:
    """An engine's share of the training device (vLLM's gpu_memory_utilization), awake in one phase."""

    name: str
    fraction: float
    key: str  # the setting that lowers it

    def term(self, device_bytes: float | None) -> Term:
        """The share in bytes (0 while the device is unknown)."""
        return Term(f"{self.name} ({self.fraction:g} of the device)", self.fraction * (device_bytes or 0.0),
                    (f"a smaller {self.key}",))


@dataclass
class MemoryPlan:
    """The terms of each phase on the fullest pipeline stage's devices, and the engines'."""

    # A step's phases: the models train with the engines asleep; the engines generate; the engines'
    # weights are awake for the sync while the actor's parameters stream into them; a colocated
    # judge judges, awake while the policy engines sleep (rollout/judge_turns.py).
    phases: dict[str, list[Term]]
    device_bytes: float | None  # one device's memory; None: unknown (no GPU, no parallel.device_memory_gib)
    device_source: str
    layout: str  # model, parameters and layout, in words
    engine: str  # the engines' share, weights and KV cache, in words
    shares: dict[str, Share] = field(default_factory=dict)  # phase -> the colocated engine share awake in it
    engine_refusal: str | None = None  # why an engine could not start, when it could not

    def terms(self, phase: str) -> list[Term]:
        """The phase's terms, the engine share awake in it among them."""
        share = self.shares.get(phase)
        return self.phases[phase] + ([share.term(self.device_bytes)] if share is not None else [])

    def total(self, phase: str) -> float:
        return sum(term.bytes for term in self.terms(phase))

    def peak(self) -> tuple[str, float]:
        return max(((phase, self.total(phase)) for phase in self.phases), key=lambda item: item[1])

    def _unknown_share(self, phase: str) -> bool:
        return phase in self.shares and self.device_bytes is None

    def _total_text(self, phase: str) -> str:
        return _gib(self.total(phase)) + (" + share" if self._unknown_share(phase) else "")

    def summary(self) -> str:
        """One start-up line."""
        totals = ", ".join(f"{phase} {self._total_text(phase)}" for phase in self.phases)
        if self.device_bytes is None:
            return f"rlf-train: memory per device (GiB): {totals}; not checked: {self.device_source}"
        return (f"rlf-train: memory per device (GiB): {totals}, of {_gib(self.device_bytes)} ({self.device_source}; "
                f"rlf-train --plan lists the terms)")

    def render(self) -> str:
        """The breakdown `rlf-train --plan` prints: one row per term, one column per phase."""
        names = list(dict.fromkeys(term.name for phase in self.phases for term in self.terms(phase)))
        width = max(len(name) for name in names) + 2
        device = f"{_gib(self.device_bytes)} GiB" if self.device_bytes is not None else "unknown"
        lines = [f"memory plan per device: {self.layout}", f"device: {device} ({self.device_source})",
                 "GiB".ljust(width) + "".join(phase.rjust(13) for phase in self.phases)]
        for name in names:
            cells = []
            for phase in self.phases:
                found = [term.bytes for term in self.terms(phase) if term.name == name]
                shown = "?" if found and self._unknown_share(phase) and name == self.terms(phase)[-1].name else (
                    _gib(found[0]) if found else "-")
                cells.append(shown.rjust(13))
            lines.append(name.ljust(width) + "".join(cells))
        lines.append("total".ljust(width) + "".join(self._total_text(phase).rjust(13) for phase in self.phases))
        lines.append(f"engines: {self.engine}")
        if self.device_bytes is not None:
            phase, peak = self.peak()
            spare = self.device_bytes - peak
            lines.append(f"peak {_gib(peak)} GiB in {phase}: " + (f"fits, {_gib(spare)} GiB to spare" if spare >= 0 else
                                                                  f"does not fit, {_gib(-spare)} GiB over"))
        return "\n".join(lines)

    def check(self) -> None:
        """Refuse a layout over the device's memory (ConfigError naming the phase, its biggest
        terms and the settings that lower them), or an engine that could not start."""
        from rlfactory_megatron.config import ConfigError

        if self.engine_refusal:
            raise ConfigError(self.engine_refusal)
        if self.device_bytes is None:
            return
        phase, peak = self.peak()
        if peak <= self.device_bytes:
            return
        biggest = sorted(self.terms(phase), key=lambda term: -term.bytes)[:3]
        named = [f"{term.name} {_gib(term.bytes)} GiB" + (f" (lower it: {', '.join(term.lowered_by)})"
                                                          if term.lowered_by else "") for term in biggest]
        raise ConfigError(f"the memory plan needs {_gib(peak)} GiB per device in {phase}, over the device's "
                          f"{_gib(self.device_bytes)} GiB ({self.device_source}); biggest terms: {'; '.join(named)}; "
                          f"rlf-train --plan lists every term")


def memory_plan(cfg, arch, world: int, detected_bytes: int | None = None, judge_arch=None) -> MemoryPlan:
    """The plan of `cfg` for `arch` on `world` ranks; `detected_bytes`: this machine's GPU memory;
    `judge_arch`: a colocated judge's model (its weights in words, and whether it can start).
    Of the first and the last pipeline stage (the embedding and the most micro-batches in flight
    on one, the LM head on the other), the fuller one is planned."""
    device_bytes, source = _device(cfg, detected_bytes)
    plans = [_stage_plan(cfg, arch, world, stage, device_bytes, source) for stage in sorted({0, cfg.parallel.pp - 1})]
    plan = max(plans, key=lambda plan: plan.peak()[1])
    judge = cfg.reward.model
    if judge.kind is not None and judge.placement == "colocated":
        _add_judge(plan, cfg, judge_arch)
    return plan


def _add_judge(plan: MemoryPlan, cfg, arch) -> None:
    """A colocated judge's phase: its share awake on the training devices beside what stays there
    while the policy engines sleep (what stays while they generate). Asleep (level 1: no sync
    brings a frozen judge's weights back) it keeps its weights in host memory, not on the device."""
    judge = cfg.reward.model
    share = Share("judge share", judge.gpu_memory_utilization, "reward.model.gpu_memory_utilization")
    plan.phases["judging"] = list(plan.phases["generation"])
    plan.shares["judging"] = share
    text = f"judge: colocated, reward.model.gpu_memory_utilization={share.fraction:g} of each device while it judges"
    if arch is not None:
        element = ELEMENT_SIZE[cfg.model.params_dtype]
        weights = arch.parameter_count() * element / judge.tp
        length = judge.max_prompt_tokens + judge.max_tokens
        one_sequence = arch.kv_cache_bytes_per_token(element, judge.tp) * length
        text += (f"; weights {_gib(weights)} GiB, in host memory while it sleeps (level 1)")
        if plan.device_bytes is not None and share.fraction * plan.device_bytes < weights + one_sequence:
            plan.engine_refusal = plan.engine_refusal or (
                f"reward.model.gpu_memory_utilization={share.fraction:g} gives the judge "
                f"{_gib(share.fraction * plan.device_bytes)} GiB per device, less than its weights ({_gib(weights)} "
                f"GiB) and the KV cache of one {length}-token sequence (reward.model.max_prompt_tokens + "
                f"max_tokens: {_gib(one_sequence)} GiB), without which vLLM does not start; raise "
                "reward.model.gpu_memory_utilization or reward.model.tp")
    plan.engine += "; " + text


# model.recompute=auto: the least recompute whose plan leaves this much of the device spare (the
# activation terms are estimates; fragmentation and the allowance's own error need room).
AUTO_RECOMPUTE_MARGIN = 0.1


def resolve_recompute(cfg, arch, world: int, detected_bytes: int | None = None) -> str | None:
    """model.recompute=auto made concrete in `cfg`: the least recompute (models/builder.RECOMPUTE)
    whose plan peaks within the device less the margin; the most when none does (the plan's check
    then refuses, naming the terms); none where the device is unknown. Returns a line saying what
    auto chose and why, or None when the key was set."""
    from rlfactory_megatron.models.builder import RECOMPUTE

    if cfg.model.recompute != "auto":
        return None
    device_bytes, _ = _device(cfg, detected_bytes)
    if device_bytes is None:
        cfg.model.recompute = "none"
        return "model.recompute=auto: none (no device to fit: no GPU here and no parallel.device_memory_gib)"
    room = (1 - AUTO_RECOMPUTE_MARGIN) * device_bytes
    peaks = []
    for choice in RECOMPUTE:
        cfg.model.recompute = choice
        phase, peak = memory_plan(cfg, arch, world, detected_bytes).peak()
        peaks.append(f"{choice} {_gib(peak)}")
        if peak <= room:
            break
    return (f"model.recompute=auto: {cfg.model.recompute} (peak GiB by recompute: {', '.join(peaks)}; "
            f"fits within {_gib(room)} GiB, {1 - AUTO_RECOMPUTE_MARGIN:g} of the device)")


def device_memory() -> int | None:
    """This machine's GPU memory in bytes (its first visible device: a node's GPUs are alike), or
    None without a GPU. Reads the device's properties without making a CUDA context."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def _device(cfg, detected_bytes: int | None) -> tuple[float | None, str]:
    """One device's memory and where it comes from: the GPU here, or parallel.device_memory_gib
    (the smaller of the two on a GPU: the key can only lower it, e.g. to leave room)."""
    named = cfg.parallel.device_memory_gib * GIB if cfg.parallel.device_memory_gib is not None else None
    if detected_bytes is not None and (named is None or detected_bytes <= named):
        return float(detected_bytes), "this machine's GPU"
    if named is not None:
        return named, "parallel.device_memory_gib"
    return None, "no GPU here; parallel.device_memory_gib names one to plan for"


def _stage_plan(cfg, arch, world: int, stage: int, device_bytes: float | None, source: str) -> MemoryPlan:
    """The plan on the devices of pipeline stage `stage`."""
    from rlfactory_megatron.runtime.distributed import ParallelSizes
    from rlfactory_megatron.trainer.presets import trains_critic

    tp, pp, cp, ep = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep
    sizes = ParallelSizes.of(cfg.parallel)
    etp = sizes.expert_tp
    dp = max(1, sizes.dp(world))
    element = ELEMENT_SIZE[cfg.model.params_dtype]
    dtype = cfg.model.params_dtype
    colocated = cfg.rollout.mode == "colocated"
    params = arch.parameter_count(tp, pp, stage, ep=ep, etp=etp)  # experts / ep of each MoE layer, each 1/etp
    # CP ranks hold whole copies of their stage's weights; the distributed optimizer shards over dp x cp,
    # and an expert's state over the ranks holding the same part of that expert (dp x cp x tp / (etp x ep)).
    shards = (dp * cp, max(1, dp * cp * tp // (etp * ep)), arch.expert_parameter_count(etp, pp, ep))
    actor = _model_state("actor", cfg.actor.optim, params, element, dtype, *shards)
    critic = (_model_state("critic", cfg.critic.optim, arch.parameter_count(tp, pp, stage, value_head=True, ep=ep, etp=etp),
                           element, dtype, *shards) if trains_critic(cfg) else [])
    reference = ([Term(f"reference weights ({dtype})", params * element, ("actor.kl_loss_coef=0", LAYOUT_KEYS))]
                 if cfg.actor.kl_loss_coef > 0 else [])
    runtime = Term("CUDA/NCCL runtime (allowance)", RUNTIME_ALLOWANCE)
    training = [*actor, *reference, *critic, _activations(cfg, arch, stage, element), runtime]
    # On the device while the engines generate: what no offload key sends to host memory (that
    # key then lowers it).
    resident = []
    if not cfg.actor.offload:
        resident += _lowered_by([*actor, *reference], ("actor.offload=true",) if colocated else ())
    if not cfg.critic.offload:
        resident += _lowered_by(critic, ("critic.offload=true",) if colocated else ())
    engine_params = arch.parameter_count()
    engine_weights = engine_params * element / cfg.rollout.tp
    sync = (actor[:1] if cfg.actor.offload else []) + resident  # the sync reads the actor's parameters
    if colocated:
        sync.insert(0, Term(f"engine weights ({dtype}, 1/{cfg.rollout.tp} each)", engine_weights, ("a larger rollout.tp",)))
    bucket = min(cfg.weight_sync.bucket_mb * (1 << 20), engine_params * element)  # no bigger than the model
    sync += [Term("weight-sync buckets (sent + received)", 2 * bucket, ("a smaller weight_sync.bucket_mb",)), runtime]
    engine, refusal = _engine(cfg, arch, engine_weights, element, device_bytes)
    holds = f"pipeline stage {stage + 1} of {pp} holds" if pp > 1 else "each rank holds"
    layout = (f"{arch.model_type} ({arch.num_layers} layers, {engine_params / 1e9:.2f}B parameters); tp={tp} pp={pp} "
              f"{f'cp={cp} ' if cp > 1 else ''}{f'ep={ep} ' if ep > 1 else ''}{f'etp={etp} ' if etp != tp else ''}dp={dp} "
              f"({world} ranks); {holds} "
              f"{params / 1e9:.2f}B")
    shares = ({"generation": Share("engine share", cfg.rollout.gpu_memory_utilization, "rollout.gpu_memory_utilization")}
              if colocated else {})
    return MemoryPlan({"training": training, "generation": [*resident, runtime], "weight sync": sync}, device_bytes,
                      source, layout, engine, shares, refusal)


LAYOUT_KEYS = "a larger parallel.tp or parallel.pp"


def _model_state(who: str, optim, params: int, element: int, dtype: str, shards: int, expert_shards: int = 1,
                 experts: int = 0) -> list[Term]:
    """Weights, fp32 gradients and optimizer states of a trained model on one device, with `shards`
    ranks holding the same weights (data and context parallel); of its `params`, `experts` are held
    by `expert_shards` ranks each (expert data parallel)."""
    # fp32 main parameters when the weights are 16-bit, and Adam's two moments; the distributed
    # optimizer shards them over those ranks (gradients and weights stay whole).
    per_param = (4 if element < 4 else 0) + 8
    sharded = optim.use_distributed_optimizer and shards > 1
    distribute = (f"{who}.optim.use_distributed_optimizer=true",) if shards > 1 and not sharded else ()
    what = ("fp32 main params + Adam moments" if element < 4 else "Adam moments") + (
        f", 1/{shards} each" if sharded else "")
    optimizer = ((params - experts) * per_param / shards + experts * per_param / expert_shards if sharded
                 else params * per_param)
    return [Term(f"{who} weights ({dtype})", params * element, (LAYOUT_KEYS,)),
            Term(f"{who} gradients (fp32)", params * 4, (LAYOUT_KEYS,)),
            Term(f"{who} optimizer ({what})", optimizer, (*distribute, LAYOUT_KEYS))]


def _lowered_by(terms: list[Term], keys: tuple[str, ...]) -> list[Term]:
    """`terms`, each also lowered by `keys` (first)."""
    return [Term(term.name, term.bytes, (*keys, *term.lowered_by)) for term in terms]


def _activations(cfg, arch, stage: int, element: int) -> Term:
    """What the actor's backward pass keeps at the token budget (docs/memory.md): per token and
    layer, the two RMSNorms' inputs and outputs, q, k and v after RoPE (and before the q/k
    norms), the attention output and flash attention's fp32 softmax statistics, and what
    megatron's unfused SwiGLU keeps (the builder turns fusions off): its input, silu(gate), the
    linear half plus its offset, and their product; times the layers whose micro-batches wait for
    their backward pass on this stage; with full recompute only each layer's input plus one layer
    recomputed, with selective each layer without its MLP's intermediates plus one MLP's; on the last stage, the log-prob's buffers. Per token of this rank's share of the
    micro-batch: 1/cp of it under context parallelism (keys and values travel, only the rank's own stay)."""
    from rlfactory_megatron.kernels.logprob.fused import default_chunk_size

    tp, pp, vpp, cp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp or 1, cfg.parallel.cp
    tokens = cfg.actor.max_tokens_per_microbatch // cp
    sp = tp if cfg.parallel.sequence_parallel else 1
    h, hd = arch.hidden_size, arch.head_dim
    heads, kv = arch.num_heads // tp, arch.num_kv_heads // tp
    mlp = element * 5 * arch.ffn_hidden_size / tp
    layer = (element * (4 * h / sp + (2 * heads + 2 * kv) * hd + ((heads + kv) * hd if arch.features.qk_norm else 0))
             + mlp + 4 * heads)
    # Micro-batches a stage holds before its first backward pass: megatron's 1F1B warm-up (and
    # the interleaved schedule's, in chunks of num_layers / (pp * vpp) layers) plus one.
    warmup = (pp - stage - 1) * 2 + (vpp - 1) * pp if vpp > 1 else pp - stage - 1
    waiting = (warmup + 1) * arch.num_layers / (pp * vpp)
    keys = ["a smaller actor.max_tokens_per_microbatch", "a larger parallel.cp"]
    recompute = cfg.model.recompute
    if recompute == "full":
        total = tokens * (waiting * element * h / sp + layer)
    elif recompute == "selective":
        total = tokens * (waiting * (layer - mlp) + mlp)
        keys.append("model.recompute=full")
    else:
        total = tokens * waiting * layer
        keys.append("model.recompute=selective or full")
    if tp > 1 and not cfg.parallel.sequence_parallel:
        keys.append("parallel.sequence_parallel=true")
    if stage == pp - 1:
        vocab = arch.padded_vocab_size(tp) // tp
        if cfg.actor.use_fused_logprob:
            # two fp32 [chunk, vocab / tp] buffers, and the output weight's fp32 gradient when 16-bit
            total += 2 * min(default_chunk_size(vocab), tokens) * vocab * 4 + (vocab * h * 4 if element < 4 else 0)
        else:
            total += tokens * vocab * (element + 8)  # logits, fp32 log-softmax and its gradient
            keys.append("actor.use_fused_logprob=true")
    share = f" of {cfg.actor.max_tokens_per_microbatch} over cp={cp}" if cp > 1 else ""
    return Term(f"activations ({tokens} tokens{share}, recompute {recompute})", total, tuple(keys))


def _engine(cfg, arch, weights: float, element: int, device_bytes: float | None) -> tuple[str, str | None]:
    """The engines' share of a device in words, and why an engine could not start: vLLM refuses
    to start when its share, less its weights, cannot hold one sequence of the longest length."""
    where = "the training devices" if cfg.rollout.mode == "colocated" else "devices of their own"
    utilization = cfg.rollout.gpu_memory_utilization
    per_token = arch.kv_cache_bytes_per_token(element, cfg.rollout.tp)
    length = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
    text = f"on {where}, rollout.gpu_memory_utilization={utilization:g} of each, weights {_gib(weights)} GiB"
    if device_bytes is None:
        return text + " (KV cache: the rest of the share)", None
    share = utilization * device_bytes
    kv = share - weights
    text = (f"on {where}, {_gib(share)} GiB each ({utilization:g} of {_gib(device_bytes)}): weights {_gib(weights)} GiB, "
            f"KV cache at most {_gib(max(kv, 0))} GiB = {max(kv, 0) / per_token:,.0f} tokens "
            f"= {max(kv, 0) / per_token / length:,.0f} sequences of {length}")
    if kv < per_token * length:
        return text, (f"rollout.gpu_memory_utilization={utilization:g} gives each engine {_gib(share)} GiB per device, "
                      f"less than its weights ({_gib(weights)} GiB) and the KV cache of one {length}-token sequence "
                      f"(rollout.max_prompt_tokens + rollout.max_response_tokens: {_gib(per_token * length)} GiB), "
                      "without which vLLM does not start; raise rollout.gpu_memory_utilization or rollout.tp")
    return text, None


def _gib(value: float) -> str:
    return "<0.01" if 0 < value < GIB / 200 else f"{value / GIB:.2f}"
