"""Configuration: defaults, YAML + dotted overrides, and errors that name the key and the fix."""
import pytest

from rlfactory_megatron.config import ConfigError, load_config, validate_against_model
from rlfactory_megatron.models.hf_arch import arch_from_hf_config


def test_a_config_file_starts_from_the_schema_and_overrides_come_last(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model:\n  path: /models/m\nactor:\n  optim:\n    lr: 3.0e-6\nparallel:\n  tp: 2\n"
                    "trainer:\n  data_path: /data/train.parquet\n")
    cfg = load_config(yaml, ["parallel.tp=4", "rollout.stop=[</answer>]"])
    assert cfg.actor.optim.lr == 3e-6 and cfg.parallel.tp == 4 and list(cfg.rollout.stop) == ["</answer>"]
    # None of the embedded default's tiny-model settings (default.yaml): the schema's, for real models.
    assert (cfg.trainer.sft_steps, cfg.rollout.temperature, cfg.trainer.sft_lr) == (0, 1.0, 1e-5)
    # params_dtype auto: float32 on this machine (no GPU), bfloat16 with TE layers on one
    assert (cfg.model.params_dtype, cfg.reward.scorer, cfg.rollout.max_num_seqs) == ("float32", None, 1024)
    embedded = load_config()
    assert embedded.model.path == "tiny://qwen3" and embedded.trainer.sft_steps == 400
    assert embedded.rollout.temperature == 0.7 and embedded.model.params_dtype == "float32"
    yaml.write_text("actor:\n  optim:\n    lr: 3.0e-6\n")
    with pytest.raises(ConfigError, match="model.path is required"):
        load_config(yaml)


@pytest.mark.parametrize("override,message", [
    ("actor.lrr=1", "unknown config key 'actor.lrr'; valid keys under 'actor':"),
    ("trainerr.total_steps=1", "unknown config key 'trainerr'; valid sections:"),
    ("parallel.tp=two", "invalid value for config key 'parallel.tp'"),
    ("trainer.algorithm=ppo2", "trainer.algorithm='ppo2' is not allowed; choose one of: ppo, grpo"),
    ("parallel.pp=0", "parallel.pp=0 must be >= 1"),
    ("parallel.vpp=2", "parallel.vpp=2 needs parallel.pp >= 2"),
    ("parallel.cp=0", "parallel.cp=0 must be >= 1"),
    ("model.moe.load_balancing=sinkhorn", "model.moe.load_balancing='sinkhorn' is not allowed; choose one of: none, aux_loss"),
    ("model.moe.aux_loss_coeff=0.01", "model.moe.aux_loss_coeff=0.01 with model.moe.load_balancing=none"),
    ("model.moe.z_loss_coeff=-1", "model.moe.z_loss_coeff=-1.0 must be >= 0"),
    ("actor.optim.lr", "must look like key=value"),
    ("rollout.truncation=middle", "rollout.truncation='middle' is not allowed; choose one of: error, left, right"),
    ("rollout.max_num_seqs=0", "rollout.max_num_seqs=0 must be >= 1"),
])
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_config(overrides=[override])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file .*nope.yaml' does not exist"):
        load_config(tmp_path / "nope.yaml")


ARCH = arch_from_hf_config({"model_type": "qwen3", "num_hidden_layers": 6, "hidden_size": 128,
                            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "vocab_size": 512})


