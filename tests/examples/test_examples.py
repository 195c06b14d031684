"""examples/: the data preprocessing scripts turn a local copy of GSM8K and MATH into rows the
trainer and the scorers read right, every example script and config is sound, and the GSM8K tool
example runs end to end through its own script (a tiny model on CPU standing in for the 7B)."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from rlf_train_cli import BIN, SMALL, env_for, records  # noqa: E402

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
    run = subprocess.run([sys.executable, str(EXAMPLES / "data_preprocess" / script), "--source", str(source),
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"{rows} train rows -> {out / 'train.parquet'}" in run.stdout


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


def test_gsm8k_tool_example_trains_through_its_script(tmp_path):
    # 20 rows in the hub's GSM8K layout (main/train-00000-of-00001.parquet: question, answer)
    data = tmp_path / "data"
    _preprocess("gsm8k.py", _local_copy(tmp_path / "gsm8k", GSM8K_ROWS * 10, config="main"), data, rows=20)
    out = tmp_path / "run"
    # The 8-GPU config's model, precision and layout, swapped for what a 2-core CPU can run.
    cpu = ["model.params_dtype=float32", "model.layer_spec=auto", "model.recompute_activations=false",
           "parallel.tp=1", "rollout.tp=1", "rollout.gpu_memory_utilization=0.1", "rollout.max_prompt_tokens=512",
           "rollout.max_response_tokens=32", "actor.mini_batch_size=4", "actor.max_tokens_per_microbatch=4096",
           "tools.num_workers=1", "reward.num_workers=1", "trainer.total_steps=2", "trainer.save_every=0"]
    run = subprocess.run([str(EXAMPLES / "grpo_qwen2_5_7b_gsm8k_tools.sh"), *SMALL, *cpu, "trainer.sft_steps=0",
                          f"trainer.output_dir={out}"],
                         env={**env_for(tmp_path), "MODEL": "tiny://qwen2", "DATA": str(data), "GPUS": "1",
                              "PATH": f"{BIN}:{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    logged = records(out)
    assert [r["step"] for r in logged if r["step"] > 0] == [1, 2]
    config = (out / "config.yaml").read_text()
    assert "config_path: examples/tools/calculator.yaml" in config and "data_path: " + str(data) in config
