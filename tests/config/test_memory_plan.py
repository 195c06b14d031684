"""The memory plan (`rlf-train --plan`, and every run's start-up): terms from the model's real
shape, each example config fits the GPU it names, and a layout over the device's memory is
refused at load naming its biggest terms and the keys that lower them."""
import functools
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rlf_train_cli import BIN, env_for
from test_config import REAL_SHAPES

from rlfactory_megatron.config import ConfigError, load_config
from rlfactory_megatron.models.hf_arch import arch_from_hf_config
from rlfactory_megatron.trainer.memory_plan import GIB, memory_plan, resolve_recompute

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "rlfactory_megatron" / "config" / "examples"
# (config, its model's shape, the job's ranks)
EXAMPLE_JOBS = [("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8), ("qwen2_7b_ppo_megatron.yaml", "qwen2_7b", 8),
                ("qwen3_8b_grpo_2node.yaml", "qwen3_8b", 16), ("llama3_1_8b_grpo_8gpu.yaml", "llama3_1_8b", 8),
                ("qwen3_30b_a3b_grpo_2node.yaml", "qwen3_30b_a3b", 16)]


def test_parameter_counts_are_the_models_published_ones():
    published = {"qwen2_7b": 7_615_616_512, "qwen3_8b": 8_190_735_360, "llama3_1_8b": 8_030_261_248,
                 "qwen3_30b_a3b": 30_532_122_624}
    for model, count in published.items():
        assert arch_from_hf_config(REAL_SHAPES[model]).parameter_count() == count, model
    # Per rank at tp/pp > 1: tests/actor/test_offload.py counts the megatron model each rank builds.


@functools.cache
def _example(name: str):
    return load_config(EXAMPLES / name)


def _plan(name: str, model: str, world: int, *overrides: str):
    """The plan of an example config with `overrides` (key=value) on top (model.recompute=auto
    resolved as rlf-train resolves it)."""
    cfg = OmegaConf.merge(_example(name), OmegaConf.from_dotlist(list(overrides)))
    arch = arch_from_hf_config(REAL_SHAPES[model])
    resolve_recompute(cfg, arch, world)
    return memory_plan(cfg, arch, world)


def _term(plan, phase: str, start: str) -> float:
    return sum(term.bytes for term in plan.terms(phase) if term.name.startswith(start))


def test_each_term_follows_the_keys_that_shape_it():
    base = _plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8)
    # bf16 Qwen2-7B at tp=4: 1.90B parameters per rank, 2 bytes each, fp32 gradients, fp32 main
    # parameters and two Adam moments sharded over dp=2.
    params = arch_from_hf_config(REAL_SHAPES["qwen2_7b"]).parameter_count(4, 1, 0)
    assert _term(base, "training", "actor weights") == 2 * params
    assert _term(base, "training", "actor gradients") == 4 * params
    assert _term(base, "training", "actor optimizer") == 12 * params / 2
    whole = _plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "actor.optim.use_distributed_optimizer=false")
    assert _term(whole, "training", "actor optimizer") == 12 * params
    assert "actor.optim.use_distributed_optimizer=true" in next(
        t for t in whole.terms("training") if t.name.startswith("actor optimizer")).lowered_by
    activations = _term(base, "training", "activations")
    assert "recompute none" in next(t.name for t in base.terms("training") if t.name.startswith("activations"))
    full = _term(_plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "model.recompute=full"), "training", "activations")
    selective = _term(_plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "model.recompute=selective"),
                      "training", "activations")
    assert activations > 2 * selective and selective > 3 * full
    assert _term(_plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "parallel.sequence_parallel=true"),
                 "training", "activations") < activations
    assert _term(_plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "actor.max_tokens_per_microbatch=8192"),
                 "training", "activations") < 0.6 * activations
    # Context parallelism: each of the 2 CP ranks holds half of a micro-batch twice the budget, and
    # the distributed optimizer shards over dp 1 x cp 2 as it did over dp 2.
    budget = _example("qwen2_5_7b_grpo_8gpu.yaml").actor.max_tokens_per_microbatch
    split = _plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "parallel.cp=2", f"actor.max_tokens_per_microbatch={2 * budget}")
    assert _term(split, "training", "activations") == activations and "tp=4 pp=1 cp=2 dp=1" in split.layout
    # Expert parallelism (Qwen3-30B-A3B, 128 experts, at tp=4 pp=2 ep=2 on 16 ranks): a rank holds
    # 64 experts of each layer of its stage, and the distributed optimizer shards an expert's
    # state over the dp / ep = 1 rank holding it, the rest over dp = 2.
    moe = arch_from_hf_config(REAL_SHAPES["qwen3_30b_a3b"])
    on_rank = moe.parameter_count(4, 2, 1, ep=2)  # the last stage: the bigger one, whose plan is shown
    experts = moe.expert_parameter_count(4, 2, ep=2)
    assert experts == moe.expert_parameter_count(4, 2) // 2 and on_rank == moe.parameter_count(4, 2, 1) - experts
    layout = _plan("qwen3_8b_grpo_2node.yaml", "qwen3_30b_a3b", 16, "parallel.ep=2", "parallel.sequence_parallel=true")
    assert _term(layout, "training", "actor weights") == 2 * on_rank and "ep=2 dp=2" in layout.layout
    assert _term(layout, "training", "actor optimizer") == 12 * (on_rank - experts) / 2 + 12 * experts
    assert _term(split, "training", "actor optimizer") == 12 * params / 2
    # Expert TP of its own (issue 53 item 9): at etp=1 ep=8 a rank holds 16 whole experts per
    # layer (as many parameters as 64 experts cut 4 ways), their state over 2 x 4 / (1 x 8) = 1 rank.
    whole = _plan("qwen3_8b_grpo_2node.yaml", "qwen3_30b_a3b", 16, "parallel.ep=8", "parallel.etp=1",
                  "parallel.sequence_parallel=true")
    experts_whole = moe.expert_parameter_count(1, 2, ep=8)
    assert experts_whole == experts and "ep=8 etp=1 dp=2" in whole.layout
    assert _term(whole, "training", "actor optimizer") == 12 * (on_rank - experts) / 2 + 12 * experts_whole
    assert _term(_plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "actor.kl_loss_coef=0"), "training", "reference") == 0
    assert _term(base, "generation", "reference") == 2 * params
    offloaded = _plan("qwen2_5_7b_grpo_8gpu.yaml", "qwen2_7b", 8, "actor.offload=true")
    assert _term(offloaded, "generation", "actor") == _term(offloaded, "generation", "reference") == 0
    assert _term(offloaded, "training", "actor") == _term(base, "training", "actor")  # training needs it all back
    assert _term(offloaded, "weight sync", "actor weights") == 2 * params  # the sync reads the parameters
    assert _term(base, "generation", "engine share") == 0.5 * 79 * GIB


