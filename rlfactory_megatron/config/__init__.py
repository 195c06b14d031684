"""Load, override and validate the run configuration before any process group or model exists."""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Collection, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlfactory_megatron.config.schema import MoEConfig, RLFConfig

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
POSITIVE_INTS = ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep", "parallel.etp", "rollout.n", "rollout.tp", "actor.ppo_epochs",
                 "actor.mini_batch_size", "actor.max_tokens_per_microbatch",
                 "trainer.prompts_per_step", "weight_sync.bucket_mb", "tools.max_turns", "trainer.sft_batch_size",
                 "trainer.max_skipped_updates", "rollout.max_prompt_tokens", "rollout.max_response_tokens",
                 "tools.tool_response_max_tokens", "tools.num_workers", "tools.max_concurrency", "reward.num_workers",
                 "critic.ppo_epochs", "trainer.keep_last", "cache.tool_cache_max_mb", "logging.log_every",
                 "rollout.max_num_seqs", "reward.remote.max_concurrency", "reward.model.max_tokens")
NON_NEGATIVE = ("trainer.total_steps", "model.moe.aux_loss_coeff", "model.moe.z_loss_coeff", "trainer.save_every", "trainer.val_every", "trainer.val_prompts", "trainer.sft_steps", "trainer.max_refill_rounds",
                "trainer.max_staleness",
                "actor.optim.warmup_steps", "critic.optim.warmup_steps", "actor.optim.min_lr", "critic.optim.min_lr",
                "actor.optim.weight_decay", "critic.optim.weight_decay", "actor.optim.clip_grad", "reward.remote.max_retries",
                "reward.remote.backoff_s", "reward.model.temperature",
                "critic.optim.clip_grad", "actor.kl_loss_coef", "actor.clip_ratio_low", "actor.clip_ratio_high")
POSITIVE = ("actor.optim.lr", "critic.optim.lr", "trainer.sft_lr", "actor.optim.adam_eps", "critic.optim.adam_eps",
            "reward.timeout_s", "tools.call_timeout_s", "critic.cliprange_value", "reward.remote.timeout_s")


def closed_sets(cfg) -> dict[str, Collection[str]]:
    """Every key whose value is one of a closed set -> the names it may take: the registry that
    holds them (a new entry is allowed as soon as it registers), a fixed tuple where no registry
    does. `auto` is allowed where load_config resolves it (or, for tools.channel, each node)."""
    from rlfactory_megatron.algorithms.aggregation import LOSS_AGGREGATIONS
    from rlfactory_megatron.algorithms.kl import KL_PENALTIES
    from rlfactory_megatron.algorithms.policy_losses import POLICY_LOSSES
    from rlfactory_megatron.envs.agent_loop import TURN_SCHEDULES
    from rlfactory_megatron.envs.tool_manager import TOOL_FORMATS
    from rlfactory_megatron.models.builder import LAYER_SPECS, RECOMPUTE
    from rlfactory_megatron.rewards import PROTOCOLS, REWARD_MANAGERS
    from rlfactory_megatron.rollout import ray_engine  # noqa: F401  (registers the broadcast transport)
    from rlfactory_megatron.rollout.engines import ROLLOUT_ENGINES
    from rlfactory_megatron.rollout.modes import ROLLOUT_MODES
    from rlfactory_megatron.rollout.weight_sync import TRANSPORTS
    from rlfactory_megatron.trainer.presets import ALGORITHM_PRESETS
    from rlfactory_megatron.trainer.tasks import TASKS

    decay_styles = ("constant", "linear", "cosine")
    sets = {
        "model.params_dtype": ("auto", "float32", "bfloat16", "float16"),
        "model.layer_spec": LAYER_SPECS,
        "model.recompute": ("auto", *RECOMPUTE),
        "model.moe.load_balancing": ("none", "aux_loss", "seq_aux_loss"),
        "model.moe.router_dtype": ("fp32", "fp64"),
        "actor.moe.routing_replay": ("none", "R2", "R3"),
        "actor.policy_loss": POLICY_LOSSES,
        "actor.kl_penalty": KL_PENALTIES,
        "actor.loss_agg_mode": LOSS_AGGREGATIONS,
        "actor.optim.lr_decay_style": decay_styles,
        "critic.optim.lr_decay_style": decay_styles,
        "trainer.algorithm": ALGORITHM_PRESETS,
        "trainer.sft_lr_decay_style": decay_styles,
        "rollout.mode": ROLLOUT_MODES,
        "rollout.engine": ROLLOUT_ENGINES,
        "rollout.truncation": ("error", "left", "right"),
        "weight_sync.transport": ("auto", *TRANSPORTS),
        "tools.format": TOOL_FORMATS,
        "tools.channel": ("auto", "unix", "tcp"),
        "tools.turn_schedule": TURN_SCHEDULES,
        "reward.manager": REWARD_MANAGERS,
        "reward.remote.protocol": PROTOCOLS,
        "logging.wandb_mode": ("online", "offline"),
    }
    if cfg.trainer.task is not None:  # a run with its own data names no built-in task
        sets["trainer.task"] = TASKS
    return sets


