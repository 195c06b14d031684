"""GRPO and PPO (with critic) run end to end with tensor and pipeline parallel actors started by
hand (rlf-train runs the tp*pp local ranks itself): each model-parallel group of 2 ranks feeds 2
engines (each in a process of its own, fed by handle), every engine serves the actor's weights
after each sync, tools and rewards run in Ray,
and every rank trains its shard. One layout per algorithm: GRPO (with dual-clip, a loss the user
names over the algorithm's) at pp=2, PPO at tp=2 with the actor's and the critic's state in host
memory while the engines generate (as the PPO example runs), whose checkpoint's HF folder is the
actor's weights in transformers and vLLM, and what `rlf-convert mcore-to-hf` makes of the checkpoint."""
import math
import os
import subprocess

import pytest
import torch

import checkpoint_workers
from rlf_train_cli import BIN, env_for, records, rlf_train, stored_trajectories


@pytest.mark.parametrize("algorithm,tp,pp,extra", [("grpo", 1, 2, ("actor.policy_loss=dual-clip",)),
                                                   ("ppo", 2, 1, ("actor.offload=true", "critic.offload=true"))])
def test_three_steps_with_tools_and_rewards(tmp_path, algorithm, tp, pp, extra):
    # mini_batch_size=2: several optimizer steps per RL step, so old log-probs are computed and the
    # engines' log-probs are compared with them (rollout/logprob_gap_max) at every step.
    out = rlf_train(tmp_path, "run", f"trainer.algorithm={algorithm}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                    "trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=3", "trainer.sft_steps=0",
                    "actor.mini_batch_size=2", *extra)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"tp={tp} pp={pp} on 2 rank(s)" in out.stdout and "step 3/3 | reward" in out.stdout
    run = records(tmp_path / "run")
    assert [r["step"] for r in run] == [1, 2, 3]
    for record in run:
        assert record["rollout/tool_calls_per_sample"] >= 0 and "reward/score/mean" in record
        assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["actor/grad_norm"])
        assert record["rollout/num_engines"] == 2 and record["rollout/engine_imbalance"] >= 1.0
        for engine in range(2):
            assert record[f"rollout/engine_{engine}_generated_tokens"] > 0
            assert record[f"rollout/engine_{engine}_weight_version"] == record["step"] - 1
        assert record["rollout/logprob_gap_max"] <= 1e-4  # every engine serves the actor's weights
        # Each engine core runs in a process of its own (2 ranks): the weights reach it by handle,
        # not through its pipe (every byte of the model did before: 100%).
        assert 0 < record["weight_sync/message_bytes"] < 0.01 * record["weight_sync/bytes"], record
        if algorithm == "ppo":  # GAE advantages are non-zero even when every reward is 0
            assert record["critic/vf_loss"] > 0 and record["critic/grad_norm"] > 0 and record["actor/grad_norm"] > 0
        else:
            assert "actor/dual_clip_frac" in record
    # A rollout shard per DP rank (tp or pp 2 on 2 ranks: one), written by the rank that trains the rows.
    assert len(list((tmp_path / "run" / "cache" / "rollouts").iterdir())) == 1
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "trainer_state.json").is_file()
    if tp == 2:
        _check_the_trained_model_leaves_as_hf(tmp_path, tmp_path / "run" / "checkpoints" / "step_000003")


def _check_the_trained_model_leaves_as_hf(tmp_path, checkpoint):
    """The checkpoint's HF folder (written from 2 TP ranks) loads in transformers and vLLM with the
    actor's log-probs on the run's last trajectories; rlf-convert on the checkpoint writes the same."""
    from transformers import AutoTokenizer

    from rlfactory_megatron.models.hf_checkpoint import iter_safetensors
    from rlfactory_megatron.trainer.model_path import resolve_model_path
    from rlfactory_megatron.runtime.distributed import spawn_local_workers

    os.environ.setdefault("RLF_CACHE_HOME", env_for(tmp_path)["RLF_CACHE_HOME"])  # the run's model cache

    hf = checkpoint / "hf"
    files = {p.name for p in hf.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
    assert AutoTokenizer.from_pretrained(hf).chat_template
    stored = stored_trajectories(tmp_path / "run")
    last = max(step for step, _ in stored)
    rows = [(prompt, response) for (step, _), (prompt, response, _, _) in sorted(stored.items()) if step == last]
    initial = resolve_model_path("tiny://qwen3")  # what the run trained from
    report = spawn_local_workers(checkpoint_workers.log_probs_three_ways, 1, str(checkpoint), str(initial), rows)[0]
    assert report["tokens"] > 100 and report["transformers"] <= 1e-5 and report["vllm"] <= 1e-4, report
    assert report["initial"] > 1e-3, report  # three steps moved the weights: equality says something
    converted = tmp_path / "converted"
    done = subprocess.run([str(BIN / "rlf-convert"), "mcore-to-hf", "--mcore-dir", str(checkpoint), "--out",
                           str(converted)], capture_output=True, text=True, env=env_for(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = dict(iter_safetensors(hf)), dict(iter_safetensors(converted))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
