"""examples/: the data preprocessing scripts turn a local copy of GSM8K and MATH into rows the
trainer and the scorers read right, every example script and config is sound, and every example
script runs one RL step as written, the 2-node one through scripts/launch_multinode.sh on two
hosts (network namespaces, each with its own Ray). Only three things change: the model (a tiny one of the same family), the
data (local copies in the public datasets' own layout, which the example's own script
preprocesses; no demonstrations) and the keys of SCALE_TO_CPU."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlf_train_cli import BIN, env_for, records

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"

GSM8K_ROWS = [
    {"question": "Tom has 1,200 apples and buys 34 more. How many apples?", "answer": "1200+34=1234\n#### 1,234"},
    {"question": "What is 6 times 7?", "answer": "6*7=<<6*7=42>>42\n#### 42"},
]
MATH_ROWS = [
    {"problem": "What is $1/2 + 0$?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Algebra"},
    {"problem": "Compute $2+3$.", "solution": "We get $5$, so the answer is $\\boxed{5}$.", "level": "Level 1",
     "type": "Prealgebra"},
]


def _local_copy(folder: Path, rows: list[dict], config: str | None = None) -> Path:
    """The dataset's files as the hub keeps them: jsonl per split, or (with a config name, as
    openai/gsm8k has main/ and socratic/) parquet shards in the config's folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = folder / config if config else folder
    where.mkdir(parents=True)
    for split in ("train", "test"):
        if config:
            pq.write_table(pa.Table.from_pylist(rows), where / f"{split}-00000-of-00001.parquet")
        else:
            (where / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config:  # another config beside it, which must not be mixed in
        (folder / "socratic").mkdir()
        pq.write_table(pa.Table.from_pylist(rows[:1]), folder / "socratic" / "train-00000-of-00001.parquet")
    return folder


def _preprocess(script: str, source: Path, out: Path, rows: int = 2) -> None:
    """Runs the script twice, as the examples do before every run: the second keeps the splits."""
    command = [sys.executable, str(EXAMPLES / "data_preprocess" / script), "--source", str(source), "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"{rows} train rows -> {out / 'train.parquet'}" in run.stdout
    written = (out / "train.parquet").stat().st_mtime_ns
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "already holds train and test: kept" in again.stdout, again.stdout + again.stderr
    assert (out / "train.parquet").stat().st_mtime_ns == written


def test_gsm8k_rows_carry_the_reference_number_and_score_right(tmp_path):
    from rlfactory_megatron.rewards.scorers import get_scorer
    from rlfactory_megatron.trainer.data import load_prompts

    _preprocess("gsm8k.py", _local_copy(tmp_path / "gsm8k", GSM8K_ROWS, config="main"), tmp_path / "out")
    rows = load_prompts(str(tmp_path / "out" / "train.parquet"))
    assert [r.ground_truth for r in rows] == ["1234", "42"]
    assert rows[0].messages[0]["role"] == "user" and "1,200 apples" in rows[0].messages[0]["content"]
    assert rows[0].extra["split"] == "train" and rows[1].extra["index"] == 1
    scorer = get_scorer(rows[0].data_source)  # the data_source picks the gsm8k scorer
    assert scorer("so #### 1234", rows[0].ground_truth) == 1.0 and scorer("#### 1233", rows[0].ground_truth) == 0.0


def test_math_rows_carry_the_boxed_answer_and_score_right(tmp_path):
    from rlfactory_megatron.rewards.scorers import get_scorer
    from rlfactory_megatron.trainer.data import load_prompts

    _preprocess("math_dataset.py", _local_copy(tmp_path / "MATH", MATH_ROWS), tmp_path / "out")
    rows = load_prompts(str(tmp_path / "out" / "test.parquet"))
    assert [r.ground_truth for r in rows] == ["\\frac{1}{2}", "5"]
    assert "\\boxed{}" in rows[0].messages[0]["content"] and rows[0].extra["type"] == "Algebra"
    scorer = get_scorer(rows[0].data_source)
    assert scorer("The answer is $\\boxed{0.5}$", rows[0].ground_truth) == 1.0
    assert scorer("The answer is $\\boxed{6}$", rows[1].ground_truth) == 0.0
    assert math.isclose(scorer("\\boxed{5}", rows[1].ground_truth), 1.0)


@pytest.mark.parametrize("script", sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.sh")))
def test_example_scripts_parse_and_name_configs_that_exist(script):
    text = (EXAMPLES / script).read_text()
    assert subprocess.run(["bash", "-n", str(EXAMPLES / script)]).returncode == 0
    assert os.access(EXAMPLES / script, os.X_OK)
    configs = [word for word in text.split() if word.endswith(".yaml")]
    assert configs and all((ROOT / c).is_file() for c in configs), configs


# The one list of what a test changes in an example besides its model and data: what makes a
# cluster run fit a 2-core CPU and a tiny model's 1024-token context (precision, layer
# implementation, layout, lengths, batch sizes and concurrency, memory shares, worker processes,
# step counts, frequencies). Never a behaviour key.
SCALE_TO_CPU = {
    "model.params_dtype": "float32", "model.layer_spec": "auto",
    "parallel.tp": "1", "parallel.pp": "1", "rollout.tp": "1",
    "rollout.max_prompt_tokens": "512", "rollout.max_response_tokens": "32", "trainer.prompts_per_step": "2",
    "rollout.max_num_seqs": "16",
    "rollout.gpu_memory_utilization": "0.1", "tools.num_workers": "1", "reward.num_workers": "1",
    "trainer.total_steps": "1", "trainer.val_every": "0", "trainer.save_every": "0",
}
# Keys that decide what a run learns: overriding one in a test would hide a run that breaks as
# written (a warm-start without demonstrations once did).
BEHAVIOUR = ("trainer.sft_steps", "trainer.algorithm", "trainer.max_refill_rounds", "rollout.temperature",
             "rollout.top_p", "rollout.top_k", "rollout.n", "rollout.truncation",
             "rollout.mode", "actor.policy_loss", "actor.loss_agg_mode", "actor.kl_loss_coef", "actor.kl_penalty",
             "actor.entropy_coeff", "actor.clip_ratio_low", "actor.clip_ratio_high", "actor.ppo_epochs",
             "actor.optim.lr", "critic.enable", "critic.optim.lr", "tools.enable", "tools.format",
             "tools.config_path", "tools.max_turns", "reward.scorer", "reward.manager", "reward.manager_options",
             "reward.custom_function_path", "trainer.task", "trainer.data_path")
# Where the model, the data and the outputs are: the examples' scripts set the first three.
LOCATIONS = ("model.path", "trainer.data_path", "trainer.val_data_path", "trainer.output_dir")
TINY_MODEL = {"grpo_qwen2_5_7b_gsm8k_tools.sh": "tiny://qwen2", "grpo_llama3_1_8b_gsm8k_tools.sh": "tiny://llama",
              "ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh": "tiny://qwen2",
              "grpo_qwen3_8b_2node.sh": "tiny://qwen3", "grpo_qwen3_30b_a3b_2node.sh": "tiny://qwen3_moe"}


def test_the_scale_list_holds_no_behaviour_key():
    from rlfactory_megatron.config import load_config

    assert not set(SCALE_TO_CPU) & set(BEHAVIOUR)
    assert set(TINY_MODEL) == {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.sh")}
    load_config(None, [f"{k}={v}" for k, v in SCALE_TO_CPU.items()])  # every key exists


def _example_env(tmp_path: Path, script: str) -> dict[str, str]:
    """The example's environment: a tiny model, one rank per node, an empty DATA folder the
    script fills from local copies of the datasets in their hub layout (20 rows each)."""
    sources = tmp_path / "sources"
    if not sources.exists():
        _local_copy(sources / "gsm8k", GSM8K_ROWS * 10, config="main")
        _local_copy(sources / "MATH", MATH_ROWS * 10)
    return {**env_for(tmp_path), "MODEL": TINY_MODEL[script], "DATA": str(tmp_path / "data"), "GPUS": "1",
            "GSM8K_SOURCE": str(sources / "gsm8k"), "MATH_SOURCE": str(sources / "MATH"),
            "PATH": f"{BIN}:{os.environ['PATH']}"}


def _flat(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def _check_runs_as_written(script: str, run_dir: Path, env: dict[str, str]) -> list[dict]:
    """The run's config is the example's own but for the model, the data and SCALE_TO_CPU; its
    engine runs rollout.max_num_seqs sequences, with a CPU KV cache sized for them; it made and
    trained one RL step. Returns its metrics."""
    from omegaconf import OmegaConf

    from rlfactory_megatron.config import load_config
    from rlfactory_megatron.models.hf_arch import load_arch
    from rlfactory_megatron.trainer.model_path import resolve_model_path

    [config] = [word for word in (EXAMPLES / script).read_text().split() if word.endswith(".yaml")]
    expected = load_config(ROOT / config)  # the algorithm's preset applied, as rlf-train applies it
    ran = _flat(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml")))
    written = _flat(OmegaConf.to_container(expected))
    # values resolved from what the scale list changes: recompute auto by the device's memory, the
    # judge's share (null) from the rollout's
    derived = {"model.recompute", "reward.model.gpu_memory_utilization"}
    changed = {key for key in written if ran[key] != written[key]} - derived
    assert changed <= set(SCALE_TO_CPU) | set(LOCATIONS), changed - set(SCALE_TO_CPU) - set(LOCATIONS)
    assert ran["model.path"].startswith("tiny://") and ran["trainer.data_path"].endswith("train.parquet")
    os.environ.setdefault("RLF_CACHE_HOME", env["RLF_CACHE_HOME"])  # the run's model cache
    arch = load_arch(resolve_model_path(ran["model.path"]))
    sequences = ran["rollout.max_num_seqs"]
    tokens = ran["rollout.max_prompt_tokens"] + ran["rollout.max_response_tokens"]
    kv_bytes = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 4 * tokens * sequences  # keys, values; fp32
    engine_args = (run_dir / "logs" / "rank00000.log").read_text()  # vLLM logs the arguments it was given
    assert f"'max_num_seqs': {sequences}," in engine_args and f"'kv_cache_memory_bytes': {kv_bytes}," in engine_args
    logged = [r for r in records(run_dir) if r["step"] > 0]
    assert [r["step"] for r in logged] == [1]
    step = logged[0]
    assert step["rollout/response_tokens_mean"] > 0 and "reward/score/mean" in step
    assert math.isfinite(step["actor/pg_loss"]) and math.isfinite(step["actor/grad_norm"])
    return logged


@pytest.mark.parametrize("script", ["grpo_qwen2_5_7b_gsm8k_tools.sh", "grpo_llama3_1_8b_gsm8k_tools.sh",
                                    "ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh"])
def test_single_node_example_runs_one_rl_step_as_written(tmp_path, script):
    out, env = tmp_path / "run", _example_env(tmp_path, script)
    run = subprocess.run([str(EXAMPLES / script), *(f"{k}={v}" for k, v in SCALE_TO_CPU.items()),
                          f"trainer.output_dir={out}"],
                         env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    [step] = _check_runs_as_written(script, out, env)
    if "ppo" in script:  # GSM8K and MATH joined, each row scored by its data_source's scorer, a critic trained
        assert (tmp_path / "data" / "gsm8k_math_train.parquet").is_file() and step["critic/vf_loss"] > 0
    else:  # the calculator tool offered in the example's chat format (the tiny model may not call it)
        assert "rollout/tool_calls_per_sample" in step and (tmp_path / "data" / "train.parquet").is_file()


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair, 10.200.0.1 and 10.200.0.2 (addresses that
    live only inside them): two hosts, each needing its own Ray. Yields the `ip netns exec`
    prefix of each; removed with every process left in them, however the test ends."""
    tag = f"rlf{os.getpid()}"
    names = [f"{tag}n0", f"{tag}n1"]
    added = []

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    try:
        for name in names:
            ip("netns", "add", name)
            added.append(name)
    except (OSError, subprocess.CalledProcessError) as exc:
        for name in added:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"two hosts need `ip netns` (root, CAP_SYS_ADMIN): {getattr(exc, 'stderr', exc)}")
    try:
        ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        for i, (name, dev) in enumerate(zip(names, (f"{tag}a", f"{tag}b"))):
            ip("link", "set", dev, "netns", name)
            for args in (("addr", "add", f"10.200.0.{i + 1}/24", "dev", dev), ("link", "set", dev, "up"),
                         ("link", "set", "lo", "up"), ("route", "add", "default", "dev", dev)):
                ip("-n", name, *args)  # the default route: Ray finds its node's address by it
        # gloo takes the address the host name resolves to (127.0.1.1 here, the node's own on a
        # cluster): each host's ranks name their interface, as on a node with several
        yield [["ip", "netns", "exec", name, "env", f"GLOO_SOCKET_IFNAME={dev}"]
               for name, dev in zip(names, (f"{tag}a", f"{tag}b"))]
    finally:
        for name in names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_node_example_runs_one_rl_step_through_launch_multinode(tmp_path, two_hosts):
    # Two hosts (network namespaces), each running the script for its node rank; one rank each
    # (GPUS=1), so data parallelism goes across them, and each host's engine process joins its
    # own host's Ray (the launcher starts one per node), with a Ray folder of its own.
    script = "grpo_qwen3_8b_2node.sh"
    out = tmp_path / "run"
    env = {**_example_env(tmp_path, script), "MASTER_PORT": "29437"}
    args = [*(f"{k}={v}" for k, v in SCALE_TO_CPU.items()), f"trainer.output_dir={out}"]
    host0, host1 = two_hosts
    node_env = [{**env, "RAY_TMPDIR": f"/tmp/rlfray{os.getpid()}n{i}"} for i in range(2)]
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([*host1, str(EXAMPLES / script), "1", "2", "10.200.0.1", *args], env=node_env[1],
                                 cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        node0 = subprocess.run([*host0, str(EXAMPLES / script), "0", "2", "10.200.0.1", *args], env=node_env[0],
                               cwd=tmp_path, capture_output=True, text=True, timeout=900)
        node1.wait(timeout=300)
    finally:
        node1.kill()
    node1_log = (tmp_path / "node1.log").read_text()
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr[-3000:] + "\n--- node 1:\n" + node1_log[-2000:]
    assert "node 0 of 2, 1 rank(s) here" in node0.stderr and "node 1 of 2, 1 rank(s) here" in node1_log
    assert "tp=1 pp=1 on 2 rank(s)" in node0.stdout
    [step] = _check_runs_as_written(script, out, env)
    assert step["rollout/num_engines"] == 2 and step["train/dp_rows_min"] >= 1  # an engine and a DP rank per node
    assert "rollout/groups_kept" in step  # DAPO's dynamic sampling, as the example's algorithm says