# Refusals that say more than "is not allowed": (what the value is not, what else would do).
_REFUSALS = {"trainer.task": ("is not a built-in task", " (or give your data as trainer.data_path)")}


class ConfigError(ValueError):
    """A configuration key is unknown, mistyped or inconsistent; the message names it."""


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), for_gpu: bool = False,
                preset_log: list[str] | None = None) -> RLFConfig:
    """Schema <- the YAML at `path` (or, without one, default.yaml: the embedded default's
    tiny-model run) <- dotted `key=value` overrides, validated and resolved: the algorithm's
    preset filled in where the user set no value (its `key=value` settings appended to
    `preset_log`, for the start-up log), `auto` values made concrete. A file starts from the
    schema's defaults, never from the embedded default's; its relative input paths are its
    folder's. `for_gpu`: `auto` settings as a GPU node resolves them, on any machine
    (`rlf-train --plan` on a login node)."""
    try:
        cfg = OmegaConf.structured(RLFConfig)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override '{item}' must look like key=value (e.g. actor.optim.lr=1e-6)")
        overridden = OmegaConf.from_dotlist(list(overrides))
        if path is not None:
            if not Path(path).is_file():
                raise ConfigError(f"config file '{path}' does not exist")
            given = _load_yaml(path)
            _refuse_tools_file(given, path)
            _paths_from_file(given, Path(path).parent)
        else:
            given = OmegaConf.load(DEFAULT_CONFIG)
            if OmegaConf.select(overridden, "trainer.data_path") and OmegaConf.select(overridden, "trainer.task") is None:
                given.trainer.task = None  # the user's data replaces the embedded default's task
        cfg = OmegaConf.merge(cfg, given, overridden)
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    if cfg.trainer.output_dir is None:  # one folder per config file: a requeued job finds its checkpoints
        cfg.trainer.output_dir = str(Path("outputs") / Path(path).stem) if path is not None else "outputs/default"
    validate_static(cfg)
    from rlfactory_megatron.trainer.presets import apply_preset

    applied = apply_preset(cfg, user_set=_leaf_keys(given) | _leaf_keys(overridden))
    if preset_log is not None:
        preset_log.extend(applied)
    _resolve_auto(cfg, for_gpu)
    return cfg


# Keys naming an input file or folder. In a config file a relative one is the file's folder's
# (as users expect of config files); one found only from the working directory still works.
INPUT_PATH_KEYS = ("model.path", "trainer.data_path", "trainer.val_data_path", "tools.config_path",
                   "reward.custom_function_path", "reward.combine.function_path", "reward.model.path",
                   "reward.model.template", "reward.model.parser")


def _paths_from_file(given, folder: Path) -> None:
    import re

    for key in INPUT_PATH_KEYS:
        value = OmegaConf.select(given, key, default=None, throw_on_resolution_failure=False)
        if not isinstance(value, str) or not value or "://" in value or "${" in value:
            continue
        suffix = ""
        if key == "reward.model.parser":  # a regex, or file.py:function
            match = re.fullmatch(r"(.+\.py)(:\w+)", value)
            if match is None:
                continue
            value, suffix = match.groups()
        file = Path(value).expanduser()
        if file.is_absolute():
            continue
        beside = Path(os.path.abspath(folder / file))
        if beside.exists():
            OmegaConf.update(given, key, str(beside) + suffix)
        elif not file.exists() and key != "reward.model.template":  # a template may be the text itself
            OmegaConf.update(given, key, str(beside) + suffix)  # so that an error names where it was looked for


