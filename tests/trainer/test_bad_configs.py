"""Bad configurations through the real `rlf-train`: each exits 2 within seconds of CPU time, before
any model, Ray or vLLM starts, with one last line that names the key (or file) and no traceback."""
import json
import os
import subprocess
import threading
from pathlib import Path

from rlf_train_cli import BIN, env_for

REWARD_FN = "def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n"
WRONG_SIGNATURE = "def compute_score(text):\n    return 1.0\n"


def files(root: Path) -> dict[str, str]:
    """Files the cases refer to, by placeholder."""
    made = {
        "BAD_YAML": "actor:\n  optim: [lr: 1\n",
        "BAD_KEY_YAML": "actor:\n  lrr: 1\n",
        "TOOLS_UNKNOWN": "tools:\n  - class: calculatorr\n",
        "TOOLS_BAD_PARAM": "tools:\n  - class: python\n    params: {cpu_seconds: 3}\n",
        "TOOLS_NOT_LIST": "tools: calculator\n",
        "TOOLS_BAD_SYNTAX": "tools:\n  - class: [calculator\n",
        "TOOLS_BAD_IMPORT": "tools:\n  - class: no_such_module.Tool\n",
        "TOOLS_CANNOT_START": "tools:\n  - class: python\n    params: {interpreter: /opt/nowhere/python3}\n",
        "REWARD_OK": REWARD_FN,
        "REWARD_WRONG_SIGNATURE": WRONG_SIGNATURE,
        "REWARD_SYNTAX": "def compute_score(:\n",
        "REWARD_RAISES_ON_IMPORT": "raise RuntimeError('boom at import')\n",
        "NO_MODEL_YAML": "trainer:\n  total_steps: 5\n",
        "NO_DATA_YAML": "model:\n  path: tiny://qwen3\n",  # a user's config naming no data (issue 61 item 1)
        "TOOLS_AS_CONFIG": "tools:\n  - class: calculator\n",
        # rows as a user's file has them: no demonstrations; the second one's prompt is long
        "DATA": _rows({"prompt": "What is 2 + 3?", "ground_truth": "5"},
                      {"prompt": "What is " + " + ".join(["12"] * 200) + "?", "ground_truth": "2400"},
                      {"prompt": "What is 7 * 6?", "ground_truth": "42"}),
        "DATA_UNSCORED": _rows({"prompt": "Name a colour.", "ground_truth": "red", "data_source": "my/colours"}),
    }
    out = {}
    for name, text in made.items():
        path = root / (name.lower() + {"REWARD": ".py", "DATA": ".jsonl"}.get(name.split("_")[0], ".yaml"))
        path.write_text(text)
        out[name] = str(path)
    # Model folders short of what a run reads (item 4): found missing by a look, before any load.
    config = json.dumps({"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 768})
    for name, model_files in {"MODEL_NO_CONFIG": {}, "MODEL_NO_TOKENIZER": {"config.json": config},
                              "MODEL_NO_TEMPLATE": {"config.json": config, "tokenizer.json": "{}",
                                                    "tokenizer_config.json": "{}"}}.items():
        folder = root / name.lower()
        folder.mkdir()
        for file, text in model_files.items():
            (folder / file).write_text(text)
        out[name] = str(folder)
    # Another run's output folder: its checkpoint was trained on another model (item 3).
    other = root / "other_run" / "checkpoints" / "step_000001"
    other.mkdir(parents=True)
    (other / "trainer_state.json").write_text("{}")
    (other / "config.yaml").write_text("model:\n  path: /models/Qwen2.5-7B-Instruct\ntrainer:\n  total_steps: 9\n")
    out["OTHER_RUN"] = str(root / "other_run")
    return out


def _rows(*rows: dict) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


# (arguments, what the last line must contain: a string, or strings it must all contain)
CASES = [
    (["trainer.algorithm=ppo3"], "trainer.algorithm='ppo3' is not allowed"),
    (["actor.rollout_correction.tis_cap=0"], "actor.rollout_correction.tis_cap=0.0 must be > 0"),
    (["actor.rollout_correction.mask_high=0.5"], "actor.rollout_correction.mask_high=0.5 must be >= 1"),
    (["actor.rollout_correction.enable=false", "actor.rollout_correction.tis_cap=2"],
     "actor.rollout_correction.enable=false turns the correction off, but tis_cap=2.0 is set"),
    (["trainer.max_staleness=-1"], "trainer.max_staleness=-1 must be >= 0"),
    (["trainer.max_staleness=1"], "trainer.max_staleness=1 needs rollout.mode=disaggregated"),
    (["trainer.partial_rollout=true"], "trainer.partial_rollout=true lands weight updates in batches still generating"),
    (["trainer.sft_cache=/tmp/warm-starts", "trainer.sft_steps=0"],
     "trainer.sft_cache=/tmp/warm-starts stores warm-starts, and this run has none (trainer.sft_steps=0)"),
    (["rollout.mode=disaggregated", "rollout.num_engines=1", "trainer.max_staleness=1", "trainer.algorithm=dapo"],
     "trainer.algorithm=dapo (dynamic sampling refills a step's groups from its rewards) is synchronous only"),
    (["actor.policy_loss=clipp"], "actor.policy_loss='clipp' is not allowed"),
    (["actor.kl_penalty=k9"], "actor.kl_penalty='k9' is not allowed"),
    (["actor.loss_agg_mode=sum"], "actor.loss_agg_mode='sum' is not allowed"),
    (["tools.format=mistral"], "tools.format='mistral' is not allowed"),
    (["tools.channel=pipe"], "tools.channel='pipe' is not allowed"),
    (["reward.manager=fancy"], "reward.manager='fancy' is not allowed"),
    (["reward.scorer=gsm9k"], "reward.scorer: unknown 'gsm9k'"),
    (["reward.manager_options={foo: 1}"], "reward.manager_options"),
    (["weight_sync.transport=nccl"], "weight_sync.transport='nccl' is not allowed"),
    (["weight_sync.transport=broadcast"], "weight_sync.transport='broadcast' cannot feed rollout.mode='colocated'"),
    (["rollout.engine=sglang"], "rollout.engine='sglang' is not allowed"),
    (["rollout.mode=remote"], "rollout.mode='remote' is not allowed"),
    (["rollout.mode=disaggregated"], "rollout.num_engines=0: rollout.mode=disaggregated runs that many engines"),
    (["rollout.mode=disaggregated", "rollout.num_engines=64"], "rollout.num_engines=64 x rollout.tp=1 engine CPUs"),
    (["rollout.num_engines=3"], "rollout.num_engines=3: colocated mode runs world / rollout.tp = 1 engines"),
    (["rollout.tp=2"], "rollout.tp=2 does not divide the world of 1"),
    (["rollout.max_response_tokens=0"], "rollout.max_response_tokens=0 must be >= 1"),
    (["rollout.max_prompt_tokens=-3"], "rollout.max_prompt_tokens=-3 must be >= 1"),
    (["rollout.temperature=-1"], "rollout.temperature=-1.0 must be >= 0"),
    (["rollout.top_p=1.5"], "rollout.top_p=1.5 must be in (0, 1]"),
    (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization=0.0 must be in (0, 1]"),
    (["actor.optim.lr=-1"], "actor.optim.lr=-1.0 must be > 0"),
    (["critic.optim.lr=0"], "critic.optim.lr=0.0 must be > 0"),
    (["actor.optim.adam_beta2=1.0"], "actor.optim.adam_beta2=1.0 must be in [0, 1)"),
    (["actor.optim.min_lr=1"], "actor.optim.min_lr=1.0 must not exceed actor.optim.lr"),
    (["actor.clip_ratio_c=0.5"], "actor.clip_ratio_c=0.5 must be > 1"),
    (["actor.mini_batch_size=0"], "actor.mini_batch_size=0 must be >= 1"),
    (["reward.timeout_s=0"], "reward.timeout_s=0.0 must be > 0"),
    (["trainer.save_every=-1"], "trainer.save_every=-1 must be >= 0"),
    (["trainer.task=chess"], "trainer.task='chess' is not a built-in task"),
    (["model.params_dtype=float32", "model.layer_spec=transformer_engine"],
     "model.params_dtype=float32 cannot train with model.layer_spec=transformer_engine"),
    (["parallel.tp=3"], "parallel.tp=3 does not divide the model's"),
    (["parallel.vpp=2"], "parallel.vpp=2 needs parallel.pp >= 2"),
    (["parallel.tp=two"], "invalid value for config key 'parallel.tp'"),
    (["parallel.cp=2", "model.layer_spec=local"], "parallel.cp=2 needs an attention that splits packed sequences"),
    (["parallel.cp=2", "actor.max_tokens_per_microbatch=4098"],
     "actor.max_tokens_per_microbatch=4098 must be a multiple of 2 x parallel.cp = 4"),
    (["actor.lrr=1"], "unknown config key 'actor.lrr'"),
    (["actor.optim.lr"], "must look like key=value"),
    (["--config", "BAD_YAML"], "bad_yaml.yaml:3:1: YAML syntax error"),
    (["--config", "BAD_KEY_YAML"], "unknown config key 'actor.lrr'"),
    (["--config", "/nonexistent/run.yaml"], "config file '/nonexistent/run.yaml' does not exist"),
    (["tools.config_path=TOOLS_UNKNOWN"], "unknown tool class 'calculatorr'"),
    (["tools.config_path=TOOLS_BAD_PARAM"], "(python).params: got an unexpected keyword argument 'cpu_seconds'"),
    (["tools.config_path=TOOLS_NOT_LIST"], "tool config must be a list under 'tools:'"),
    (["tools.config_path=TOOLS_BAD_SYNTAX"], "tools.config_path="),
    (["tools.config_path=TOOLS_BAD_IMPORT"], "tool class 'no_such_module.Tool' cannot be imported"),
    (["tools.config_path=/nonexistent/tools.yaml"], "tools.config_path='/nonexistent/tools.yaml' does not exist"),
    (["tools.config_path=TOOLS_CANNOT_START"], ("tools_cannot_start.yaml: a tool does not start: ", "python tool")),
    (["reward.custom_function_path=REWARD_WRONG_SIGNATURE"], "reward.custom_function_name: compute_score(text)"),
    (["reward.custom_function_path=REWARD_OK", "reward.custom_function_name=score"], "reward.custom_function_name"),
    (["reward.custom_function_path=REWARD_SYNTAX"], "reward.custom_function_path"),
    (["reward.custom_function_path=REWARD_RAISES_ON_IMPORT"], "reward.custom_function_path"),
    (["reward.custom_function_path=/nonexistent/reward.py"], "reward.custom_function_path: no file at"),
    (["model.path=/nonexistent/model"], "/nonexistent/model"),
    (["actor.offload=true", "rollout.mode=disaggregated", "rollout.num_engines=1"],
     "actor.offload=true makes room for colocated engines"),
    (["critic.offload=true"], "critic.offload=true, and trainer.algorithm=grpo trains no critic"),
    (["parallel.device_memory_gib=0"], "parallel.device_memory_gib=0.0 must be > 0"),
    (["parallel.device_memory_gib=3", "rollout.gpu_memory_utilization=0.9"],
     "the memory plan needs 4.71 GiB per device in generation, over the device's 3.00 GiB (parallel.device_memory_gib); "
     "biggest terms: engine share (0.9 of the device) 2.70 GiB (lower it: a smaller rollout.gpu_memory_utilization)"),
    (["--config", "NO_MODEL_YAML"], "model.path is required"),
    (["rollout.max_num_seqs=0"], "rollout.max_num_seqs=0 must be >= 1"),
    (["rollout.max_prompt_tokens=1000"], "rollout.max_prompt_tokens + rollout.max_response_tokens = 1064 exceeds the "
                                         "model's context of 1024 tokens"),
    (["rollout.truncation=middle"], "rollout.truncation='middle' is not allowed; choose one of: error, left, right"),
    # The data, checked before any model loads: what once failed after the actor and reference had loaded.
    (["trainer.data_path=DATA"], "trainer.sft_steps=400 needs demonstrations, and no training row has one"),
    (["trainer.data_path=DATA", "trainer.sft_steps=0"],
     # rendered without tool schemas: a user's data gets no tool it did not declare (issue 61 item 1)
     ('data.jsonl row 1 ("What is 12 + 12 + 12', "tokens (chat template), over "
                                                  "rollout.max_prompt_tokens=256; raise rollout.max_prompt_tokens")),
    (["trainer.data_path=DATA_UNSCORED", "trainer.sft_steps=0", "reward.scorer=null"],
     "reward.scorer=null picks each row's scorer by its data_source, and no reward scorer for 'my/colours'"),
    # Issue 61: what a user's own run reads, refused before anything starts (each also with --check,
    # --print-config and --plan below).
    (["--config", "NO_DATA_YAML"], "trainer.data_path is not set: give the run's prompts"),
    (["trainer.data_path=/nonexistent/train.parquet"], "trainer.data_path='/nonexistent/train.parquet' does not exist"),
    (["model.path=MODEL_NO_CONFIG"], "model_no_config' is not a Hugging Face model folder (no config.json)"),
    (["model.path=MODEL_NO_TOKENIZER"], "model_no_tokenizer' has no tokenizer"),
    (["model.path=MODEL_NO_TEMPLATE"], ("model.path=", "model_no_template' has no chat template")),
    (["trainer.resume=disable"], "trainer.resume='disable' is not auto, never or a checkpoint folder"),
    (["trainer.output_dir=OTHER_RUN"], ("would continue", "trained with other settings: model.path=tiny://qwen3 "
                                        "(was /models/Qwen2.5-7B-Instruct)", "give this run its own trainer.output_dir")),
    (["--config", "TOOLS_AS_CONFIG"], "is a tools file (a 'tools:' list), not a run config: give it as tools.config_path="),
    (["--verbose", "rollout.n=0"], "rollout.n=0 must be >= 1"),  # an override after a flag (item 8)
]
# Cases whose error comes from an input --print-config reads too (they printed the tree); --plan
# reads only the config and the model's config.json (a job is planned where its data is not).
INPUT_CASES = range(len(CASES) - 9, len(CASES) - 3)
PLAN_CASES = (len(CASES) - 9, len(CASES) - 7, len(CASES) - 4)  # no data named, no config.json, resume=disable


# Every case through rlf-train's own entry point (`rlfactory_megatron.cli.train.main`, what the
# console script calls) in one process: ~75 fresh interpreters importing torch cost ~5 CPU-minutes.
# A few cases also run as the console script (a process each) and must end the same way.
DRIVER = """
import contextlib, io, json, resource, sys, traceback
from rlfactory_megatron.cli.train import main

def cpu():
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))

results = []
for argv in json.loads(sys.stdin.read()):
    out, err, before = io.StringIO(), io.StringIO(), cpu()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own refusals
            status = exc.code
        except BaseException:
            traceback.print_exc()
            status = None
    results.append({"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(), "cpu_s": cpu() - before})
print(json.dumps(results))
"""
AS_CONSOLE_SCRIPT = (0, 56, 72)  # an allowed-set key, a tool that cannot start, the data


def _argv(args: list[str], paths: dict[str, str], output: Path) -> list[str]:
    """A case's arguments with its file placeholders replaced by the files' paths."""
    args = [paths.get(a, a) for a in args]
    args = [a.split("=", 1)[0] + "=" + paths[a.split("=", 1)[1]] if "=" in a and a.split("=", 1)[1] in paths else a
            for a in args]
    return [f"trainer.output_dir={output}", *args]


def _console_script(argv: list[str], env: dict[str, str]):
    """`rlf-train ARGV` as a process of its own: its result, and its CPU seconds (its own and its
    children's, from wait4: a loaded machine stretches wall time, never these)."""
    proc = subprocess.Popen([str(BIN / "rlf-train"), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    hung = threading.Timer(300, proc.kill)  # a case that hangs fails on its exit status, not the suite
    hung.start()
    stdout, stderr = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # Popen's own wait would discard the usage
    hung.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"status": proc.returncode, "stdout": stdout, "stderr": stderr, "cpu_s": usage.ru_utime + usage.ru_stime}


def _check(args, expected, result) -> None:
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["status"] == 2, (args, result["status"], result["stderr"][-2000:])
    expected = (expected,) if isinstance(expected, str) else expected
    assert lines and lines[-1].startswith("rlf-train: error: "), (args, lines[-3:])
    assert all(part in lines[-1] for part in expected), (args, lines[-3:])
    assert "Traceback" not in result["stderr"] + result["stdout"], (args, result["stderr"][-2000:])
    # Before any model, Ray or vLLM: starting one costs far more than this.
    assert result["cpu_s"] < 10, (args, f"{result['cpu_s']:.1f} CPU s")


def test_every_bad_config_is_refused_at_once_with_the_key_named(tmp_path):
    paths = files(tmp_path)
    output = tmp_path / "out"
    cases = [_argv(args, paths, output) for args, _ in CASES]
    env = env_for(tmp_path)
    driven = subprocess.run([str(BIN / "python"), "-c", DRIVER], input=json.dumps(cases), capture_output=True,
                            text=True, env=env, timeout=900)
    assert driven.returncode == 0, driven.stderr[-3000:]
    results = json.loads(driven.stdout.splitlines()[-1])
    assert len(CASES) >= 30 and len(results) == len(CASES)
    for (args, expected), result in zip(CASES, results):
        _check(args, expected, result)
    for number in AS_CONSOLE_SCRIPT:
        args, expected = CASES[number]
        alone = _console_script(cases[number], env)
        _check(args, expected, alone)
        assert alone["stderr"].splitlines()[-1] == results[number]["stderr"].splitlines()[-1]
    # `rlf-train --check` refuses every one the same way; --print-config and --plan each input mistake
    # (they accepted a missing data file, a model folder without config.json or tokenizer, a bad resume).
    checked = ([["--check", *argv] for argv in cases] + [["--print-config", *cases[n]] for n in INPUT_CASES]
               + [["--plan", *cases[n]] for n in PLAN_CASES])
    driven = subprocess.run([str(BIN / "python"), "-c", DRIVER], input=json.dumps(checked), capture_output=True,
                            text=True, env=env, timeout=900)
    assert driven.returncode == 0, driven.stderr[-3000:]
    again = json.loads(driven.stdout.splitlines()[-1])
    expected = CASES + [CASES[n] for n in INPUT_CASES] + [CASES[n] for n in PLAN_CASES]
    for argv, (args, message), result in zip(checked, expected, again):
        _check(argv, message, result)
    assert not output.exists()  # refused before any work, also the output folder


def _pretend_nvidia_smi(folder: Path, driver: str) -> str:
    """A folder with an `nvidia-smi` that reports one GPU on `driver`; returns a PATH with it first."""
    folder.mkdir(exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho {driver}\n")
    smi.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_no_cuda_driver_check_refuses_a_gpu_node_torch_cannot_use(tmp_path, monkeypatch):
    # Issue 53 item 7: a GPU node on a pre-580 driver (torch here sees no CUDA device, as torch's
    # CUDA 13 build would there) is refused at start with the versions and the fixes named, not
    # trained on its CPU.
    env = {**env_for(tmp_path), "PATH": _pretend_nvidia_smi(tmp_path / "bin", "550.54.15")}
    # A model that is not there: the refusal comes before the model is even looked for.
    result = _console_script([f"trainer.output_dir={tmp_path / 'out'}", f"model.path={tmp_path / 'no-model'}"], env)
    _check([], ("driver 550.54.15", "needs driver >= 580", "upgrade the driver", 'CUDA_VISIBLE_DEVICES=""'), result)
    assert len(result["stderr"].strip().splitlines()) == 1, result["stderr"]
    assert not (tmp_path / "out").exists()

    from rlfactory_megatron.runtime.cuda_driver import unusable_gpu

    monkeypatch.setenv("PATH", _pretend_nvidia_smi(tmp_path / "new", "590.10"))  # new driver, CPU torch
    assert "./install.sh --gpu" in unusable_gpu()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU chosen: as today
    assert unusable_gpu() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                               if not (Path(p) / "nvidia-smi").exists()))  # no GPU: as today
    assert unusable_gpu() is None
