"""GRPO and PPO (with critic) run end to end with tensor and pipeline parallel actors started by
hand (rlf-train runs the tp*pp local ranks itself): each model-parallel group of 2 ranks feeds 2
engines (each in a process of its own, fed by handle), every engine serves the actor's weights
after each sync, tools and rewards run in Ray,
and every rank trains its shard. One layout per algorithm: GRPO (with dual-clip, a loss the user
names over the algorithm's) at pp=2, PPO at tp=2."""
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from rlf_train_cli import records, rlf_train  # noqa: E402


@pytest.mark.parametrize("algorithm,tp,pp,extra", [("grpo", 1, 2, ("actor.policy_loss=dual-clip",)),
                                                   ("ppo", 2, 1, ())])
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
    assert len(list((tmp_path / "run" / "cache" / "rollouts").iterdir())) == 2  # a shard per engine
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "trainer_state.json").is_file()
