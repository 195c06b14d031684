"""`rlf-train` end to end on the tiny model: GRPO with the calculator tool in Ray, rewards in Ray,
weight sync into vLLM, metrics/TensorBoard/checkpoints, and resume from the latest checkpoint."""
import json
import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def rlf_train(tmp_path, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", RLF_CACHE_HOME=str(tmp_path / "cache"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RAY_ADDRESS"):
        env.pop(var, None)
    args = ["trainer.prompts_per_step=2", "rollout.n=2", "rollout.max_response_tokens=24", "trainer.val_every=2",
            "trainer.val_prompts=2", "trainer.save_every=2", "trainer.sft_steps=2", "tools.num_workers=1",
            f"trainer.output_dir={tmp_path / 'run'}", *overrides]
    return subprocess.run([str(BIN / "rlf-train"), *args], capture_output=True, text=True, env=env, timeout=900)


def test_grpo_runs_logs_checkpoints_and_resumes(tmp_path):
    first = rlf_train(tmp_path, "trainer.total_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "SFT warm-start done" in first.stdout and "step 2/2 | reward" in first.stdout
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward/score/mean", "actor/pg_loss", "actor/grad_norm", "time/generate_s", "time/update_s",
                "time/sync_s", "perf/tokens_per_s", "rollout/response_tokens_mean", "val/score_mean"):
        assert key in records[-1], key
    assert list((run / "tensorboard").iterdir())
    assert (run / "checkpoints" / "step_000002" / "trainer_state.json").is_file()

    second = rlf_train(tmp_path, "trainer.total_steps=3")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step_000002 at step 2" in second.stdout
    assert "SFT warm-start done" not in second.stdout  # warm-start belongs to a fresh run only
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_bad_config_fails_before_any_work(tmp_path):
    out = rlf_train(tmp_path, "trainer.algorithm=ppo3")
    assert out.returncode == 2 and "trainer.algorithm='ppo3' is not allowed" in out.stderr
    assert not (tmp_path / "run").exists()