def _refuse_tools_file(given, path) -> None:
    """A tools YAML given as --config would fail as "invalid value for config key ''"."""
    if OmegaConf.is_list(given) or OmegaConf.is_list(given.get("tools")):
        raise ConfigError(f"--config {path} is a tools file (a 'tools:' list), not a run config: give it as "
                          f"tools.config_path={path}")


def config_from_yaml(text: str) -> RLFConfig:
    """A whole config as `to_yaml` wrote it (what rlf-train hands each of its ranks), validated;
    load_config resolved it, so it is used as it is."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RLFConfig), OmegaConf.create(text))
    except OmegaConfBaseException as exc:
        raise ConfigError(_explain(exc)) from None
    validate_static(cfg)
    _resolve_auto(cfg)
    return cfg


def leaf_values(tree, prefix: str = "") -> dict:
    """A config (or a plain container of one) as dotted key -> value of each leaf (an empty section
    is a leaf); a config's interpolations stay unresolved (they resolve in the whole tree only)."""
    if OmegaConf.is_config(tree):
        tree = OmegaConf.to_container(tree, resolve=False)
    if not isinstance(tree, dict) or not tree:
        return {prefix[:-1]: tree}
    leaves = {}
    for key, value in tree.items():
        leaves.update(leaf_values(value, f"{prefix}{key}."))
    return leaves


def _leaf_keys(node) -> set[str]:
    """The dotted keys a YAML file or the overrides give a value (what the user set)."""
    return set(leaf_values(node)) if node else set()


def _resolve_auto(cfg, for_gpu: bool = False) -> None:
    """`auto` values made concrete once, so that every rank, the engines and the saved config see
    the same: the parameters' dtype for the layer spec on this machine, the mode's own weight-sync
    transport, the judge's device share. (`model.layer_spec` and `tools.channel` stay `auto`: each node resolves them for
    its own devices and network.)"""
    from rlfactory_megatron.models.builder import resolve_params_dtype
    from rlfactory_megatron.rollout.modes import ROLLOUT_MODES

    try:
        cfg.model.params_dtype = resolve_params_dtype(cfg.model.params_dtype, cfg.model.layer_spec, for_gpu)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.weight_sync.transport == "auto":
        cfg.weight_sync.transport = ROLLOUT_MODES.get(cfg.rollout.mode).transport
    _resolve_tools(cfg)
    if cfg.reward.model.gpu_memory_utilization is None:
        cfg.reward.model.gpu_memory_utilization = cfg.rollout.gpu_memory_utilization
    if cfg.rollout.record_routes is None:  # R3 replays the engines' routes: they must record them
        cfg.rollout.record_routes = cfg.actor.moe.routing_replay == "R3"
    elif not cfg.rollout.record_routes and cfg.actor.moe.routing_replay == "R3":
        raise ConfigError("rollout.record_routes=false: actor.moe.routing_replay=R3 replays the routes the engines "
                          "record; leave rollout.record_routes out (null) or choose routing_replay none or R2")


def _resolve_tools(cfg) -> None:
    """Tools are on where the run declares some: a tools file, or its built-in task's own (a
    user's data never gets the embedded default's calculator)."""
    from rlfactory_megatron.trainer.tasks import TASKS

    declared = bool(cfg.tools.config_path) or bool(cfg.trainer.task and TASKS.get(cfg.trainer.task).tools)
    if cfg.tools.enable is None:
        cfg.tools.enable = declared
    elif cfg.tools.enable and not declared:
        raise ConfigError("tools.enable=true, and the run declares no tools: give tools.config_path=<a tools YAML> "
                          "(docs/tools.md), or leave tools.enable out")


