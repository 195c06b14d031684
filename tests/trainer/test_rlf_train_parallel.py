"""GRPO and PPO (with critic) run end to end with tensor and pipeline parallel actors: rank 0
hosts vLLM, the tool pool and the reward pool in Ray; every rank trains its shard."""
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from rlf_train_cli import rlf_train  # noqa: E402


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_three_steps_with_tools_and_rewards(tmp_path, algorithm, tp, pp):
    out = rlf_train(tmp_path, "run", f"trainer.algorithm={algorithm}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                    "trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=3", "trainer.sft_steps=0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"tp={tp} pp={pp} on 2 rank(s)" in out.stdout and "step 3/3 | reward" in out.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["rollout/tool_calls_per_sample"] >= 0 and "reward/score/mean" in record
        assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["actor/grad_norm"])
        if algorithm == "ppo":  # GAE advantages are non-zero even when every reward is 0
            assert record["critic/vf_loss"] > 0 and record["critic/grad_norm"] > 0 and record["actor/grad_norm"] > 0
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "trainer_state.json").is_file()
