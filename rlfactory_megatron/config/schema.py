"""The one typed configuration tree (OmegaConf structured config) for every rlfactory-megatron run."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    path: str = "tiny://qwen3"  # HF folder, or tiny://<llama|qwen2|qwen3> for a locally built tiny model
    params_dtype: str = "float32"  # float32 | bfloat16 | float16
    layer_spec: str = "auto"  # auto (TE on GPU, local_sdpa on CPU) | local_sdpa | local | transformer_engine
    recompute_activations: bool = False


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    sequence_parallel: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    use_distributed_optimizer: bool = True


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = 1
    mini_batch_size: int = 8
    max_tokens_per_microbatch: int = 4096
    policy_loss: str = "ppo"  # a name in rlfactory_megatron.algorithms.POLICY_LOSSES
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0
    kl_penalty: str = "low-var-kl"  # k1 | k2 | k3 | low-var-kl
    use_fused_logprob: bool = True


@dataclass
class CriticConfig:
    enable: bool = False
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_epochs: int = 1
    cliprange_value: float = 0.5


@dataclass
class RolloutConfig:
    # colocated: one engine per group of rollout.tp training ranks, on their devices (world / tp
    # engines, all generating; asleep while the model trains on GPU). disaggregated:
    # rollout.num_engines engines in Ray actors with rollout.tp devices each of their own,
    # behind a router on rank 0.
    mode: str = "colocated"
    num_engines: int = 0  # disaggregated: how many (>= 1); colocated: 0 (it is world / rollout.tp)
    engine: str = "vllm"  # a name in rlfactory_megatron.rollout.engines.ROLLOUT_ENGINES
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_prompt_tokens: int = 256
    max_response_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    tp: int = 1
    gpu_memory_utilization: float = 0.5


@dataclass
class WeightSyncConfig:
    bucket_mb: int = 512
    # a name in TRANSPORTS, or auto: the mode's own (colocated: in_process, disaggregated: broadcast)
    transport: str = "auto"


@dataclass
class ToolsConfig:
    enable: bool = True
    format: str = "qwen3"  # qwen3 | qwen2_5 | llama3
    config_path: Optional[str] = None  # YAML file declaring tools
    max_turns: int = 4
    tool_response_max_tokens: int = 256
    call_timeout_s: float = 10.0
    num_workers: int = 2
    max_concurrency: int = 64
    channel: str = "auto"  # how calls reach the tool actors: auto (Unix socket on this node, else TCP) | unix | tcp


@dataclass
class RewardConfig:
    scorer: str = "gsm8k"
    manager: str = "naive"  # naive | batch | prime | dapo
    # Options of the chosen manager, e.g. dapo: {max_response_length, overlong_buffer_len,
    # overlong_penalty_factor}; prime: {num_processes}. Checked against the manager's signature.
    manager_options: dict[str, Any] = field(default_factory=dict)
    custom_function_path: Optional[str] = None
    custom_function_name: Optional[str] = None
    custom_function_kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 10.0
    num_workers: int = 1


@dataclass
class CacheConfig:
    enable: bool = True
    dir: Optional[str] = None  # default: <trainer.output_dir>/cache
    tool_cache_max_mb: int = 1024
    tool_cache_ttl_s: Optional[float] = None


@dataclass
class TrainerConfig:
    algorithm: str = "grpo"  # ppo | grpo | dapo | gspo | reinforce_pp | rloo
    total_steps: int = 20
    prompts_per_step: int = 8
    seed: int = 1234
    output_dir: str = "outputs/default"
    save_every: int = 10
    keep_last: int = 2
    resume: str = "auto"  # auto | never | <checkpoint dir>
    val_every: int = 5
    val_prompts: int = 16
    # Supervised warm-start before RL on demonstrations (the built-in task's, or a `demonstration`
    # column of trainer.data_path): steps, rows per step, and its own constant LR.
    sft_steps: int = 0
    sft_batch_size: int = 32
    sft_lr: float = 1e-3
    data_path: Optional[str] = None  # parquet/jsonl; None = the built-in task `trainer.task`
    val_data_path: Optional[str] = None  # None: a held-out set (a fresh draw of the task, or data_path's last rows)
    task: str = "calculator_arithmetic"  # a name in rlfactory_megatron.trainer.tasks.TASKS
    # Dynamic sampling (trainer.algorithm=dapo): further rollout rounds per step to replace
    # groups whose samples all scored the same.
    max_refill_rounds: int = 3
    # Optimizer steps (actor or critic) skipped in a row for a non-finite loss or gradient before
    # the run stops with an error; a skipped step applies nothing (counted in actor/skipped_steps).
    max_skipped_updates: int = 8


@dataclass
class LoggingConfig:
    jsonl: bool = True
    tensorboard: bool = True
    wandb_project: Optional[str] = None
    log_every: int = 1


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