def test_recompute_auto_is_the_least_recompute_that_fits_the_device_with_margin():
    """Issue 53 item 10: model.recompute=auto, resolved from the plan at load. At their sizes on
    79 GiB the dense GRPO examples recompute nothing (they ran full recompute at 32-34 GiB); the
    PPO example, with a critic, needs selective; smaller devices need more; no device: none."""
    chosen = {}
    for name, model, world in EXAMPLE_JOBS:
        cfg = OmegaConf.merge(_example(name), OmegaConf.from_dotlist([]))
        assert cfg.model.recompute == "auto", name
        line = resolve_recompute(cfg, arch_from_hf_config(REAL_SHAPES[model]), world)
        assert line.startswith(f"model.recompute=auto: {cfg.model.recompute} ("), line
        chosen[name] = cfg.model.recompute
        assert memory_plan(cfg, arch_from_hf_config(REAL_SHAPES[model]), world).peak()[1] <= 0.9 * 79 * GIB, name
    assert chosen == {"qwen2_5_7b_grpo_8gpu.yaml": "none", "qwen2_7b_ppo_megatron.yaml": "selective",
                      "qwen3_8b_grpo_2node.yaml": "none", "llama3_1_8b_grpo_8gpu.yaml": "none",
                      "qwen3_30b_a3b_grpo_2node.yaml": "none"}
    arch = arch_from_hf_config(REAL_SHAPES["qwen2_7b"])
    for gib, expected in ((60, "selective"), (40, "full")):
        cfg = OmegaConf.merge(_example("qwen2_5_7b_grpo_8gpu.yaml"),
                              OmegaConf.from_dotlist([f"parallel.device_memory_gib={gib}", "rollout.gpu_memory_utilization=0.3"]))
        resolve_recompute(cfg, arch, 8)
        assert cfg.model.recompute == expected, gib
    unknown = OmegaConf.merge(_example("qwen2_5_7b_grpo_8gpu.yaml"), OmegaConf.from_dotlist(["parallel.device_memory_gib=null"]))
    assert "no device to fit" in resolve_recompute(unknown, arch, 8) and unknown.model.recompute == "none"
    set_by_hand = OmegaConf.merge(_example("qwen2_5_7b_grpo_8gpu.yaml"), OmegaConf.from_dotlist(["model.recompute=full"]))
    assert resolve_recompute(set_by_hand, arch, 8) is None and set_by_hand.model.recompute == "full"


