"""Trainer.step is generate -> train -> update_weights: driven on one gloo rank with a real tiny
Megatron learner and stand-ins for the engine fleet and the rollout generator (step_workers.py)."""
import pytest

import step_workers
from rlfactory_megatron.runtime.distributed import spawn_local_workers
from rlfactory_megatron.trainer.trainer import STEP_TIMES


@pytest.fixture(scope="module")
def two_steps(tiny_hf_dirs, tmp_path_factory):
    return spawn_local_workers(step_workers.step_worker, 1, tiny_hf_dirs["qwen3"],
                               str(tmp_path_factory.mktemp("step")), 2)[0]


def test_a_step_generates_sleeps_trains_wakes_and_hands_the_weights_at_the_new_version(two_steps):
    one_step = [("generate", 0), ("sleep", 2), ("rewards",), ("record", 1), ("wake_up", ("weights",)),
                ("before_sync",), ("update_weights", 1, True), ("wake_up", ("kv_cache",)), ("after_sync", 1)]
    second = [event if event[0] not in ("generate", "record", "update_weights", "after_sync") else
              (event[0], event[1] + 1, *event[2:]) for event in one_step]
    assert two_steps["events"] == one_step + second + [("close",)]
    assert two_steps["step_index"] == 2
    assert two_steps["trained_while_asleep"] and two_steps["handed_last"] and two_steps["moved_from_start"]


def test_a_step_trains_the_generated_rows_with_their_group_advantages(two_steps):
    assert two_steps["recorded_ids"] == [True, True]  # the rows the generator made, as trained
    mask = two_steps["loss_mask"] > 0
    for advantages in two_steps["advantages"]:
        # GRPO over groups (rows 0,1) and (2,3) scored (1, 0) and (0, 1): + for the right answer,
        # - for the wrong one, on every response token; none on the prompt or padding
        for row, sign in enumerate((1, -1, -1, 1)):
            assert (advantages[row][mask[row]] * sign > 0).all(), row
        assert (advantages[~mask] == 0).all()


def test_a_step_returns_the_metrics_the_trainer_logs(two_steps):
    for metrics in two_steps["metrics"]:
        for key in (*STEP_TIMES, "perf/step_s", "perf/tokens_per_s", "actor/pg_loss", "actor/grad_norm",
                    "actor/entropy_old", "weight_sync/buckets", "reward/score/mean"):
            assert key in metrics, key
        assert metrics["perf/step_s"] == pytest.approx(sum(metrics[k] for k in STEP_TIMES))
    assert [m["rollout/trained_version"] for m in two_steps["metrics"]] == [0.0, 1.0]