def _load_yaml(path: str | Path):
    """A YAML file as a config node; a syntax error names the file, line and column."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error: {problem}; fix the file's syntax") from None


def _explain(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not" in msg:
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        return f"unknown config key '{key}'" + (
            f"; valid keys under '{parent}': {', '.join(_keys_under(parent))}" if parent else
            f"; valid sections: {', '.join(_keys_under(''))}")
    return f"invalid value for config key '{key}': {msg}"


def _keys_under(prefix: str) -> list[str]:
    node = OmegaConf.structured(RLFConfig)
    for part in [p for p in prefix.split(".") if p]:
        node = node[part]
    return sorted(node.keys())


def validate_static(cfg) -> None:
    """Checks that need no model or process group."""
    if OmegaConf.is_missing(cfg.model, "path"):
        raise ConfigError("model.path is required: a HF model folder (or tiny://qwen3 for a tiny test model); "
                          "a run with --config starts from the schema's defaults, which name no model")
    _check_prompt_source(cfg)
    for key, allowed in closed_sets(cfg).items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            refusal, alternative = _REFUSALS.get(key, ("is not allowed", ""))
            raise ConfigError(f"{key}='{value}' {refusal}; choose one of: {', '.join(allowed)}{alternative}")
    for keys, ok, rule in ((POSITIVE_INTS, lambda v: v >= 1, ">= 1"), (NON_NEGATIVE, lambda v: v >= 0, ">= 0"),
                           (POSITIVE, lambda v: v > 0, "> 0")):
        for key in keys:
            value = OmegaConf.select(cfg, key)
            if value is not None and not ok(value):  # null: the setting's own default (e.g. the loss's clips)
                raise ConfigError(f"{key}={value} must be {rule}")
    _check_ranges(cfg)
    # Checked here, not at the first generate after minutes of set-up and SFT; the trainer's
    # log-probs are of the same tempered distribution.
    if not cfg.rollout.temperature >= 0:
        raise ConfigError(f"rollout.temperature={cfg.rollout.temperature} must be >= 0 (0 = greedy)")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p} must be in (0, 1]")
    _validate_rollout(cfg)
    if cfg.trainer.sft_cache and cfg.trainer.sft_steps == 0:
        raise ConfigError(f"trainer.sft_cache={cfg.trainer.sft_cache} stores warm-starts, and this run has none "
                          "(trainer.sft_steps=0); set trainer.sft_steps > 0 or trainer.sft_cache=null")
    if cfg.parallel.vpp is not None and cfg.parallel.pp < 2:
        raise ConfigError(f"parallel.vpp={cfg.parallel.vpp} needs parallel.pp >= 2 (or set parallel.vpp=null)")
    _check_context_parallel(cfg)
    moe = cfg.model.moe
    if (moe.load_balancing == "none") != (moe.aux_loss_coeff == 0):
        raise ConfigError(f"model.moe.aux_loss_coeff={moe.aux_loss_coeff} with model.moe.load_balancing="
                          f"{moe.load_balancing}: the coefficient weighs that loss; set both (e.g. aux_loss and "
                          "1e-3) or neither (none and 0)")
    _check_rewards_and_tools(cfg)
    _check_wandb(cfg.logging)
    _check_memory_keys(cfg)


def _check_prompt_source(cfg) -> None:
    """A run trains on its own data or on a built-in task, never both and never neither: a user's
    config never falls back to the embedded default's toy task."""
    trainer = cfg.trainer
    if trainer.data_path and trainer.task:
        raise ConfigError(f"trainer.task={trainer.task} and trainer.data_path={trainer.data_path}: a run trains on one of "
                          "them; drop trainer.task (to train on your data) or trainer.data_path (the built-in task)")
    if not trainer.data_path and not trainer.task:
        raise ConfigError("trainer.data_path is not set: give the run's prompts as trainer.data_path=<a .parquet or "
                          ".jsonl file>, or name a built-in task with trainer.task (e.g. calculator_arithmetic)")
    if trainer.val_data_path and not trainer.data_path:
        raise ConfigError(f"trainer.val_data_path={trainer.val_data_path} goes with trainer.data_path; a built-in "
                          f"task (trainer.task={trainer.task}) draws its own held-out prompts: drop it")