@pytest.mark.parametrize("shape", ["qwen2_7b", "qwen3_8b", "llama3_1_8b"])
def test_the_engine_kv_cache_is_the_share_left_after_its_weights(shape):
    arch = arch_from_hf_config(REAL_SHAPES[shape])
    per_token = arch.kv_cache_bytes_per_token(2, tp=2)
    assert per_token == 2 * arch.num_layers * arch.num_kv_heads // 2 * arch.head_dim * 2
    cfg = load_config(overrides=["model.params_dtype=bfloat16", "rollout.tp=2", "parallel.device_memory_gib=79",
                                 "rollout.gpu_memory_utilization=0.5", "rollout.max_prompt_tokens=1024",
                                 "rollout.max_response_tokens=1024"])
    plan = memory_plan(cfg, arch, 2)
    tokens = (0.5 * 79 * GIB - arch.parameter_count() * 2 / 2) / per_token
    assert f"= {tokens:,.0f} tokens = {tokens / 2048:,.0f} sequences of 2048" in plan.engine
    # A share that cannot hold the engine's weights and one full-length sequence: vLLM would not start.
    starved = memory_plan(OmegaConf.merge(cfg, OmegaConf.from_dotlist(["rollout.gpu_memory_utilization=0.05"])), arch, 2)
    weights = arch.parameter_count() * 2 / 2 / GIB
    with pytest.raises(ConfigError, match=rf"rollout.gpu_memory_utilization=0.05 gives each engine 3.95 GiB per device, "
                                          rf"less than its weights \({weights:.2f} GiB\) and the KV cache of one "
                                          rf"2048-token sequence .* raise rollout.gpu_memory_utilization or rollout.tp"):
        starved.check()


def _model_folders(root: Path) -> dict[str, Path]:
    """Each real model's config.json alone: all the plan reads of a model."""
    folders = {}
    for model, shape in REAL_SHAPES.items():
        folders[model] = root / model
        folders[model].mkdir()
        (folders[model] / "config.json").write_text(json.dumps(shape))
    return folders


def _rlf_train_plan(tmp_path, name: str, model: Path, world: int, *overrides: str, env=None):
    start = time.monotonic()
    out = subprocess.run([str(BIN / "rlf-train"), "--plan", "--world-size", str(world), "--config",
                          str(EXAMPLES / name), f"model.path={model}", *overrides],
                         capture_output=True, text=True, env=env or env_for(tmp_path), timeout=120, cwd=ROOT)
    return out, time.monotonic() - start


