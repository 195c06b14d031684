"""`rlf-train --check` (issue 61 item 4): every example config, with a model folder of its model's
shape and a few rows of data, is checked whole (model folder, data, tools, rewards, layout, memory
plan, resume state) and passes without starting a process group, a process, Ray or an engine;
two runs of different models never share a checkpoint (item 3)."""
import json
import subprocess
from pathlib import Path

import pytest

from rlf_train_cli import BIN, env_for
from test_config import REAL_SHAPES

import rlfactory_megatron

EXAMPLES = Path(rlfactory_megatron.__file__).parent / "config" / "examples"
WORLD = {"qwen2_5_7b_grpo_8gpu.yaml": ("qwen2_7b", 8), "qwen2_7b_ppo_megatron.yaml": ("qwen2_7b", 8),
         "qwen3_8b_grpo_2node.yaml": ("qwen3_8b", 16), "llama3_1_8b_grpo_8gpu.yaml": ("llama3_1_8b", 8),
         "qwen3_30b_a3b_grpo_2node.yaml": ("qwen3_30b_a3b", 16)}

# rlf-train's main in a process that records what it starts: a process group, a child process
# (multiprocessing, torch's spawn, subprocess), Ray; and which heavy engines got imported at all.
DRIVER = """
import contextlib, io, json, multiprocessing.process, subprocess, sys
import torch.distributed
started = []
def refuse(what):
    def call(*args, **kwargs):
        started.append(what)
        raise RuntimeError(what + " started by --check")
    return call
torch.distributed.init_process_group = refuse("process group")
multiprocessing.process.BaseProcess.start = refuse("process")
subprocess.Popen.__init__ = refuse("subprocess")
import ray
ray.init = refuse("ray")
from rlfactory_megatron.cli.train import main
results = []
for argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    results.append({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps({"results": results, "started": started, "vllm": "vllm" in sys.modules}))
"""


def _model_folder(root: Path, model: str, tokenizer_dir: Path) -> Path:
    """A model folder as a user has one: the real model's config.json, a tokenizer with its chat template."""
    folder = root / model
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(REAL_SHAPES[model]))
    for file in tokenizer_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (folder / file.name).write_bytes(file.read_bytes())
    return folder


def _drive(argvs: list[list[str]], env) -> dict:
    driven = subprocess.run([str(BIN / "python"), "-c", DRIVER], input=json.dumps(argvs), capture_output=True,
                            text=True, env=env, timeout=600)
    assert driven.returncode == 0, driven.stderr[-3000:]
    return json.loads(driven.stdout.splitlines()[-1])


def test_check_passes_each_example_config_without_starting_anything(tmp_path):
    from rlfactory_megatron.trainer.model_path import resolve_model_path

    env = env_for(tmp_path)
    tokenizer_dir = resolve_model_path("tiny://qwen3")
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
                                        "ground_truth": str(2 * i), "data_source": "openai/gsm8k"}) + "\n"
                            for i in range(6)))
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(WORLD)
    folders = {model: _model_folder(tmp_path, model, tokenizer_dir) for model in {m for m, _ in WORLD.values()}}
    argvs = [["--check", "--config", str(EXAMPLES / name), "--world-size", str(world), f"model.path={folders[model]}",
              f"trainer.data_path={data}", f"trainer.val_data_path={data}", f"trainer.output_dir={tmp_path / name}"]
             for name, (model, world) in WORLD.items()]
    report = _drive(argvs, env)
    for argv, result in zip(argvs, report["results"]):
        assert result["status"] == 0, (argv, result["stderr"][-2000:])
        assert "rlf-train: check passed" in result["stdout"] and "starts fresh in" in result["stdout"], result["stdout"]
    assert report["started"] == [] and not report["vllm"]
    assert not any((tmp_path / name).exists() for name in WORLD)  # nothing written either


SMALL = "rollout: {max_prompt_tokens: 256, max_response_tokens: 64}\nreward: {scorer: gsm8k}\n"  # tiny models


def test_two_config_runs_of_different_models_never_share_a_checkpoint(tmp_path):
    """A --config run without trainer.output_dir gets outputs/<config name> (was outputs/default for
    every one); where two still meet, the second's resume is refused naming the model."""
    env = env_for(tmp_path)
    work = tmp_path / "work"
    (work / "a").mkdir(parents=True)
    (work / "b").mkdir()
    data = work / "data.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "ground_truth": "5"}) + "\n")
    for folder, family in (("a", "qwen3"), ("b", "llama")):
        (work / folder / "run.yaml").write_text(f"model: {{path: 'tiny://{family}'}}\ntrainer: {{data_path: ../data.jsonl}}\n{SMALL}")
    (work / "mine.yaml").write_text(f"model: {{path: 'tiny://qwen3'}}\ntrainer: {{data_path: data.jsonl}}\n{SMALL}")
    # a checkpoint of the first config's run, where the second would resume from
    step = work / "outputs" / "run" / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}")
    (step / "config.yaml").write_text("model:\n  path: tiny://qwen3\n")  # (a checkpoint keeps its run's whole config)
    report = _drive([["--check", "--config", "a/run.yaml"], ["--check", "--config", "b/run.yaml"],
                     ["--check", "--config", "mine.yaml"], ["--print-config", "--config", "mine.yaml"]],
                    env)
    a, b, mine, printed = report["results"]
    assert a["status"] == 0 and f"resumes outputs/run/checkpoints/step_000001" in a["stdout"], a
    assert b["status"] == 2 and "trained with other settings: model.path=tiny://llama (was tiny://qwen3)" in b["stderr"]
    assert mine["status"] == 0 and "starts fresh in outputs/mine" in mine["stdout"], mine
    assert "output_dir: outputs/mine" in printed["stdout"]


@pytest.fixture(autouse=True)
def _in_work_folder(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir(exist_ok=True)
    monkeypatch.chdir(tmp_path / "work")