def check_inputs(cfg, plan_only: bool = False) -> None:
    """What a run reads, found where the config says (rlf-train checks it before every command):
    its data files, model folders (config.json, tokenizer, the policy's chat template) and the
    checkpoint trainer.resume names. `plan_only`: what `--plan` reads, the model's config.json
    (a job is planned on a login node without its data)."""
    from rlfactory_megatron.trainer.checkpoint import STATE_FILE
    from rlfactory_megatron.trainer.model_path import TINY_SCHEME, resolve_model_path

    resume = cfg.trainer.resume
    if resume not in ("auto", "never") and not (Path(resume) / STATE_FILE).is_file():
        raise ConfigError(f"trainer.resume='{resume}' is not auto, never or a checkpoint folder (one holding "
                          f"{STATE_FILE}, e.g. <output_dir>/checkpoints/step_000010)")
    for key in () if plan_only else ("trainer.data_path", "trainer.val_data_path"):
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).expanduser().is_file():
            raise ConfigError(f"{key}='{value}' does not exist; give a .parquet or .jsonl file")
    for key in ("model.path",) if plan_only else ("model.path", "reward.model.path"):
        path = OmegaConf.select(cfg, key)
        if path and not path.startswith(TINY_SCHEME):
            try:
                resolve_model_path(path, key, tokenizer=not plan_only)  # a local folder: only checked
            except ValueError as exc:
                raise ConfigError(str(exc)) from None


def _check_context_parallel(cfg) -> None:
    """CP splits packed THD sequences (each into 2 x cp chunks): an attention that takes them, and
    a token budget that splits evenly."""
    from rlfactory_megatron.runtime.cpu_compat import cuda_available

    cp = cfg.parallel.cp
    if cp == 1:
        return
    spec = cfg.model.layer_spec
    if spec == "local" or (spec == "local_sdpa" and cuda_available()):
        where = " on GPU" if spec == "local_sdpa" else ""
        raise ConfigError(f"parallel.cp={cp} needs an attention that splits packed sequences over the CP group, and "
                          f"model.layer_spec={spec} has none{where}; use model.layer_spec=auto (transformer_engine "
                          "on GPU, local_sdpa on CPU)")
    budget = cfg.actor.max_tokens_per_microbatch
    if budget % (2 * cp):
        raise ConfigError(f"actor.max_tokens_per_microbatch={budget} must be a multiple of 2 x parallel.cp = {2 * cp} "
                          f"(every sequence is split into 2 x cp chunks); use {-(-budget // (2 * cp)) * 2 * cp}")


def _check_wandb(logging) -> None:
    """wandb settings without a project would be ignored; a project without wandb installed would
    be found out at the first step (and only in the rank's log)."""
    if logging.wandb_project is None:
        ignored = [f"logging.{k}" for k in ("wandb_name", "wandb_entity", "wandb_tags") if logging[k]]
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} set without logging.wandb_project: give the project (or drop them)")
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(f"logging.wandb_project='{logging.wandb_project}' needs wandb, which is not installed: "
                          ".venv/bin/pip install wandb (or ./install.sh), or drop logging.wandb_project") from None


def _check_memory_keys(cfg) -> None:
    """Offload frees the device for colocated engines only, and only the state of a model the run has."""
    from rlfactory_megatron.trainer.presets import trains_critic

    gib = cfg.parallel.device_memory_gib
    if gib is not None and not gib > 0:
        raise ConfigError(f"parallel.device_memory_gib={gib} must be > 0 (one GPU's memory in GiB, e.g. 79), or null")
    for section in ("actor", "critic"):
        if cfg[section].offload and cfg.rollout.mode != "colocated":
            raise ConfigError(f"{section}.offload=true makes room for colocated engines, and rollout.mode="
                              f"{cfg.rollout.mode} engines have devices of their own; set {section}.offload=false")
    if cfg.critic.offload and not trains_critic(cfg):
        raise ConfigError(f"critic.offload=true, and trainer.algorithm={cfg.trainer.algorithm} trains no critic "
                          "(critic.enable=false); set critic.offload=false")