def test_each_example_fits_the_gpu_it_names_by_rlf_train_plan(tmp_path):
    folders = _model_folders(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda job: _rlf_train_plan(tmp_path, job[0], folders[job[1]], job[2]), EXAMPLE_JOBS))
    for (name, _, world), (out, _) in zip(EXAMPLE_JOBS, runs):
        assert out.returncode == 0, (name, out.stderr[-2000:])
        assert f"dp=2 ({world} ranks)" in out.stdout and "device: 79.00 GiB (parallel.device_memory_gib)" in out.stdout
        for term in ("actor weights (bfloat16)", "actor gradients (fp32)",
                     "actor optimizer (fp32 main params + Adam moments, 1/2 each)", "activations (16384 tokens, recompute ", "model.recompute=auto: ",
                     "engine share (0.5 of the device)", f"engine weights (bfloat16, 1/{_example(name).rollout.tp} each)",
                     "KV cache at most"):
            assert term in out.stdout, (name, term, out.stdout)
        assert "GiB to spare" in out.stdout.splitlines()[-1], (name, out.stdout)
    assert {job[0] for job in EXAMPLE_JOBS} == {p.name for p in EXAMPLES.glob("*.yaml")}
    ppo = runs[1][0].stdout
    assert "critic optimizer" in ppo and "reference" not in ppo
    assert "reference weights (bfloat16)" in runs[0][0].stdout
    # Qwen3-30B-A3B on 2 nodes: 64 of 128 experts per rank, the actor in host memory while the
    # engines generate (generation holds the runtime allowance and the engine share alone).
    moe = runs[4][0].stdout
    assert "qwen3_moe (48 layers, 30.53B parameters); tp=4 pp=2 ep=8 etp=1 dp=2 (16 ranks)" in moe
    assert "total" in moe and "generation" in moe
    generation = next(line for line in moe.splitlines() if line.startswith("total")).split()[2]
    assert float(generation) == 2.00 + 39.50, moe
    # model.params_dtype=auto (the schema's default), planned here without a GPU: as a GPU node
    # resolves it (TE layers, bfloat16), not as this machine would run it (float32).
    # No thread count set (issue 53 item 12): a plan starts no rank, and says nothing of this node's cores.
    unthreaded = {k: v for k, v in env_for(tmp_path).items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    auto, _ = _rlf_train_plan(tmp_path, EXAMPLE_JOBS[0][0], folders["qwen2_7b"], 8, "model.params_dtype=auto",
                              env=unthreaded)
    assert auto.returncode == 0 and "actor weights (bfloat16)" in auto.stdout, auto.stdout + auto.stderr[-2000:]
    assert "usable cores" not in auto.stdout + auto.stderr, auto.stdout


@pytest.mark.serial  # a bound on wall time: run alone (scripts/test.sh)
def test_a_layout_over_its_gpu_is_refused_at_load_naming_its_biggest_terms_and_their_keys(tmp_path):
    # The PPO example with its actor and critic resident while the engines generate (as the
    # example stood before offload): 84 GiB of a 79 GiB device.
    folders = _model_folders(tmp_path)
    out, seconds = _rlf_train_plan(tmp_path, "qwen2_7b_ppo_megatron.yaml", folders["qwen2_7b"], 8,
                                   "actor.offload=false", "critic.offload=false")
    assert out.returncode == 2 and seconds < 10, (out.returncode, seconds, out.stderr[-2000:])
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("rlf-train: error: the memory plan needs 84.06 GiB per device in generation, over the "
                           "device's 79.00 GiB (parallel.device_memory_gib); biggest terms: engine share "
                           "(0.5 of the device) 39.50 GiB (lower it: a smaller rollout.gpu_memory_utilization)"), last
    assert "(lower it: actor.offload=true," in last and "(lower it: critic.offload=true," in last
    assert "does not fit, 5.06 GiB over" in out.stdout


def test_colocated_judge_memory_plan():
    # The 7B example with an 8B judge beside its engines: the judge's share is awake in a phase of
    # its own, beside what stays on the device while the policy engines sleep; its weights are in
    # words (host memory while it sleeps at level 1). A share too small for its weights is refused.
    judge = ["reward.model.kind=generative", "reward.model.path=/judge", "reward.model.placement=colocated"]
    cfg = OmegaConf.merge(_example("qwen2_5_7b_grpo_8gpu.yaml"), OmegaConf.from_dotlist(judge))
    judge_arch = arch_from_hf_config(REAL_SHAPES["qwen3_8b"])
    plan = memory_plan(cfg, arch_from_hf_config(REAL_SHAPES["qwen2_7b"]), 8, judge_arch=judge_arch)
    assert list(plan.phases) == ["training", "generation", "weight sync", "judging"]
    assert _term(plan, "judging", "judge share") == 0.5 * 79 * GIB  # reward.model.gpu_memory_utilization: rollout's
    assert _term(plan, "generation", "judge share") == _term(plan, "judging", "engine share") == 0
    resident = [t for t in plan.terms("generation") if not t.name.startswith("engine share")]
    assert plan.terms("judging")[:-1] == resident
    rendered = plan.render()
    assert "judge share (0.5 of the device)" in rendered and "judging" in rendered
    assert f"weights {judge_arch.parameter_count() * 2 / GIB:.2f} GiB, in host memory while it sleeps" in rendered
    assert "fits" in rendered
    plan.check()
    # The judge's share over what the device has left beside the resident state: does not fit in judging.
    crowded = memory_plan(OmegaConf.merge(cfg, OmegaConf.from_dotlist(["reward.model.gpu_memory_utilization=0.95"])),
                          arch_from_hf_config(REAL_SHAPES["qwen2_7b"]), 8, judge_arch=judge_arch)
    assert crowded.peak()[0] == "judging" and "does not fit" in crowded.render()
    starved = memory_plan(OmegaConf.merge(cfg, OmegaConf.from_dotlist(["reward.model.gpu_memory_utilization=0.1"])),
                          arch_from_hf_config(REAL_SHAPES["qwen2_7b"]), 8, judge_arch=judge_arch)
    with pytest.raises(ConfigError, match=r"reward.model.gpu_memory_utilization=0.1 gives the judge 7.90 GiB"):
        starved.check()
