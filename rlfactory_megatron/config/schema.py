"""The one typed configuration tree (OmegaConf structured config) for every rlfactory-megatron run."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class MoEConfig:
    # The router's load-balancing loss: none | aux_loss (per micro-batch) | seq_aux_loss (per
    # sequence). none is the RL default of verl, slime and NeMo-RL: a balancing loss pulls the
    # router away from the routes the rollout sampled with, for a load that only matters at scale.
    load_balancing: str = "none"
    aux_loss_coeff: float = 0.0  # weight of the load-balancing loss (needs load_balancing != none)
    z_loss_coeff: float = 0.0  # weight of the router z-loss, which keeps router logits small; 0: off
    # Precision of the router's logits, softmax and top-k: fp32 (the peers' RL default: bf16 routes
    # flip between trainer and engine on near ties) | fp64
    router_dtype: str = "fp32"
    freeze_router: bool = False  # no gradient to the routers: routes move only with the hidden states


@dataclass
class ModelConfig:
    # HF folder, or tiny://<llama|qwen2|qwen3|qwen3_moe> for a locally built tiny model; required
    # (the embedded default, a run without --config, uses tiny://qwen3)
    path: str = MISSING
    # auto | float32 | bfloat16 | float16; auto: bfloat16 with Transformer-Engine layers (TE's
    # attention has no float32 kernel for the actor's packed sequences), float32 otherwise
    params_dtype: str = "auto"
    layer_spec: str = "auto"  # auto (TE on GPU, local_sdpa on CPU) | local_sdpa | local | transformer_engine
    # Activation recompute in the backward pass (memory for time): none; selective (each layer's
    # MLP, or a MoE layer's experts, recomputed from its input: the SwiGLU's intermediates, most of
    # a layer's activations); full (every layer from its input); auto: the least of these whose
    # memory plan leaves 10% of the device spare, chosen by rlf-train at load from the model's shape
    # (--plan shows it; the run's config.yaml keeps the choice); none where no device is known
    # (no GPU and no parallel.device_memory_gib).
    recompute: str = "auto"
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts models' router (docs/moe.md)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor-parallel size of the actor, critic and reference (divides the heads)
    pp: int = 1  # pipeline stages (divides the layers with vpp); dp = world / (tp * pp * cp)
    vpp: Optional[int] = None  # virtual pipeline stages per rank (interleaved schedule; needs pp >= 2)
    sequence_parallel: bool = False  # megatron sequence parallelism within the TP group (tp >= 2)
    # Context-parallel ranks: every packed sequence's tokens are split among them (2 x cp chunks,
    # balanced for causal attention) and attention spans the group; dp = world / (tp * pp * cp).
    # For long trajectories: each rank keeps 1/cp of a micro-batch's activations.
    cp: int = 1
    # Expert-parallel ranks of a mixture-of-experts model: each holds experts / ep of every MoE
    # layer (tokens travel to their experts and back); divides the experts, etp * ep * pp divides
    # the world.
    ep: int = 1
    # Expert tensor-parallel ranks: each expert's FFN is split over etp ranks (null: tp, megatron's
    # default). 1 keeps every expert whole (no 1/tp-wide GEMMs nor their collectives; the expert
    # data-parallel ranks are then the tp ranks too): the faster layout for many small experts.
    etp: Optional[int] = None
    # Memory of one training GPU in GiB, which the memory plan (rlf-train --plan, and every run's
    # start-up) must fit: on a GPU, the device's own or this if smaller; on a machine without one,
    # the GPU to plan for (null there: the plan is shown, not checked).
    device_memory_gib: Optional[float] = None


@dataclass
class OptimConfig:
    lr: float = 1e-6  # peak learning rate of the Adam optimizer
    min_lr: float = 0.0  # where linear/cosine decay ends
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.999  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's denominator epsilon
    clip_grad: float = 1.0  # global gradient-norm clip (0: none)
    warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    lr_decay_style: str = "constant"  # constant | linear | cosine
    # megatron's distributed optimizer: Adam's state sharded across DP ranks (ZeRO-1), on GPU and on
    # CPU (gloo); its checkpoint resumes at another DP size, not another tp/pp
    use_distributed_optimizer: bool = True


@dataclass
class RolloutCorrectionConfig:
    # Off-policy correction from the engines' own log-probs (algorithms/rollout_correction.py);
    # on, the trainer computes its own old log-probs every step.
    # null: on when trainer.max_staleness > 0 (tis_cap 2.0 unless set) or when a key below is set;
    # true: on (tis_cap 2.0 unless a key below is set); false: off (then no key below may be set).
    enable: Optional[bool] = None
    tis_cap: Optional[float] = None  # token-level truncated IS: weight min(pi_trainer / pi_engine, cap); null: off
    mask_low: Optional[float] = None  # leave out a sample whose geometric-mean ratio is below this; null: no bound
    mask_high: Optional[float] = None  # ... or above this; null: no bound


@dataclass
class ActorMoEConfig:
    # none | R2 | R3: R2, the old-log-prob pass records the routes each token takes in each MoE
    # layer and every forward of the update replays them, so the PPO ratio compares one expert
    # choice; R3, the engines record the routes they sampled with (prefix caching off), which come
    # back with each trajectory, are stored with it and are replayed in every trainer forward
    # (docs/moe.md).
    routing_replay: str = "none"


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = 1  # passes over each step's trajectories
    mini_batch_size: int = 8  # trajectories per optimizer step (a step's rows / this = optimizer steps per epoch)
    max_tokens_per_microbatch: int = 4096  # token budget of one packed micro-batch per DP rank
    policy_loss: str = "ppo"  # a name in rlfactory_megatron.algorithms.POLICY_LOSSES
    clip_ratio_low: Optional[float] = None  # PPO ratio clip below 1 (1 - low); null: the loss's own (0.2; gspo 3e-4)
    # PPO ratio clip above 1 (1 + high); null: the loss's own (= low; clip-higher 0.28, gspo 4e-4)
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = None  # dual-clip bound for negative advantages (policy_loss=dual-clip); null: 3.0
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    entropy_coeff: float = 0.0  # entropy bonus weight
    kl_loss_coef: float = 0.0  # KL-to-reference loss weight (> 0 builds the frozen reference model)
    kl_penalty: str = "low-var-kl"  # k1 | k2 | k3 | low-var-kl
    use_fused_logprob: bool = True  # log-probs/entropy from hidden states by the fused vocab-parallel kernel (no full logits)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    moe: ActorMoEConfig = field(default_factory=ActorMoEConfig)  # a mixture-of-experts actor's routes
    # Colocated engines: the actor's parameters, gradients and optimizer states, and the frozen
    # reference's parameters, wait in host memory while the engines generate (back on the device
    # when training needs them; the parameters after the weight sync)
    offload: bool = False


@dataclass
class CriticConfig:
    enable: bool = False  # train a value model (GAE); trainer.algorithm=ppo turns it on
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_epochs: int = 1  # passes of the value update over each step's trajectories
    cliprange_value: float = 0.5  # clip of the new value around the old one in the value loss
    offload: bool = False  # colocated engines: the critic's parameters, gradients and optimizer states wait in host memory while they generate


@dataclass
class RolloutConfig:
    # colocated: one engine per group of rollout.tp training ranks, on their devices (world / tp
    # engines, all generating; asleep while the model trains on GPU). disaggregated:
    # rollout.num_engines engines in Ray actors with rollout.tp devices each of their own,
    # behind a router on rank 0.
    mode: str = "colocated"
    num_engines: int = 0  # disaggregated: how many (>= 1); colocated: 0 (it is world / rollout.tp)
    engine: str = "vllm"  # a name in rlfactory_megatron.rollout.engines.ROLLOUT_ENGINES
    n: int = 4  # samples per prompt (a GRPO group)
    temperature: float = 1.0  # sampling temperature (0 = greedy); the trainer's log-probs use the same
    top_p: float = 1.0  # nucleus sampling mass (1: off)
    top_k: int = -1  # -1: off
    # a prompt's tokens as the model sees it (chat template and tool schemas included); longer
    # prompts go by rollout.truncation
    max_prompt_tokens: int = 1024
    # error: a longer prompt is refused at load, its row and length named; left: its first
    # tokens are cut (the last max_prompt_tokens kept); right: its last tokens are cut
    truncation: str = "error"
    max_response_tokens: int = 1024  # token budget of a whole trajectory after the prompt (all turns and observations)
    stop: list[str] = field(default_factory=list)  # extra stop strings (the tool format's end-of-turn ids always stop)
    tp: int = 1  # tensor-parallel size of each engine
    # requests each engine runs at once (vLLM's max_num_seqs; 1024 as verl); on CPU it also sizes
    # the KV cache below
    max_num_seqs: int = 1024
    # Same samples at any scale on GPU too: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT,
    # compute capability >= 8.0 as vLLM 0.32's code has them, though its comment says 9.0; an engine
    # refuses a GPU below at start), so that a seeded sample does not depend on the requests batched
    # with it, at a cost in generation speed. CPU engines are batch-invariant as built.
    batch_invariant: bool = False
    # A MoE model's engines return the experts each token was routed to in each layer, stored with
    # the trajectory; the trainer's forward on the sampling weights reports how often its own
    # router agrees (rollout/routing_agreement). null: exactly when actor.moe.routing_replay=R3,
    # which replays them; true under none or R2: compared, not replayed. Recording engines run
    # without prefix caching, eager (docs/moe.md).
    record_routes: Optional[bool] = None
    # vLLM's memory share; on CPU the KV cache is what max_num_seqs full-length sequences need,
    # at most this share of host memory
    gpu_memory_utilization: float = 0.5


@dataclass
class WeightSyncConfig:
    bucket_mb: int = 512  # weights move in buckets of this size (a fused q/k/v or gate/up group is never split)
    # a name in TRANSPORTS, or auto: the mode's own (colocated: in_process, disaggregated: broadcast)
    transport: str = "auto"


@dataclass
class ToolsConfig:
    # null: on where the run has tools (tools.config_path, or a built-in task's own); true: the same,
    # refused without tools to run; false: single-turn, no tools
    enable: Optional[bool] = None
    format: str = "qwen3"  # qwen3 | qwen2_5 | llama3
    config_path: Optional[str] = None  # YAML file declaring tools
    max_turns: int = 4  # policy turns per trajectory
    # per_sample: each trajectory takes its next turn as soon as its tool results are back; lockstep:
    # every trajectory of the batch generates turn k, then all run their tools, then turn k + 1
    turn_schedule: str = "per_sample"
    tool_response_max_tokens: int = 256  # an observation longer than this is truncated with a marker
    call_timeout_s: float = 10.0  # a call running longer is that call's timeout error
    num_workers: int = 2  # Ray actors running the tools
    max_concurrency: int = 64  # calls in flight per actor
    channel: str = "auto"  # how calls reach the tool actors: auto (Unix socket on this node, else TCP) | unix | tcp


@dataclass
class ModelRewardConfig:
    """The model reward (a judge's score), whichever route serves it: a judge on our own engines
    (kind, path, tp, num_engines, placement) or reward.remote; the prompt, the reply's parsing and
    the failure score are the routes' common part."""

    # generative: a judge served by our own vLLM engines (frozen, no weight sync), its reply read by
    # reward.model.parser; discriminative: a sequence-classification reward model (vLLM's pooling
    # runner), its logit the score; null: none (reward.remote.url may still serve one)
    kind: Optional[str] = None
    path: Optional[str] = None  # the judge's or reward model's Hugging Face folder (or tiny://qwen3 for a tiny test model)
    tp: int = 1  # tensor-parallel size of each judge engine
    # judge engines per generating process (placement own; colocated: 1)
    num_engines: int = 1
    # own: judge engines on devices of their own (Ray actors), judging each trajectory as soon as it
    # ends, overlapped with the rest of generation; colocated: one engine on each generating process's
    # devices, asleep while the policy generates, woken to judge the trajectories at the end
    placement: str = "own"
    max_prompt_tokens: int = 4096  # our judge: a longer prompt (task, tool calls, response) gets on_error
    # Our judge's share of each of its devices (vLLM's gpu_memory_utilization: weights + KV cache);
    # null: rollout.gpu_memory_utilization. Colocated, it is awake only while the policy engine sleeps.
    gpu_memory_utilization: Optional[float] = None
    # The judge's prompt (chat): a file or a string with {response}, and any of {prompt},
    # {ground_truth}, {tool_calls}; null: the built-in one (rewards/judge.py)
    template: Optional[str] = None
    # How a judge's reply becomes a score: a regex (its first group, of the last match) or file.py:function (reply -> float)
    parser: str = r"<score>\s*([-+]?[0-9]*\.?[0-9]+)\s*</score>"
    max_tokens: int = 512  # the judge's reply length cap
    temperature: float = 0.0  # the judge's sampling temperature (> 0 on our engines: seeded by the input)
    # The model score of a sample whose model reward failed (timed out, HTTP error, garbage, a reply that does not parse)
    on_error: float = 0.0


@dataclass
class RemoteRewardConfig:
    url: Optional[str] = None  # an HTTP endpoint scoring each sample (null: no remote reward)
    # chat: OpenAI-compatible chat completions (url: the full .../v1/chat/completions), the reply parsed by
    # reward.model.parser; score: POST {"prompt", "response", "label"}, read {"score": float}
    protocol: str = "score"
    served_model: Optional[str] = None  # chat: the request's "model" (the name the server serves the judge under)
    api_key_env: Optional[str] = None  # an environment variable holding a key sent as "Authorization: Bearer <key>"
    timeout_s: float = 30.0  # per request; a request taking longer is retried, then the sample gets reward.model.on_error
    max_retries: int = 2  # after a timeout, a connection error, a 429/5xx or an unreadable body
    backoff_s: float = 1.0  # the wait before the first retry, doubled before each next one
    max_concurrency: int = 16  # requests in flight per reward worker (reward.num_workers per generating process)


@dataclass
class RewardCombineConfig:
    """How the rule score (reward.scorer / custom function) and the model score make the reward;
    all null: the model score alone (the rule is not computed)."""

    rule_weight: Optional[float] = None  # reward = rule_weight * rule + model_weight * model (a null weight is 0)
    model_weight: Optional[float] = None  # the model score's weight in that sum
    # A Python file with combine(rule_score, model_score, data_source, solution_str, ground_truth, extra_info) -> float
    function_path: Optional[str] = None
    function_name: str = "combine"  # its name


@dataclass
class RewardConfig:
    scorer: Optional[str] = None  # a scorer name; null: each sample's data_source picks (openai/gsm8k -> gsm8k, ...)
    manager: str = "naive"  # naive | batch | prime | dapo
    # Options of the chosen manager, e.g. dapo: {max_response_length, overlong_buffer_len,
    # overlong_penalty_factor}; prime: {num_processes}. Checked against the manager's signature.
    manager_options: dict[str, Any] = field(default_factory=dict)
    custom_function_path: Optional[str] = None  # a Python file with your reward function (replaces the scorer)
    custom_function_name: Optional[str] = None  # its name (default compute_score)
    custom_function_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments it gets
    timeout_s: float = 10.0  # per sample: a score taking longer is that sample's timeout error (scored 0)
    num_workers: int = 1  # Ray actors scoring
    model: ModelRewardConfig = field(default_factory=ModelRewardConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    combine: RewardCombineConfig = field(default_factory=RewardCombineConfig)


@dataclass
class CacheConfig:
    enable: bool = True  # the HDF5 rollout store and the tool-result cache
    dir: Optional[str] = None  # default: <trainer.output_dir>/cache
    tool_cache_max_mb: int = 1024  # size cap of cached tool results (oldest evicted)
    tool_cache_ttl_s: Optional[float] = None  # cached results older than this are not used (null: forever)


@dataclass
class TrainerConfig:
    algorithm: str = "grpo"  # ppo | grpo | dapo | gspo | reinforce_pp | rloo
    # RL steps; 0: the SFT warm-start alone, saved as checkpoint 0 (its hf/ folder: a model taught
    # at run time, e.g. a judge on trainer.task=calculator_judge, docs/rewards.md)
    total_steps: int = 20
    prompts_per_step: int = 8  # prompts per step (each sampled rollout.n times)
    seed: int = 1234  # every RNG, prompt order and each sample's sampling seed (from seed, step, row)
    # metrics, TensorBoard, checkpoints, cache, logs; one run's (a resume with other settings that
    # change its trajectories is refused). null: outputs/<config file's name> (outputs/default
    # without --config), the same folder again for a requeued job
    output_dir: Optional[str] = None
    save_every: int = 10  # checkpoint every N steps and after the last (0: no checkpoints)
    keep_last: int = 2  # checkpoints kept
    # Each checkpoint also holds the actor as a HF folder (<checkpoint>/hf: config, tokenizer,
    # chat template, safetensors), written streaming from rank 0, so the trained model leaves
    # as it came. Costs a copy of the weights in the model's dtype (bf16: 2 bytes a parameter
    # beside the checkpoint's ~14 of weights, fp32 master copy and Adam moments) and an export
    # as long as a weight sync. false: `rlf-convert mcore-to-hf --mcore-dir <checkpoint>` later.
    save_hf: bool = True
    # auto (the output folder's latest checkpoint) | never | <checkpoint dir>; a resume whose settings
    # differ from the checkpoint's in a key that changes the model or its trajectories is refused
    resume: str = "auto"
    val_every: int = 10  # greedy validation every N steps and before RL (0: never)
    # held-out prompts per validation (a 0/1 score's mean over 256 has a standard error of <= 3 points)
    val_prompts: int = 256
    # Supervised warm-start before RL on demonstrations (the built-in task's, or a `demonstration`
    # column of trainer.data_path): steps, rows per step, and its own constant LR.
    sft_steps: int = 0
    sft_batch_size: int = 32  # demonstrations per warm-start step
    sft_lr: float = 1e-5  # the warm-start's (peak) learning rate
    sft_lr_decay_style: str = "constant"  # constant | linear | cosine: the warm-start's LR from sft_lr towards 0 over sft_steps
    # A folder of warm-start results (trainer/warm_start_cache.py): a run whose warm-start would
    # equal a stored one (same model files, demonstrations, actor/model/parallel settings, sft_*,
    # seed, total_steps, world size, threads) loads it instead of computing it; else it stores
    # its own. All ranks must see the folder. null: every run computes its warm-start.
    sft_cache: Optional[str] = None
    # parquet/jsonl (relative paths in a config file: from the file's folder); a run names this or
    # trainer.task, never both
    data_path: Optional[str] = None
    val_data_path: Optional[str] = None  # None: a held-out set (a fresh draw of the task, or data_path's last rows)
    # a built-in task (rlfactory_megatron.trainer.tasks.TASKS: prompts, tools, demonstrations) instead of
    # trainer.data_path; the embedded default's is calculator_arithmetic
    task: Optional[str] = None
    # Dynamic sampling (trainer.algorithm=dapo): further rollout rounds per step to replace
    # groups whose samples all scored the same.
    max_refill_rounds: int = 3
    # Optimizer steps (actor or critic) skipped in a row for a non-finite loss or gradient before
    # the run stops with an error; a skipped step applies nothing (counted in actor/skipped_steps).
    max_skipped_updates: int = 8
    # Asynchronous RL (rollout.mode=disaggregated): step i trains batch i, and batch j starts
    # generating once the engines serve weight version j - max_staleness, so the engines generate
    # the next batches while the actor trains and no trained token is more than max_staleness
    # updates old. 0: synchronous steps (generate, then train).
    max_staleness: int = 0
    # With max_staleness > 0: weight updates land while batches generate (each engine ends its
    # requests between two decode steps for the sync; they go on from their tokens on the new
    # weights, and every token carries the version that generated it). false: a sync
    # first waits for the batches in flight, so each batch is one version's and a run (and its
    # resume) is reproducible.
    partial_rollout: bool = False


@dataclass
class LoggingConfig:
    jsonl: bool = True  # <output_dir>/metrics.jsonl, one object per step
    tensorboard: bool = True  # <output_dir>/tensorboard
    # Weights & Biases (installed in both stacks): also log every step to this project, with the
    # run's whole config; a resumed run continues the same wandb run (its id is in the checkpoint).
    wandb_project: Optional[str] = None
    wandb_name: Optional[str] = None  # the wandb run's name (null: the output folder's name)
    wandb_entity: Optional[str] = None  # the team or user the run goes to (null: wandb's default)
    wandb_tags: list[str] = field(default_factory=list)  # tags of the wandb run
    wandb_mode: str = "online"  # online | offline (written under <output_dir>/wandb; `wandb sync` uploads it later)
    log_every: int = 1  # a console progress line every N steps (and the last); the metric files get every step


@dataclass
class RLFConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