def _check_ranges(cfg) -> None:
    for section in ("actor", "critic"):
        optim = cfg[section].optim
        for beta in ("adam_beta1", "adam_beta2"):
            if not 0 <= optim[beta] < 1:
                raise ConfigError(f"{section}.optim.{beta}={optim[beta]} must be in [0, 1)")
        if optim.min_lr > optim.lr:
            raise ConfigError(f"{section}.optim.min_lr={optim.min_lr} must not exceed {section}.optim.lr={optim.lr}")
    if cfg.actor.clip_ratio_c is not None and not cfg.actor.clip_ratio_c > 1:
        raise ConfigError(f"actor.clip_ratio_c={cfg.actor.clip_ratio_c} must be > 1 (dual-clip's lower bound is -c * A)")
    correction = cfg.actor.rollout_correction
    if correction.tis_cap is not None and not correction.tis_cap > 0:
        raise ConfigError(f"actor.rollout_correction.tis_cap={correction.tis_cap} must be > 0 (e.g. 2.0), or null for off")
    if correction.mask_low is not None and not 0 < correction.mask_low <= 1:
        raise ConfigError(f"actor.rollout_correction.mask_low={correction.mask_low} must be in (0, 1] (e.g. 0.5), "
                          f"or null for no lower bound")
    if correction.mask_high is not None and not correction.mask_high >= 1:
        raise ConfigError(f"actor.rollout_correction.mask_high={correction.mask_high} must be >= 1 (e.g. 2.0), "
                          f"or null for no upper bound")
    if correction.enable is False and any(correction[k] is not None for k in ("tis_cap", "mask_low", "mask_high")):
        raise ConfigError("actor.rollout_correction.enable=false turns the correction off, but "
                          f"{', '.join(f'{k}={correction[k]}' for k in ('tis_cap', 'mask_low', 'mask_high') if correction[k] is not None)}"
                          " is set; drop it or set enable=null")
    if cfg.trainer.val_every > 0 and cfg.trainer.val_prompts < 1:
        raise ConfigError(f"trainer.val_prompts=0 leaves nothing to validate on every trainer.val_every="
                          f"{cfg.trainer.val_every} steps; give trainer.val_prompts >= 1 or set trainer.val_every=0")
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        raise ConfigError(f"rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} must be in (0, 1]")
    judge_share = cfg.reward.model.gpu_memory_utilization
    if judge_share is not None and not 0 < judge_share <= 1:
        raise ConfigError(f"reward.model.gpu_memory_utilization={judge_share} must be in (0, 1] (or null: "
                          "rollout.gpu_memory_utilization)")


def _check_rewards_and_tools(cfg) -> None:
    """The reward function (imported, signature checked) and the tools YAML's classes and
    params: failing here costs nothing, failing in the run comes after the model and engines."""
    from rlfactory_megatron.envs.tools.registry import check_tool_specs, load_tool_specs
    from rlfactory_megatron.rewards import CombineSpec, JudgeSpec, RemoteRewardSpec, RewardFnSpec
    from rlfactory_megatron.rewards.managers import check_reward_config

    try:
        check_reward_config(cfg.reward.manager, RewardFnSpec.from_config(cfg.reward),
                            dict(cfg.reward.manager_options), RemoteRewardSpec.from_config(cfg.reward),
                            CombineSpec.from_config(cfg.reward.combine), JudgeSpec.from_config(cfg.reward))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.tools.enable is False and cfg.tools.config_path:
        raise ConfigError(f"tools.config_path={cfg.tools.config_path} with tools.enable=false: the tools would not "
                          "run; drop one of them")
    if cfg.tools.config_path:
        path = cfg.tools.config_path
        if not Path(path).is_file():
            raise ConfigError(f"tools.config_path='{path}' does not exist; give a YAML file with a 'tools:' list")
        try:
            check_tool_specs(load_tool_specs(path))
        except Exception as exc:  # the file's YAML or schema, a tool class unknown or given other params
            raise ConfigError(f"tools.config_path={path}: {str(exc).splitlines()[0]}") from None


def _validate_rollout(cfg) -> None:
    """The transport must suit the mode; engines for the mode."""
    from rlfactory_megatron.rollout.modes import ROLLOUT_MODES

    usable = ROLLOUT_MODES.get(cfg.rollout.mode).transport
    if cfg.weight_sync.transport not in ("auto", usable):
        raise ConfigError(f"weight_sync.transport='{cfg.weight_sync.transport}' cannot feed rollout.mode="
                          f"'{cfg.rollout.mode}' engines; use auto or {usable}")
    engines = cfg.rollout.num_engines
    if cfg.rollout.mode == "disaggregated" and engines < 1:
        raise ConfigError(f"rollout.num_engines={engines}: rollout.mode=disaggregated runs that many engines of "
                          "their own; set rollout.num_engines >= 1")
    if cfg.rollout.mode == "colocated" and engines < 0:
        raise ConfigError(f"rollout.num_engines={engines}: must be >= 0 (colocated: 0, or world / rollout.tp)")
    _check_asynchronous(cfg)