@pytest.mark.parametrize("tp,pp,vpp,world,message", [
    (2, 2, None, 6, "world size 6 is not divisible by parallel.tp\\*parallel.pp\\*parallel.cp=2\\*2\\*1"),
    (4, 1, None, 4, "parallel.tp=4 does not divide the model's 2 key/value heads; use one of \\[1, 2\\]"),
    (3, 1, None, 3, "parallel.tp=3 does not divide the model's 4 attention heads"),
    (1, 4, None, 4, "parallel.pp\\*vpp=4 does not divide the model's 6 layers; use one of \\[1, 2, 3, 6\\]"),
    (1, 3, 2, 3, "parallel.pp\\*vpp=6"),
])
def test_inconsistent_parallel_sizes_are_rejected(tp, pp, vpp, world, message):
    cfg = load_config(overrides=[f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.vpp={vpp or 'null'}"])
    if vpp == 2 and pp == 3:  # 3*2 = 6 divides 6 layers: a valid layout
        validate_against_model(cfg, ARCH, world)
        return
    with pytest.raises(ConfigError, match=message):
        validate_against_model(cfg, ARCH, world)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.cp=2", "parallel.tp=2"], 2, "world size 2 is not divisible by parallel.tp\\*parallel.pp\\*parallel.cp=2\\*1\\*2"),
    (["parallel.cp=2", "model.layer_spec=local"], 2, "model.layer_spec=local has none; use model.layer_spec=auto"),
    (["parallel.cp=4", "actor.max_tokens_per_microbatch=4100"], 4,
     "actor.max_tokens_per_microbatch=4100 must be a multiple of 2 x parallel.cp = 8 .*; use 4104"),
])
def test_context_parallel_layouts_are_checked_at_load(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_against_model(load_config(overrides=overrides), ARCH, world)
    validate_against_model(load_config(overrides=overrides[:1]), ARCH, 4)  # the CP size alone fits 4 ranks


MOE_ARCH = arch_from_hf_config({"model_type": "qwen3_moe", "num_hidden_layers": 4, "hidden_size": 128,
                                "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 512, "num_experts": 8, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 64})


@pytest.mark.parametrize("overrides,arch,world,message", [
    (["parallel.ep=3"], MOE_ARCH, 3, "parallel.ep=3 does not divide the model's 8 experts; use one of \\[1, 2, 4, 8\\]"),
    (["parallel.ep=2", "parallel.tp=2"], MOE_ARCH, 2, "parallel.etp\\*parallel.ep\\*parallel.pp=2\\*2\\*1 does not divide "
                                                     "the world of 2"),
    (["parallel.ep=2"], ARCH, 2, "parallel.ep=2 needs a mixture-of-experts model; model 'qwen3' is dense"),
    (["parallel.tp=2"], MOE_ARCH, 2, "needs parallel.sequence_parallel=true"),
    (["parallel.ep=0"], MOE_ARCH, 1, "parallel.ep=0 must be >= 1"),
    (["model.moe.freeze_router=true"], ARCH, 1, "model.moe.freeze_router=True acts on a mixture-of-experts model's "
                                                "router; model 'qwen3' is dense"),
    (["actor.moe.routing_replay=R2"], ARCH, 1, "actor.moe.routing_replay=R2 replays a mixture-of-experts model's "
                                               "routes; model 'qwen3' is dense: set actor.moe.routing_replay=none"),
    (["actor.moe.routing_replay=R3"], ARCH, 1, "actor.moe.routing_replay=R3 replays a mixture-of-experts model's "
                                               "routes; model 'qwen3' is dense: set actor.moe.routing_replay=none"),
    (["actor.moe.routing_replay=R4"], MOE_ARCH, 1, "actor.moe.routing_replay.*R4.*none, R2, R3"),
    (["rollout.record_routes=true"], ARCH, 1, "rollout.record_routes=true records a mixture-of-experts model's "
                                              "routes; model 'qwen3' is dense: leave rollout.record_routes out"),
])
def test_expert_layouts_are_checked_at_load(overrides, arch, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_against_model(load_config(overrides=overrides), arch, world)
    validate_against_model(load_config(overrides=["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                                  "actor.moe.routing_replay=R3"]), MOE_ARCH, 4)


def test_parallel_etp_splits_experts_apart_from_tp_checked_at_load():
    """Issue 53 item 9: experts at their own tensor-parallel size (megatron's
    expert_tensor_parallel_size), which sizes the expert groups in place of tp."""
    from rlfactory_megatron.runtime.distributed import ParallelSizes

    whole = load_config(overrides=["parallel.tp=2", "parallel.ep=2", "parallel.etp=1", "parallel.sequence_parallel=true"])
    sizes = ParallelSizes.of(whole.parallel)
    assert (sizes.etp, sizes.expert_tp, sizes.smallest_world) == (1, 1, 2)  # etp x ep = tp: 2 ranks hold it all
    validate_against_model(whole, MOE_ARCH, 2)
    assert ParallelSizes.of(load_config(overrides=["parallel.tp=2"]).parallel).expert_tp == 2  # null: tp
    for overrides, arch, world, message in [
            (["parallel.etp=1"], ARCH, 1, "parallel.etp=1 splits a mixture-of-experts model's experts; model 'qwen3' "
                                          "is dense: leave parallel.etp out"),
            (["parallel.etp=3"], MOE_ARCH, 3, "parallel.etp=3 does not divide the experts' 64-wide FFN"),
            (["parallel.tp=2", "parallel.etp=1", "parallel.sequence_parallel=true"], MOE_ARCH, 2,
             "parallel.etp=1 differs from parallel.tp=2 and needs parallel.ep > 1"),
            (["parallel.etp=2", "parallel.ep=2"], MOE_ARCH, 2, "parallel.etp\\*parallel.ep\\*parallel.pp=2\\*2\\*1"),
            (["parallel.etp=0"], MOE_ARCH, 1, "parallel.etp=0 must be >= 1")]:
        with pytest.raises(ConfigError, match=message):
            validate_against_model(load_config(overrides=overrides), arch, world)


def test_the_engines_record_routes_where_r3_replays_them_or_where_asked():
    # null resolves at load: on exactly under R3; asked for under none or R2 (compared, not replayed).
    assert load_config(overrides=["actor.moe.routing_replay=R3"]).rollout.record_routes is True
    assert load_config().rollout.record_routes is False
    asked = load_config(overrides=["actor.moe.routing_replay=R2", "rollout.record_routes=true"])
    assert asked.rollout.record_routes is True
    validate_against_model(asked, MOE_ARCH, 1)
    with pytest.raises(ConfigError, match="rollout.record_routes=false: actor.moe.routing_replay=R3 replays the "
                                          "routes the engines record"):
        load_config(overrides=["actor.moe.routing_replay=R3", "rollout.record_routes=false"])


@pytest.mark.parametrize("tp,pp,cp,ep,ranks", [(1, 1, 1, 1, 1), (1, 1, 1, 2, 2), (2, 1, 1, 2, 4), (1, 2, 2, 2, 4),
                                               (1, 1, 2, 4, 4)])
def test_rlf_train_started_by_hand_starts_a_world_that_holds_the_expert_layout(tp, pp, cp, ep, ranks):
    from rlfactory_megatron.runtime.distributed import ParallelSizes

    cfg = load_config(overrides=[f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}", f"parallel.ep={ep}",
                                 "parallel.sequence_parallel=true"])
    assert ParallelSizes.of(cfg.parallel).smallest_world == ranks
    validate_against_model(cfg, MOE_ARCH, ranks)  # the layout fits the ranks started


# Shapes of the real models (from their config.json), to check each example's layout fits them.
REAL_SHAPES = {
    "qwen2_7b": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=32768),  # Qwen2(.5)-7B
    "qwen3_8b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=40960),
    "llama3_1_8b": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072),
    "qwen3_30b_a3b": dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          max_position_embeddings=40960),
}


@pytest.mark.parametrize("name,model,world", [
    ("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8), ("qwen2_7b_ppo_megatron.yaml", "qwen2_7b", 8),
    ("qwen3_8b_grpo_2node.yaml", "qwen3_8b", 16), ("llama3_1_8b_grpo_8gpu.yaml", "llama3_1_8b", 8),
    ("qwen3_30b_a3b_grpo_2node.yaml", "qwen3_30b_a3b", 16),
])
def test_example_cluster_configs_load_and_fit_their_models(name, model, world):
    from pathlib import Path

    import rlfactory_megatron.config as config_pkg

    cfg = load_config(Path(config_pkg.__file__).parent / "examples" / name)
    validate_against_model(cfg, arch_from_hf_config(REAL_SHAPES[model]), world)
    # The run the file describes, not the embedded default's: no warm-start without demonstrations.
    assert cfg.trainer.sft_steps == 0 and cfg.rollout.temperature == 1.0 and cfg.model.params_dtype == "bfloat16"


def test_every_example_config_is_checked():
    from pathlib import Path

    import rlfactory_megatron.config as config_pkg

    names = {p.name for p in (Path(config_pkg.__file__).parent / "examples").glob("*.yaml")}
    checked = {args[0] for args in test_example_cluster_configs_load_and_fit_their_models.pytestmark[0].args[1]}
    assert names == checked


@pytest.mark.parametrize("override,message", [
    ("rollout.temperature=-0.5", r"rollout.temperature=-0.5 must be >= 0 \(0 = greedy\)"),
    ("rollout.top_p=0", r"rollout.top_p=0.0 must be in \(0, 1\]"),
    ("rollout.top_p=1.5", r"rollout.top_p=1.5 must be in \(0, 1\]"),
])
def test_bad_sampling_settings_are_named_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_unknown_builtin_task_is_named():
    with pytest.raises(ConfigError, match="trainer.task='nope' is not a built-in task; choose one of: calculator"):
        load_config(None, ["trainer.task=nope"])
    # A run with its own data names no task: the embedded default's is dropped, a task set beside it refused.
    assert load_config(None, ["trainer.data_path=x.jsonl"]).trainer.task is None
    with pytest.raises(ConfigError, match="trainer.task=nope and trainer.data_path=x.jsonl: a run trains on one"):
        load_config(None, ["trainer.task=nope", "trainer.data_path=x.jsonl"])


def test_item1_the_toy_task_never_reaches_a_users_run(tmp_path):
    """A --config run without data is refused naming trainer.data_path (it trained on the built-in
    calculator task, silently); a user's data gets tools only where a tools file declares them."""
    yaml = tmp_path / "mine.yaml"
    yaml.write_text("model:\n  path: /models/m\n")
    with pytest.raises(ConfigError, match="trainer.data_path is not set: give the run's prompts"):
        load_config(yaml)
    own = load_config(yaml, ["trainer.data_path=/data/train.parquet"])
    assert own.tools.enable is False and own.trainer.task is None  # was: the calculator tool, on
    with pytest.raises(ConfigError, match="tools.enable=true, and the run declares no tools: give tools.config_path"):
        load_config(yaml, ["trainer.data_path=/data/train.parquet", "tools.enable=true"])
    with pytest.raises(ConfigError, match="tools.config_path=t.yaml with tools.enable=false: the tools would not run"):
        load_config(yaml, ["trainer.data_path=/data/train.parquet", "tools.enable=false", "tools.config_path=t.yaml"])
    embedded = load_config()
    assert embedded.trainer.task == "calculator_arithmetic" and embedded.tools.enable is True
    assert load_config(None, ["trainer.data_path=x.jsonl"]).tools.enable is False
    assert load_config(yaml, ["trainer.task=calculator_arithmetic"]).tools.enable is True  # the task's own tool
    with pytest.raises(ConfigError, match="trainer.val_data_path=v.jsonl goes with trainer.data_path"):
        load_config(None, ["trainer.val_data_path=v.jsonl"])


def test_item6_relative_paths_in_a_config_file_are_its_folders(tmp_path, monkeypatch):
    """Paths in a config file resolve from the file's folder (they resolved from the working
    directory: an example config worked only from the repo root); overrides stay the shell's."""
    folder = tmp_path / "configs"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text("")
    (folder / "tools.yaml").write_text("tools:\n  - class: calculator\n")
    (folder / "run.yaml").write_text("model: {path: tiny://qwen3}\ntrainer: {data_path: data/train.jsonl}\n"
                                     "tools: {config_path: tools.yaml}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(folder / "run.yaml")
    assert cfg.trainer.data_path == str(folder / "data" / "train.jsonl")
    assert cfg.tools.config_path == str(folder / "tools.yaml") and cfg.tools.enable is True
    assert cfg.trainer.output_dir == "outputs/run"  # the config's own folder under the working directory
    # a path missing beside the file is named where it was looked for
    assert load_config(folder / "run.yaml", ["trainer.data_path=x.jsonl"]).trainer.data_path == "x.jsonl"
    (folder / "run.yaml").write_text("model: {path: tiny://qwen3}\ntrainer: {data_path: data/missing.jsonl}\n")
    assert load_config(folder / "run.yaml").trainer.data_path == str(folder / "data" / "missing.jsonl")
    # every example config from another folder (they named examples/tools/calculator.yaml from the repo root)
    from pathlib import Path

    import rlfactory_megatron

    for example in sorted((Path(rlfactory_megatron.__file__).parent / "config" / "examples").glob("*.yaml")):
        cfg = load_config(example)
        assert cfg.tools.config_path is None or Path(cfg.tools.config_path).is_file(), example


def test_item8_a_tools_file_given_as_the_config_is_named(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class: calculator\n")
    with pytest.raises(ConfigError, match=f"--config {tools} is a tools file .* give it as tools.config_path={tools}"):
        load_config(tools)


@pytest.mark.parametrize("overrides,world,message", [
    (["rollout.tp=2"], 1, "rollout.tp=2 does not divide the world of 1 rank\\(s\\): colocated mode runs one engine "
                          "per rollout.tp ranks; use rollout.tp in \\{1\\}"),
    (["rollout.tp=4", "parallel.tp=2"], 2, "rollout.tp=4 does not divide the world of 2"),
    (["rollout.tp=3"], 4, "use rollout.tp in \\{1, 2, 4\\}"),
])
def test_engine_layouts_that_do_not_fit_the_world_are_rejected(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate_against_model(load_config(overrides=overrides), ARCH, world)
    validate_against_model(load_config(overrides=["rollout.tp=2"]), ARCH, 4)  # 2 engines of 2 ranks


@pytest.mark.parametrize("override,message", [
    ("weight_sync.transport=broadcast", "weight_sync.transport='broadcast' cannot feed rollout.mode='colocated' "
                                        "engines; use auto or in_process"),
    ("weight_sync.transport=nccl", "weight_sync.transport='nccl' is not allowed; choose one of: auto, in_process, "
                                   "broadcast"),
    ("rollout.engine=sglang", "rollout.engine='sglang' is not allowed; choose one of: vllm"),
    ("rollout.mode=remote", "rollout.mode='remote' is not allowed; choose one of: colocated, disaggregated"),
    ("rollout.mode=disaggregated", r"rollout.num_engines=0: rollout.mode=disaggregated runs that many engines"),
    ("rollout.mode=disaggregated rollout.num_engines=-1", r"rollout.num_engines=-1"),
    ("rollout.mode=disaggregated rollout.num_engines=2 weight_sync.transport=in_process",
     "weight_sync.transport='in_process' cannot feed rollout.mode='disaggregated' engines; use auto or broadcast"),
])
def test_engine_transport_and_mode_come_from_their_registries(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=override.split())


def test_every_closed_set_key_is_checked_from_one_table():
    """One table drives every closed-set check: each key in it refuses a value outside its names
    (registries included), and the refusal lists them."""
    from rlfactory_megatron.config import closed_sets

    table = closed_sets(load_config())
    assert {"rollout.mode", "tools.turn_schedule", "trainer.task", "weight_sync.transport"} <= set(table)
    for key, names in table.items():
        with pytest.raises(ConfigError, match=f"{key}='no-such-name' is (not allowed|not a built-in task); "
                                              f"choose one of: {', '.join(names)}"):
            load_config(overrides=[f"{key}=no-such-name"])


@pytest.mark.parametrize("mode,transport", [("colocated", "in_process"), ("disaggregated", "broadcast")])
def test_auto_transport_is_resolved_at_load_from_the_mode(mode, transport):
    from rlfactory_megatron.config import config_from_yaml, to_yaml

    cfg = load_config(overrides=[f"rollout.mode={mode}", "rollout.num_engines=1"])
    assert cfg.weight_sync.transport == transport  # what every rank and the saved config see
    assert config_from_yaml(to_yaml(cfg)).weight_sync.transport == transport


def test_a_tools_file_error_names_its_key_once(tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class: calculatorr\n")
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[f"tools.config_path={tools}"])
    message = str(err.value)
    assert message.startswith(f"tools.config_path={tools}: tools[0]: unknown tool class 'calculatorr'")
    assert message.count("tools.config_path") == 1


def test_wandb_without_wandb_installed_is_refused_at_load(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"logging.wandb_project='x' needs wandb, which is not installed: "
                                          r"\.venv/bin/pip install wandb"):
        load_config(overrides=["logging.wandb_project=x"])


@pytest.mark.parametrize("override", ["logging.wandb_name=n", "logging.wandb_entity=team", "logging.wandb_tags=[a]"])
def test_wandb_settings_without_a_project_are_refused(override):
    with pytest.raises(ConfigError, match=f"logging.wandb_{override.split('_')[1].split('=')[0]} set without "
                                          "logging.wandb_project"):
        load_config(overrides=[override])


@pytest.fixture
def pretend_gpu_with_te(monkeypatch):
    """What the layer-spec choice sees on a GPU machine with Transformer-Engine installed (the
    CUDA and TE checks patched: neither exists here)."""
    from rlfactory_megatron.models import builder

    monkeypatch.setattr(builder, "cuda_available", lambda: True)
    monkeypatch.setattr(builder, "_transformer_engine_available", lambda: True)


def test_item1_defaults_on_a_gpu_train_in_bfloat16_and_float32_with_te_is_refused_at_load(pretend_gpu_with_te):
    # TE's attention has no float32 kernel for the actor's packed (THD) sequences: the default
    # (layer_spec=auto -> TE on a GPU) must come with a 16-bit dtype, and float32 is refused.
    cfg = load_config()
    assert (cfg.model.layer_spec, cfg.model.params_dtype) == ("auto", "bfloat16")
    for overrides in (["model.params_dtype=float32"],
                      ["model.params_dtype=float32", "model.layer_spec=transformer_engine"]):
        with pytest.raises(ConfigError, match=r"model.params_dtype=float32 cannot train with "
                                              r"model.layer_spec=transformer_engine.*set model.params_dtype=bfloat16"):
            load_config(overrides=overrides)
    assert load_config(overrides=["model.layer_spec=local_sdpa"]).model.params_dtype == "float32"


def test_item1_params_dtype_auto_is_float32_on_cpu():
    assert load_config().model.params_dtype == "float32"
    assert load_config(overrides=["model.params_dtype=bfloat16"]).model.params_dtype == "bfloat16"