def _check_asynchronous(cfg) -> None:
    """What asynchronous RL (trainer.max_staleness > 0) can run with."""
    staleness = cfg.trainer.max_staleness
    if cfg.trainer.partial_rollout and staleness == 0:
        raise ConfigError("trainer.partial_rollout=true lands weight updates in batches still generating, which "
                          "needs trainer.max_staleness >= 1 (with 0 no batch generates during an update)")
    if staleness == 0:
        return
    if cfg.rollout.mode != "disaggregated":
        raise ConfigError(f"trainer.max_staleness={staleness} needs rollout.mode=disaggregated (engines on devices of "
                          "their own): colocated engines share the training ranks' devices and take turns with "
                          "training; set rollout.mode=disaggregated rollout.num_engines=N, or trainer.max_staleness=0")
    from rlfactory_megatron.trainer.presets import ALGORITHM_PRESETS

    if cfg.trainer.algorithm in ALGORITHM_PRESETS and ALGORITHM_PRESETS.get(cfg.trainer.algorithm).drop_uniform_groups:
        raise ConfigError(f"trainer.algorithm={cfg.trainer.algorithm} (dynamic sampling refills a step's groups from "
                          f"its rewards) is synchronous only; set trainer.max_staleness=0 or another algorithm")


def validate_against_model(cfg, arch, world_size: int) -> None:
    """Checks that need the model's shape and the job's size; run before initializing anything."""
    tp, pp, vpp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp
    cp = OmegaConf.select(cfg, "parallel.cp", default=1)
    # (rlf-convert checks a model layout alone: a config without a rollout section)
    if OmegaConf.select(cfg, "rollout.mode") == "colocated":
        if world_size % cfg.rollout.tp != 0:
            raise ConfigError(f"rollout.tp={cfg.rollout.tp} does not divide the world of {world_size} rank(s): "
                              f"colocated mode runs one engine per rollout.tp ranks; use rollout.tp in "
                              f"{{{', '.join(str(d) for d in _divisors(world_size))}}}")
        engines = cfg.rollout.num_engines
        if engines not in (0, world_size // cfg.rollout.tp):
            raise ConfigError(f"rollout.num_engines={engines}: colocated mode runs world / rollout.tp = "
                              f"{world_size // cfg.rollout.tp} engines; leave it at 0, or set "
                              "rollout.mode=disaggregated for engines of their own")
    if OmegaConf.select(cfg, "rollout.mode") == "disaggregated":
        _check_engine_devices(cfg)
    if OmegaConf.select(cfg, "rollout.max_prompt_tokens") is not None:
        context = cfg.rollout.max_prompt_tokens + cfg.rollout.max_response_tokens
        if context > arch.max_position_embeddings:
            raise ConfigError(f"rollout.max_prompt_tokens + rollout.max_response_tokens = {context} exceeds the "
                              f"model's context of {arch.max_position_embeddings} tokens (max_position_embeddings); "
                              "lower them")
    if world_size % (tp * pp * cp) != 0:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp*parallel.pp*parallel.cp={tp}*{pp}*{cp}; "
            f"use tp*pp*cp in {{{', '.join(str(d) for d in _divisors(world_size))}}}"
        )
    _check_expert_layout(cfg, arch, world_size)
    if arch.num_heads % tp != 0:
        raise ConfigError(f"parallel.tp={tp} does not divide the model's {arch.num_heads} attention heads; "
                          f"use one of {_divisors(arch.num_heads)}")
    if arch.num_kv_heads % tp != 0:
        raise ConfigError(f"parallel.tp={tp} does not divide the model's {arch.num_kv_heads} key/value heads; "
                          f"use one of {_divisors(arch.num_kv_heads)}")
    stages = pp * (vpp or 1)
    if arch.num_layers % stages != 0:
        raise ConfigError(f"parallel.pp*vpp={stages} does not divide the model's {arch.num_layers} layers; "
                          f"use one of {_divisors(arch.num_layers)}")


def _check_expert_layout(cfg, arch, world_size: int) -> None:
    """parallel.ep and parallel.etp against the model's experts and the job: megatron splits the
    experts evenly over the EP ranks, each expert's FFN over the expert-TP ranks, and lays
    etp x ep x pp ranks out per expert group."""
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    ep = OmegaConf.select(cfg, "parallel.ep", default=1)
    etp = OmegaConf.select(cfg, "parallel.etp", default=None)
    if ep > 1 and arch.moe is None:
        raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model; model '{arch.model_type}' is dense: "
                          "set parallel.ep=1")
    if etp is not None and arch.moe is None:
        raise ConfigError(f"parallel.etp={etp} splits a mixture-of-experts model's experts; model "
                          f"'{arch.model_type}' is dense: leave parallel.etp out (null)")
    if arch.moe is not None and etp is not None and arch.moe.expert_ffn_hidden_size % etp:
        raise ConfigError(f"parallel.etp={etp} does not divide the experts' {arch.moe.expert_ffn_hidden_size}-wide "
                          f"FFN; use one of {_divisors(arch.moe.expert_ffn_hidden_size)}")
    if etp is not None and etp != tp and ep == 1:
        # megatron's DDP reduces an expert's gradient over the expert data-parallel ranks (those
        # of the other TP ranks' tokens included) only for expert-parallel parameters (ep > 1).
        raise ConfigError(f"parallel.etp={etp} differs from parallel.tp={tp} and needs parallel.ep > 1 (megatron "
                          "reduces the experts' gradients over their own ranks only under expert parallelism); "
                          "raise parallel.ep or leave parallel.etp out")
    etp = tp if etp is None else etp
    moe = OmegaConf.select(cfg, "model.moe")
    if arch.moe is None and moe is not None:  # a dense model has no router for these keys to act on
        for key, default in asdict(MoEConfig()).items():
            if moe[key] != default:
                raise ConfigError(f"model.moe.{key}={moe[key]} acts on a mixture-of-experts model's router; model "
                                  f"'{arch.model_type}' is dense: leave model.moe out")
    replay = OmegaConf.select(cfg, "actor.moe.routing_replay", default="none")
    if arch.moe is None and replay != "none":
        raise ConfigError(f"actor.moe.routing_replay={replay} replays a mixture-of-experts model's routes; model "
                          f"'{arch.model_type}' is dense: set actor.moe.routing_replay=none")
    if arch.moe is None and OmegaConf.select(cfg, "rollout.record_routes", default=False):
        raise ConfigError(f"rollout.record_routes=true records a mixture-of-experts model's routes; model "
                          f"'{arch.model_type}' is dense: leave rollout.record_routes out")
    if arch.moe is not None and arch.moe.num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the model's {arch.moe.num_experts} experts; "
                          f"use one of {_divisors(arch.moe.num_experts)}")
    if world_size % (etp * ep * pp):
        raise ConfigError(f"parallel.etp*parallel.ep*parallel.pp={etp}*{ep}*{pp} does not divide the world of "
                          f"{world_size} rank(s) (megatron's expert groups; etp: parallel.etp, else parallel.tp); "
                          "lower parallel.ep or add ranks")
    if arch.moe is not None and tp > 1 and not OmegaConf.select(cfg, "parallel.sequence_parallel", default=True):
        raise ConfigError(f"parallel.tp={tp} with a MoE model needs parallel.sequence_parallel=true "
                          "(megatron's MoE layer trains under TP only with sequence parallelism)")


def _check_engine_devices(cfg) -> None:
    """Disaggregated engines need rollout.num_engines x rollout.tp devices of their own: GPUs
    where there are (all a Ray cluster of several nodes has is only known once Ray runs: there
    the engines wait for their resources), one CPU each on CPU."""
    import os

    import torch

    engines, tp = cfg.rollout.num_engines, cfg.rollout.tp
    if torch.cuda.is_available():
        return
    cpus = os.cpu_count() or 1
    if engines * tp > cpus:
        raise ConfigError(f"rollout.num_engines={engines} x rollout.tp={tp} engine CPUs exceed this machine's {cpus}; "
                          f"lower rollout.num_engines")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(cfg)
